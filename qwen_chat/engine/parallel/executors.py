"""Runs ``StepPlan``s against the model: ``LocalExecutor`` on this process, ``DistributedExecutor`` + ``worker_loop``
across ranks.

The executors make no decisions.  Which slots to free, which KV blocks each holds, which prompts to prefill, which
sequences decode and which token each feeds in are all fixed in the plan by the rank-0 scheduler.  Sampling is
seeded per sequence (``SamplingParams.seed``), which keeps the sampled ids equal on every rank.  The scheduler may
``launch`` a plan whose decode reads each slot's last sampled token on the device (``StepPlan.tokens_on_device``)
and ``collect`` the previous plan's tokens while the device runs it; both executors support this (overlap).

Several ranks: only rank 0 talks to users.  It validates and preprocesses every request before any collective
(bad input fails on rank 0 alone), then, for every engine step, broadcasts the whole ``StepPlan`` (op, CPU
tensors, sampling settings and seeds, which slots to free = Stop) to the other ranks over the gloo control
group (``ranks.init_process_groups``) and runs it itself; each worker runs the identical plan, so every rank
executes the same forward passes (the collectives inside TP / ZeRO-3 layers line up) and samples the same
tokens from the same seeds.  Each rank's sampler then replaces its draw with rank 0's
(``collectives.broadcast_from_rank0``, on the device), so plans with ``tokens_on_device`` keep every rank feeding
the same tokens: rank 0 launches step N+1 before step N's tokens reached its host, and each worker launches a
plan before waiting for the one before it.

The control group has a long timeout (``--collective-timeout-s``, default 7 days) and rank 0 sends a ``ping``
plan whenever it has been silent for ``heartbeat_interval(timeout)`` seconds, so an idle worker never reaches
the timeout while rank 0 lives, and notices a dead rank 0 within that timeout at most (usually at once: the
TCP connection breaks).

Failure policy (a rank that raised inside a collective cannot recover): a ``ChatError`` from the runner (it
checks its input before any state change or collective, identically on every rank) fails only the affected
requests; any other exception while broadcasting or executing a plan is logged and the process leaves with
``os._exit(1)`` (``lifecycle.die``) within seconds; the siblings see a broken gloo connection or are ended by
the DeepSpeed launcher, which exits non-zero, and Supervisor restarts the whole group.  A clean shutdown is an
``exit`` plan from rank 0 (``DistributedExecutor.close``), after which every worker exits 0.

Usage::

    executor = LocalExecutor(runner, sampler)
    tokens = executor.execute(StepPlan(prefills=[PrefillItem(0, prompt, params)]))   # {0: first_token}
    tokens = executor.execute(StepPlan(decode_slots=[0], decode_tokens=[tokens[0]]))  # {0: next_token}
    tokens = executor.collect(executor.launch(StepPlan(decode_slots=[0], tokens_on_device=True)))  # launch: queued
    executor = DistributedExecutor(LocalExecutor(runner, sampler), groups.control, timeout_s)  # rank 0 of several
    executor.close()                                            # sends "exit"
    worker_loop(LocalExecutor(runner, sampler), groups.control) # every other rank; returns after "exit"
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from qwen_chat.chat_types import ChatError, NotReady
from qwen_chat.engine.model.sampling_rules import mark_nonfinite
from qwen_chat.engine.types import SampledTokens, StepPlan
from qwen_chat.lifecycle import die, install_worker_stop_signals

log = logging.getLogger(__name__)

#: The op of every engine step; the distributed layer adds ``PING_OP`` (heartbeat) and ``EXIT_OP`` (shutdown).
STEP_OP = "step"
PING_OP = "ping"
EXIT_OP = "exit"

#: Longest silence of rank 0 on the control group before it sends a ping (seconds).  Short enough that a
#: dead worker is noticed by rank 0 within seconds even when no one is chatting.
MAX_HEARTBEAT_S = 5.0


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds of rank-0 silence after which it pings: a quarter of the collective timeout, at most
    ``MAX_HEARTBEAT_S`` (so at least three pings fit into one timeout window)."""
    return max(0.05, min(MAX_HEARTBEAT_S, float(timeout_s) / 4.0))


