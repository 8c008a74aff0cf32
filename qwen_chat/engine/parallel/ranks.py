"""Several ranks behind one web front: this process's rank, the process groups, the launcher watchdog.

Only rank 0 talks to users; every rank runs the same engine steps (``qwen_chat.engine.parallel.executors``:
plan broadcast, ``DistributedExecutor``, ``worker_loop``).  This module holds what every rank sets up first:

- ``RankInfo.from_env()``: rank, local rank and world size from the launcher's environment;
- ``init_process_groups``: the default group for the model's own collectives (NCCL on CUDA, gloo on CPU) and
  two gloo groups, ``control`` (plans and pings, timeout ``--collective-timeout-s``) and ``startup`` (the
  one-off start-up exchanges).  Waiting for requests happens on gloo, never on NCCL (NCCL's watchdog kills a
  process whose collective waited longer than its timeout);
- ``start_launcher_watchdog``: a rank whose launcher died leaves instead of serving unsupervised;
- ``unlink_deepspeed_shm``: DeepSpeed's CPU all-reduce files in ``/dev/shm`` do not outlive the ranks.

Usage::

    info = RankInfo.from_env(local_rank_arg=cfg.local_rank)
    start_launcher_watchdog()                                   # world size > 1
    groups = init_process_groups(info, device, timeout_s)       # every rank; None at world size 1
"""
from __future__ import annotations

import glob
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from qwen_chat.lifecycle import die_unless_stopping

log = logging.getLogger(__name__)


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
                        need_default_group: bool = False, store: Optional[dist.Store] = None) -> Optional[Groups]:
    """Initialise ``torch.distributed`` and create the gloo groups.

    The default group carries the model's own collectives (TP all-reduce/gather, ZeRO-3 all-gather): NCCL on
    CUDA, gloo on CPU, from the launcher's ``MASTER_ADDR``/``MASTER_PORT`` (``env://``).  DeepSpeed reuses it.
    The control group is a separate gloo group with timeout ``timeout_s`` (seconds) on which workers wait for
    plans.  At world size 1 no gloo group is needed; the default group is still created (in-process, one
    rank) when ``need_default_group`` is True, since DeepSpeed modes need one.  ``store``: rendezvous through
    it instead of ``env://`` (a data-parallel replica's own world: ``replicas.ReplicaWorld.replica_store``).

    Returns: the ``Groups``, or None at world size 1.
    """
    if info.world_size == 1 and not need_default_group:
        return None
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if store is not None:
            dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size)
        elif info.world_size == 1 and "MASTER_ADDR" not in os.environ:
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


#: Seconds the watchdog waits after the launcher vanished before it ends the rank: a SIGTERM to the whole
#: group (Supervisor stop) also ends the launcher at once, and the rank's own shutdown must win that race.
#: It does at once: rank 0's handler sets ``lifecycle.STOPPING`` first and sends the exit message, which ends
#: the workers.  Short, because an orphaned rank 0 keeps the port: Supervisor's respawn binds it after ~3 s.
LAUNCHER_GONE_GRACE_S = 1.0
#: Seconds between two looks at the launcher (reads /proc: microseconds each).
LAUNCHER_WATCH_INTERVAL_S = 0.25


def start_launcher_watchdog(interval_s: float = LAUNCHER_WATCH_INTERVAL_S) -> Optional[threading.Thread]:
    """Leave the process (code 1) as soon as the launcher that started this rank is gone: within
    ``interval_s`` + ``LAUNCHER_GONE_GRACE_S`` seconds (1.25 s) of its death.

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
            die_unless_stopping(f"rank pid {os.getpid()}: {gone}; exiting", LAUNCHER_GONE_GRACE_S)
            return

    thread = threading.Thread(target=watch, name="launcher-watchdog", daemon=True)
    thread.start()
    return thread


def unlink_deepspeed_shm(rank: int) -> list[str]:
    """Remove this rank's name of DeepSpeed's shared-memory all-reduce buffer once every rank has mapped it.

    On CPU, DeepSpeed's communication backend creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_
    <rank>`` (66 MB per rank; deepspeed/ops/csrc/cpu/comm/shm.cpp) and never removes it, so every multi-rank run
    on a new master port left 132 MB of RAM-backed files behind (measured: docs/performance.md).
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
