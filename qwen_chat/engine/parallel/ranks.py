"""Several ranks behind one web front: rank info, the gloo control group, step-plan broadcast, the worker loop.

Only rank 0 talks to users.  It validates and preprocesses every request before any collective (bad input
fails on rank 0 alone), then, for every engine step, broadcasts the whole ``StepPlan`` (op, CPU tensors,
sampling settings and seeds, which slots to free = Stop) to the other ranks over a **gloo** group and runs it
itself; each worker runs the identical plan, so every rank executes the same forward passes (the collectives
inside TP / ZeRO-3 layers line up) and samples the same tokens from the same seeds.  Each rank's sampler then
replaces its draw with rank 0's (``collectives.broadcast_from_rank0``, on the device), so a plan may feed each
sequence its last sampled token from the device (``tokens_on_device``): rank 0 launches step N+1 before step
N's tokens reached its host, and each worker launches a plan before waiting for the one before it.

Waiting for requests happens on gloo, never on NCCL (NCCL's watchdog kills a process whose collective waited
longer than its timeout).  The gloo group has a long timeout (``--collective-timeout-s``, default 7 days) and
rank 0 sends a ``ping`` plan whenever it has been silent for ``heartbeat_interval(timeout)`` seconds, so an idle
worker never reaches the timeout while rank 0 lives, and notices a dead rank 0 within that timeout at most
(usually at once: the TCP connection breaks).

Failure policy (a rank that raised inside a collective cannot recover): a ``ChatError`` from the runner (it
checks its input before any state change or collective, identically on every rank) fails only the affected
requests; any other exception while broadcasting or executing a plan is logged and the process leaves with ``os._exit(1)`` within seconds; the siblings see a
broken gloo connection or are ended by the DeepSpeed launcher, which exits non-zero, and Supervisor restarts
the whole group.  A clean shutdown is an ``exit`` plan from rank 0 (``DistributedExecutor.close``), after which
every worker exits 0.

Usage::

    groups = init_process_groups(info, device, timeout_s)       # every rank
    # rank 0
    executor = DistributedExecutor(LocalExecutor(runner, sampler), groups.control, timeout_s)
    executor.execute(plan)   # broadcast + run locally (or launch(plan) ... collect(launched)); close() sends "exit"
    # other ranks
    worker_loop(LocalExecutor(runner, sampler), groups.control) # returns after "exit"
"""
from __future__ import annotations

import glob
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from qwen_chat.chat_types import ChatError, NotReady
from qwen_chat.engine.serving.requests import StepPlan

log = logging.getLogger(__name__)

#: Ops that only the distributed layer uses on top of the executor's ("step", "selfcheck", "exit").
PING_OP = "ping"
EXIT_OP = "exit"

#: Longest silence of rank 0 on the control group before it sends a ping (seconds).  Short enough that a
#: dead worker is noticed by rank 0 within seconds even when no one is chatting.
MAX_HEARTBEAT_S = 5.0

#: Seconds a worker waits, after SIGTERM from the launcher, for rank 0's exit plan before it leaves on its own
#: (below the DeepSpeed launcher's 30 s grace before SIGKILL).
WORKER_SIGTERM_GRACE_S = 20.0