class LocalExecutor:
    """Executes step plans with a ``ModelRunner`` and a ``Sampler`` in this process.

    Args:
        runner: ``qwen_chat.engine.model.runner.ModelRunner`` (``prefill(slot, prompt) -> fp32 [V]``,
            ``decode(slots, tokens int64 [B] | None, token_table=None) -> fp32 [B, V]``, ``free(slot)``,
            ``num_slots``).
        sampler: ``qwen_chat.engine.model.sampling.Sampler`` (``start(slot, params)``,
            ``sample_async(slots, logits [B, V]) -> int64 [B]``, ``last_tokens`` int64 [num_slots]).
    """

    def __init__(self, runner, sampler) -> None:
        self.runner = runner
        self.sampler = sampler
        self._host = None  # two pinned int64 [num_slots] buffers for the sampled tokens (CUDA)
        self._turn = 0

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run one plan and wait for its tokens: ``collect(launch(plan))``.

        Op ``"exit"`` does nothing here (``worker_loop`` acts on it).

        Returns:
            ``SampledTokens``: {slot: sampled token id (int)} for every prefilled and decoded slot.
        Raises:
            ValueError: unknown ``plan.op``, mismatched decode lists, or a slot both prefilled and decoded.
            Whatever the runner or sampler raise (the scheduler fails the affected requests).
        """
        if plan.op == EXIT_OP:
            return {}
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> "Launched":
        """Queue one plan on the device and return without waiting for its result: take the plan's KV block
        tables (``plan.blocks``: ``ModelRunner.follow_blocks``); free ``plan.free_slots``; start the chunks that
        continue a kept prefix from it (``PrefillItem.restore``: ``ModelRunner.restore``); prefill the
        ``plan.prefills`` chunks together (``ModelRunner.prefill_batch``); for each chunk that ends its prompt, copy
        its state into the slots of its ``copies`` (the other choices of the request, ``ModelRunner.copy_slot``)
        and sample each one's first token (not for a ``resume``); then one batched decode over
        ``plan.decode_slots`` and sample (with ``plan.spec_k``: ``runner.spec.decode``, a speculative step, waited
        for).  The decode feeds ``plan.decode_tokens``, or with ``plan.tokens_on_device`` the last token sampled
        for each slot (``Sampler.last_tokens``), so a plan can be launched before the previous one's tokens
        reached the host.  At most two launched plans may await
        ``collect`` at a time (their tokens come back through two pinned buffers).  Prefills do wait for the
        device (they check the prompt's token ids there).

        Raises ValueError for an op other than ``"step"``, mismatched decode lists, or a slot both prefilled
        and decoded; whatever the runner or sampler raise (before anything of a refused prefill ran).
        """
        if plan.op != STEP_OP:
            raise ValueError(f"unknown step op {plan.op!r}; expected one of {(STEP_OP, EXIT_OP)}")
        if plan.blocks is not None:  # before anything reads the tables
            self.runner.follow_blocks(plan.blocks, plan.block_copies)
        if not plan.tokens_on_device and len(plan.decode_slots) != len(plan.decode_tokens):
            raise ValueError(f"decode_slots ({len(plan.decode_slots)}) and decode_tokens "
                             f"({len(plan.decode_tokens)}) differ in length")
        prefill_slots = [slot for item in plan.prefills for slot in [item.slot] + [s for s, _ in item.copies]]
        overlap = set(prefill_slots) & set(plan.decode_slots)
        if overlap:
            raise ValueError(f"slots {sorted(overlap)} are both prefilled and decoded in one step")

        for batch, ctx in plan.capture:
            self.runner.capture_all(batch_sizes=[batch], context_buckets=[ctx], why="while idle")
        spec = getattr(self.runner, "spec", None)  # model.spec_step.Speculation, or None
        for slot in plan.free_slots:
            self.runner.free(slot)

        slots: list[int] = []
        parts: list[torch.Tensor] = []
        logprobs: list = []  # sampling_rules.LogprobRows of the draws that asked for them
        with torch.no_grad():
            if plan.prefills:
                for item in plan.prefills:
                    if item.restore is not None:
                        self.runner.restore(item.restore, item.slot)
                    if item.first and not item.resume:
                        self.sampler.start(item.slot, item.sampling)
                logits = self.runner.prefill_batch(plan.prefills)  # fp32 [m, V]: the last chunks that sample
                if spec is not None:  # the MTP head's keys and values of the prompts (a chunk starting one: anew)
                    spec.chunks(plan.prefills)
                row = 0
                for item in plan.prefills:
                    if not item.last or item.resume:
                        continue
                    for slot, sampling in item.copies:
                        self.runner.copy_slot(item.slot, slot)
                        self.sampler.start(slot, sampling)
                    group = [item.slot] + [slot for slot, _ in item.copies]
                    rows = logits[row:row + 1].repeat(len(group), 1) if item.copies else logits[row:row + 1]
                    row += 1
                    drawn, marked = self._sample(group, rows, logprobs)
                    parts.append(marked)
                    slots.extend(group)
                    if spec is not None:  # the MTP head's first position: the prompt's last
                        spec.prefilled(group, item.stop() - 1, self.runner.last_hidden(row - 1), drawn)
            runs = None
            if plan.decode_slots and plan.spec_k:  # a speculative step: 1 .. k + 1 tokens per slot
                runs, plain, rows = spec.decode(self.sampler, plan.decode_slots, plan.decode_tokens, plan.spec_k,
                                                plan.drafts, plan.spec_plain)
                if plain:
                    parts.append(self._sample(plain, rows, logprobs)[1])
                    slots.extend(plain)
            elif plan.decode_slots:
                if spec is not None:
                    spec.forget(plan.decode_slots)
                decode_slots = list(plan.decode_slots)
                if plan.tokens_on_device:
                    logits = self.runner.decode(decode_slots, None, token_table=self.sampler.last_tokens)
                else:
                    logits = self.runner.decode(decode_slots, torch.tensor(plan.decode_tokens, dtype=torch.int64))
                parts.append(self._sample(decode_slots, logits, logprobs)[1])  # fp32 [B, V] -> int64 [B]
                slots.extend(decode_slots)
        if not slots:
            return Launched([], None, None, runs=runs)
        tokens = torch.cat(parts) if len(parts) > 1 else parts[0]
        if tokens.device.type != "cuda":
            return Launched(slots, tokens, None, logprobs, runs)
        if self._host is None:
            n = self.runner.num_slots
            self._host = [torch.zeros(n, dtype=torch.long, pin_memory=True) for _ in range(2)]
        turn = self._turn
        self._turn ^= 1
        host = self._host[turn][:len(slots)]
        host.copy_(tokens, non_blocking=True)
        logprobs = [rows.to_host() for rows in logprobs]
        done = torch.cuda.Event(blocking=True)  # collect sleeps until the step ends: no core spun (performance.md)
        done.record()
        return Launched(slots, host, done, logprobs, runs)

    def _sample(self, slots: list[int], logits: torch.Tensor, logprobs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``sampler.sample_async``, and the draw's log-probabilities appended to ``logprobs`` when a row asks
        (``Sampler.logprobs_async``: no work otherwise).  Returns (the draw, int64 [B] on the device; the same
        for the host, ``NONFINITE_TOKEN`` in rows whose logits were not finite: ``sampling_rules.mark_nonfinite``)."""
        tokens = self.sampler.sample_async(slots, logits)
        rows_of = getattr(self.sampler, "logprobs_async", None)
        rows = rows_of(slots, logits, tokens) if rows_of is not None else None
        if rows is not None:
            logprobs.append(rows)
        return tokens, mark_nonfinite(logits, tokens)

    def collect(self, launched: "Launched") -> SampledTokens:
        """Wait for a launched plan's tokens.  Returns ``SampledTokens``: {slot: sampled token id, or
        ``NONFINITE_TOKEN``} for every prefilled and decoded slot of that plan, with the slots' log-probabilities."""
        if launched.done is not None:
            launched.done.synchronize()
        by_slot = {}
        for rows in launched.logprobs:
            by_slot.update(rows.by_slot())
        out = SampledTokens(() if launched.tokens is None else zip(launched.slots, launched.tokens.tolist()), by_slot)
        out.update(launched.runs or {})
        return out


class Launched:
    """A plan queued by ``LocalExecutor.launch``: its sampled slots, the tensor their tokens arrive in (int64
    [n], pinned host memory on CUDA), the CUDA event after which that tensor holds them (None on CPU), the
    ``sampling_rules.LogprobRows`` of the draws that asked for log-probabilities, and ``runs``: {slot: token
    ids} of a speculative step's slots (already on the host), or None."""

    __slots__ = ("slots", "tokens", "done", "logprobs", "runs")

    def __init__(self, slots: list[int], tokens, done, logprobs: Optional[list] = None, runs=None) -> None:
        self.slots, self.tokens, self.done, self.logprobs, self.runs = slots, tokens, done, logprobs or [], runs


def broadcast_plan(plan: Optional[StepPlan], group: dist.ProcessGroup) -> StepPlan:
    """Rank 0 passes ``plan``; the others pass None and get rank 0's plan (pickled, tensors on CPU).
    Raises: whatever gloo raises (peer gone, timeout) - callers treat it as fatal."""
    box = [plan]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class DistributedExecutor:
    """Rank 0's executor when several ranks run: broadcast each plan, then launch it locally (``launch`` /
    ``collect`` / ``execute``, as ``LocalExecutor``).

    Args:
        local: the ``LocalExecutor`` of rank 0 (``execute(StepPlan) -> {slot: token}``).
        group: the gloo control group from ``ranks.init_process_groups``.
        timeout_s: the control group's timeout (seconds); rank 0 pings after ``heartbeat_interval(timeout_s)``
            seconds of silence.

    Thread safety: ``launch``, the heartbeat thread and ``close`` serialise on one lock, so a plan is never
    interleaved with a ping or the exit message.  Any failure inside a broadcast or a step ends the process
    (``lifecycle.die``): the other ranks are inside the same collectives and cannot be brought back in step.
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
    raises ends the process with ``lifecycle.FAILURE_EXIT_CODE``.  SIGTERM / SIGINT (the launcher or Ctrl-C
    stopping the group) are held off for ``lifecycle.WORKER_SIGTERM_GRACE_S`` seconds so that rank 0's exit plan
    can arrive (``lifecycle.install_worker_stop_signals``); after that the worker leaves with 128 + the signal
    number.
    """
    rank = dist.get_rank()
    install_worker_stop_signals(rank)
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