#: Exit code of a rank that left because of a failure (Supervisor restarts the group on any non-zero code).
FAILURE_EXIT_CODE = 1


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds of rank-0 silence after which it pings: a quarter of the collective timeout, at most
    ``MAX_HEARTBEAT_S`` (so at least three pings fit into one timeout window)."""
    return max(0.05, min(MAX_HEARTBEAT_S, float(timeout_s) / 4.0))


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the group, from the launcher's environment.

    ``rank``: global rank (0 serves the web port).  ``local_rank``: index on this host (the GPU it drives).
    ``world_size``: number of ranks.  Without a launcher: rank 0, local rank 0, world size 1.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, local_rank_arg: int = -1) -> "RankInfo":
        """Read ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (set by deepspeed / torchrun); ``local_rank_arg`` is
        the ``--local_rank`` the DeepSpeed launcher appends (used when ``LOCAL_RANK`` is missing).

        Raises: ValueError for inconsistent values (rank outside the world).
        """
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", local_rank_arg if local_rank_arg >= 0 else rank))
        if world < 1 or not (0 <= rank < world) or local < 0:
            raise ValueError(f"inconsistent launcher environment: RANK={rank} LOCAL_RANK={local} WORLD_SIZE={world}")
        return cls(rank=rank, local_rank=local, world_size=world)


@dataclass(frozen=True)
class Groups:
    """The gloo groups of a multi-rank run.

    ``control``: plans and pings, timeout ``--collective-timeout-s`` (what an idle worker waits on).
    ``startup``: the one-off start-up exchanges (checkpoint resolved, self-check results), timeout
    ``STARTUP_TIMEOUT_S``, since ranks may finish downloading or loading minutes apart.
    """

    control: dist.ProcessGroup
    startup: dist.ProcessGroup


#: Timeout of the start-up group (seconds): long enough for rank 0 to download or build a checkpoint while the
#: other ranks wait for it.
STARTUP_TIMEOUT_S = 2 * 3600.0


def init_process_groups(info: RankInfo, device: torch.device, timeout_s: float,
                        need_default_group: bool = False) -> Optional[Groups]:
    """Initialise ``torch.distributed`` and create the gloo groups.

    The default group carries the model's own collectives (TP all-reduce/gather, ZeRO-3 all-gather): NCCL on
    CUDA, gloo on CPU, from the launcher's ``MASTER_ADDR``/``MASTER_PORT`` (``env://``).  DeepSpeed reuses it.
    The control group is a separate gloo group with timeout ``timeout_s`` (seconds) on which workers wait for
    plans.  At world size 1 no gloo group is needed; the default group is still created (in-process, one
    rank) when ``need_default_group`` is True, since DeepSpeed modes need one.

    Returns: the ``Groups``, or None at world size 1.
    """
    if info.world_size == 1 and not need_default_group:
        return None
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if info.world_size == 1 and "MASTER_ADDR" not in os.environ:
            # one process without a launcher (python app.py --ds-config ...): DeepSpeed still reads these
            for key, value in (("RANK", "0"), ("LOCAL_RANK", str(info.local_rank)), ("WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, init_method="env://", rank=info.rank, world_size=info.world_size)
    if info.world_size == 1:
        return None
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=float(timeout_s)))
    startup = dist.new_group(backend="gloo", timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    return Groups(control=control, startup=startup)


def _is_ancestor(pid: int) -> bool:
    """True when ``pid`` is this process's parent, grandparent, ... (read from /proc; False where unreadable)."""
    current = os.getpid()
    for _ in range(64):
        try:
            with open(f"/proc/{current}/stat") as f:
                current = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: ppid
        except (OSError, ValueError, IndexError):
            return False
        if current == pid:
            return True
        if current <= 1:
            return False
    return False


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


#: Set once this rank has begun an orderly shutdown (a stop signal); the launcher watchdog then stands aside.
STOPPING = threading.Event()

#: Seconds the watchdog waits after the launcher vanished before it ends the rank: a SIGTERM to the whole
#: group (Supervisor stop) also ends the launcher at once, and the rank's own shutdown must win that race.
LAUNCHER_GONE_GRACE_S = 5.0


def start_launcher_watchdog(interval_s: float = 1.0) -> Optional[threading.Thread]:
    """Leave the process (code 1) as soon as the launcher that started this rank is gone.

    Under ``start.sh`` the ranks are children of DeepSpeed's ``launch.py``, itself a child of the ``deepspeed``
    runner, which is the process-group leader Supervisor started (``exec`` in start.sh).  A ``kill -9`` of that
    runner (or of ``launch.py``) would otherwise leave the ranks orphaned, still holding the GPUs and the port
    while Supervisor starts a second group.  Watched: the parent process (re-parenting means it died) and the
    process-group leader when it is an ancestor of this rank.  Returns the watchdog thread, or None when this
    process leads its own group (nothing above it to watch).
    """
    parent = os.getppid()
    leader = os.getpgid(0)
    if leader == os.getpid():
        return None
    watch_leader = _is_ancestor(leader)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                gone = f"the launcher (parent pid {parent}) is gone"
            elif watch_leader and not _alive(leader):
                gone = f"the launcher's process group leader (pid {leader}) is gone"
            else:
                continue
            # An orderly stop (SIGTERM to the group) ends the launcher too: give this rank's own shutdown
            # (exit message from rank 0, with its own timers) the time to finish first.
            time.sleep(LAUNCHER_GONE_GRACE_S)
            if not STOPPING.is_set():
                die(f"rank pid {os.getpid()}: {gone}; exiting")
            return

    thread = threading.Thread(target=watch, name="launcher-watchdog", daemon=True)
    thread.start()
    return thread


def die(message: str, code: int = FAILURE_EXIT_CODE) -> None:
    """Log ``message`` (with the current exception, if any) and leave the process at once with ``code``.

    ``os._exit`` skips atexit handlers and thread joins, which could block forever on a broken collective.
    """
    if code == 0:
        log.info(message)
    elif sys.exc_info()[0] is not None:
        log.critical(message, exc_info=True)
    else:
        log.critical(message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    logging.shutdown()
    os._exit(code)


def unlink_deepspeed_shm(rank: int) -> list[str]:
    """Remove this rank's name of DeepSpeed's shared-memory all-reduce buffer once every rank has mapped it.

    On CPU, DeepSpeed's communication backend creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_
    <rank>`` (66 MB per rank; deepspeed/ops/csrc/cpu/comm/shm.cpp) and never removes it, so every multi-rank run
    on a new master port left 132 MB of RAM-backed files behind (measured 2026-11-30: 20 GB after a day of tests).
    Every rank opens the others' buffers while DeepSpeed initialises, so after the start-up self-check (a
    collective on every rank) the names are no longer needed: unlinking keeps the mappings alive and frees the
    memory when the processes end, however they end.  Uses ``MASTER_PORT``; returns the paths removed (none on
    GPU hosts or without a launcher).
    """
    port = os.environ.get("MASTER_PORT")
    if not port:
        return []
    removed = []
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{int(rank)}"):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # already gone
            pass
    if removed:
        log.info("rank %d: unlinked DeepSpeed's shared-memory all-reduce file %s (mapped by every rank)", rank,
                 ", ".join(os.path.basename(p) for p in removed))
    return removed


def broadcast_plan(plan: Optional[StepPlan], group: dist.ProcessGroup) -> StepPlan:
    """Rank 0 passes ``plan``; the others pass None and get rank 0's plan (pickled, tensors on CPU).

    Raises: whatever gloo raises (peer gone, timeout) - callers treat it as fatal.
    """
    box = [plan]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class DistributedExecutor:
    """Rank 0's executor when several ranks run: broadcast each plan, then launch it locally (``launch`` /
    ``collect`` / ``execute``, as ``LocalExecutor``).

    Args:
        local: the ``LocalExecutor`` of rank 0 (``execute(StepPlan) -> {slot: token}``).
        group: the gloo control group from ``init_process_groups``.
        timeout_s: the control group's timeout (seconds); rank 0 pings after ``heartbeat_interval(timeout_s)``
            seconds of silence.

    Thread safety: ``launch``, the heartbeat thread and ``close`` serialise on one lock, so a plan is never
    interleaved with a ping or the exit message.  Any failure inside a broadcast or a step ends the process
    (``die``): the other ranks are inside the same collectives and cannot be brought back in step.
    """

    def __init__(self, local, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.local = local
        self.group = group
        self.interval = heartbeat_interval(timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._exit_sent = False
        self.steps = 0  # plans broadcast (pings and exit excluded); workers log the same count at exit
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="rank0-heartbeat", daemon=True)
        self._thread.start()

    @property
    def tokens_on_device(self) -> bool:
        """True when every rank records rank 0's sampled tokens on its device (the sampler's ``token_sync``), so
        plans with ``tokens_on_device`` (steps launched ahead) keep the ranks feeding the same tokens."""
        return getattr(getattr(self.local, "sampler", None), "token_sync", None) is not None

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Broadcast ``plan`` to every rank, run it here and wait for its tokens: ``collect(launch(plan))``.
        Returns {slot: sampled token id}.  Raises like ``launch``."""
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan):
        """Broadcast ``plan`` to every rank and queue it here without waiting for its tokens
        (``LocalExecutor.launch``); the workers launch it too and wait for their previous step.

        Raises: NotReady once ``close`` has sent the exit message; ValueError for a plan with
        ``tokens_on_device`` when the ranks do not share their sampled tokens (``tokens_on_device`` is False);
        a ``ChatError`` that the runner raised for the plan's input (every rank refuses it the same way).  Exits
        the process on any other failure.
        """
        if plan.tokens_on_device and not self.tokens_on_device:
            raise ValueError("a plan with tokens_on_device needs samplers that share rank 0's tokens (token_sync)")
        with self._lock:
            if self._closed:
                raise NotReady("the engine is shutting down")
            try:
                broadcast_plan(plan, self.group)
                self._last = time.monotonic()
                self.steps += 1
                return self.local.launch(plan)
            except ChatError:
                # The runner refused this plan's input before touching any state or collective; every rank got
                # the same plan and refuses it the same way, so the group stays in step (the scheduler fails
                # only the affected requests).
                raise
            except BaseException:  # noqa: BLE001 - the group is out of step: leave, Supervisor restarts it
                die(f"rank 0: engine step ({plan.op}) failed; exiting so the whole group restarts")
                raise  # not reached

    def collect(self, launched) -> dict[int, int]:
        """Wait for a launched plan's tokens on rank 0: {slot: sampled token id}.  Exits the process if the
        device failed."""
        try:
            return self.local.collect(launched)
        except BaseException:  # noqa: BLE001 - a failed step leaves the group out of step
            die("rank 0: waiting for an engine step failed; exiting so the whole group restarts")
            raise  # not reached

    def health(self) -> dict:
        """{"ok": bool, "reason": str} for /healthz: not ok once closed."""
        return {"ok": not self._closed, "reason": "shut down" if self._closed else "all ranks in step"}

    def close(self) -> bool:
        """Send the ``exit`` plan (workers leave with code 0) and stop the heartbeat.  Idempotent; waits for a
        step in progress to finish first.

        Returns: True when the exit message reached every rank (or was sent by an earlier call), False when a
        worker was already gone.
        """
        with self._lock:
            if self._closed:
                return self._exit_sent
            self._closed = True
            self._stop.set()
            try:
                broadcast_plan(StepPlan(op=EXIT_OP), self.group)
                self._exit_sent = True
                log.info("rank 0: exit sent to %d worker rank(s) after %d steps",
                         dist.get_world_size(self.group) - 1, self.steps)
            except Exception:  # noqa: BLE001 - a worker is already gone; nothing left to stop cleanly
                log.warning("rank 0: could not send exit to the worker ranks", exc_info=True)
            return self._exit_sent

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.interval / 2):
            if time.monotonic() - self._last < self.interval or not self._lock.acquire(blocking=False):
                continue
            try:
                if self._closed:
                    return
                try:
                    broadcast_plan(StepPlan(op=PING_OP), self.group)
                    self._last = time.monotonic()
                except BaseException:  # noqa: BLE001
                    die("rank 0: a worker rank stopped answering on the control group; exiting")
            finally:
                self._lock.release()


def worker_loop(local_executor, group: dist.ProcessGroup) -> None:
    """Run on every rank but 0: receive each plan, launch it (``LocalExecutor.launch``), wait for the step before
    it, discard the tokens; return on ``exit``.  Launching before waiting lets this rank queue step N+1 while the
    GPU still runs step N, as rank 0 does when the scheduler launches steps ahead.

    A broadcast that fails (rank 0 gone, or silent longer than the control group's timeout) or a step that
    raises ends the process with ``FAILURE_EXIT_CODE``.  SIGTERM / SIGINT (the launcher or Ctrl-C stopping the
    group) are held off for ``WORKER_SIGTERM_GRACE_S`` seconds so that rank 0's exit plan can arrive; after
    that the worker leaves with 128 + the signal number.
    """
    rank = dist.get_rank()

    def on_stop_signal(signum, frame):
        if STOPPING.is_set():  # the launcher forwards the group's signal: one grace timer is enough
            return
        STOPPING.set()
        name = signal.Signals(signum).name
        log.info("rank %d: %s; waiting up to %.0f s for rank 0's exit message", rank, name, WORKER_SIGTERM_GRACE_S)
        timer = threading.Timer(WORKER_SIGTERM_GRACE_S, die,
                                args=(f"rank {rank}: no exit message after {name}", 128 + signum))
        timer.daemon = True
        timer.start()

    if threading.current_thread() is threading.main_thread():
        # Ctrl-C in a terminal reaches every rank at once: let rank 0 lead the shutdown as with SIGTERM.
        signal.signal(signal.SIGTERM, on_stop_signal)
        signal.signal(signal.SIGINT, on_stop_signal)
    steps = 0
    pending = None  # the last step launched here, not yet waited for (its tokens are not needed on this rank)
    while True:
        try:
            plan = broadcast_plan(None, group)
        except BaseException:  # noqa: BLE001
            die(f"rank {rank}: lost rank 0 on the control group; exiting")
        if plan.op == PING_OP:
            continue
        if plan.op == EXIT_OP:
            log.info("rank %d: exit message after %d steps; leaving cleanly", rank, steps)
            return
        try:
            launched = local_executor.launch(plan)
            if pending is not None:  # the step before this one: wait for it so at most two are queued
                local_executor.collect(pending)
            pending = launched
        except ChatError as exc:
            # Same plan, same deterministic input check as on rank 0 (see DistributedExecutor.launch).
            log.info("rank %d: step input refused like on rank 0 (%s)", rank, exc)
        except BaseException:  # noqa: BLE001
            die(f"rank {rank}: engine step ({plan.op}) failed; exiting so the whole group restarts")
        steps += 1
