"""Continuous-batching scheduler: the one thread that drives the model through an executor.

Callers ``submit`` a prepared prompt and get a ``RequestHandle`` (``qwen_chat.engine.core.handles``) that yields
the sampled token ids as they come.  One background thread loops: take the next ``StepPlan`` from the batch
state (``qwen_chat.engine.core.batch``: free finished slots, prefill waiting requests into free slots, one
decode step for every running sequence), hand it to the executor, route each sampled token to the stream of
the request that owns the slot.  New requests therefore join the running decode batch between steps, and
finished, cancelled or abandoned requests leave at once and free their slot.

Invariants:
- only the scheduler thread calls the executor (so only it touches the model);
- a slot belongs to at most one request, and a token sampled for a slot goes only to that request's stream;
- every decision that must be the same on every rank (slots, input tokens, seeds, stopping) is made here on
  rank 0 and carried in the plan; workers only execute plans.

Usage::

    sched = Scheduler(LocalExecutor(runner, sampler), num_slots=8, max_queue=64, eos_ids=(248044, 248046))
    handle = sched.submit(prompt, sampling, CancelToken())
    for token_id in handle: ...
    handle.finish_reason   # 'stop' | 'length' | 'cancelled' | 'error'
    sched.shutdown()
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from qwen_chat.chat_types import CancelToken, ChatError, NotReady
from qwen_chat.engine.model.paged import BLOCK_TOKENS
from qwen_chat.engine.core.batch import Batch, Request
from qwen_chat.engine.core.handles import RequestHandle
from qwen_chat.engine.core.spec_policy import MIN_ACCEPTANCE
from qwen_chat.engine.types import PreparedPrompt, SamplingParams, StepPlan

log = logging.getLogger(__name__)

#: Overlap mode: a step with more prompt tokens than this is launched only after the step in flight was
#: collected.  Launching an eager prefill of thousands of tokens keeps the host busy about as long as the GPU
#: runs it, so the tokens of the step in flight reached their streams only after it: in a 32-stream burst of
#: 600-token prompts on an H200 (2026-12-04, serve run s17) every group of first tokens came one 4,096-token
#: prefill step (~120 ms) late, the burst's first one after 145 ms for a 25 ms prefill.  The chunks of up to
#: this many tokens run as CUDA-graph replays (``prefill_graph.PREFILL_BUCKETS[-1]``), which launch in
#: microseconds, and keep the overlap.
COLLECT_FIRST_TOKENS = 1024


@dataclass
class _InFlight:
    """A step launched on the device (overlap mode): the executor's handle, its requests, its launch time."""

    launched: object
    prefilled: list
    decoded: list
    started: float

    @property
    def requests(self) -> list:
        return self.prefilled + self.decoded


class Scheduler:
    """Owns the batch state (``Batch``) and the single model thread (started by the constructor).

    Args:
        executor: object with ``execute(StepPlan) -> {slot: token}`` (``LocalExecutor``/``DistributedExecutor``).
        num_slots: sequences decoded together at most (the runner's ``num_slots``).
        max_queue: requests allowed to wait for a slot; one more raises ``Busy``.
        eos_ids: token ids that end every request (Qwen3.5: ``<|endoftext|>`` 248044, ``<|im_end|>`` 248046,
            docs/facts.md, "Tokens"); each request's ``SamplingParams.stop_token_ids`` are added to them.
        max_context: tokens a sequence may hold (prompt + generated; the runner's ``max_context``), or None.
        prefill_token_budget: prompt tokens prefilled in one step at most: longer prompts go in chunks over
            several steps; running streams wait for the step's prefill, so this bounds their stall.
        num_blocks, block_tokens: the runner's KV blocks (``ModelRunner.num_blocks``/``block_tokens``): admission
            and preemption keep the sequences within them (``kv_budget``).  None: every slot at max_context.
        on_fatal: called once, with the reason, on the scheduler thread after an engine failure (a step
            raised something other than a ``ChatError``, or the loop itself broke) once the affected streams
            have ended; the service uses it to exit the process so that Supervisor restarts it.
        overlap: launch each step before the previous step's tokens reach the host (the executor must have
            ``launch(plan)``/``collect(launched)`` and accept plans with ``tokens_on_device``: a ``LocalExecutor``,
            or a ``DistributedExecutor`` whose ranks share rank 0's sampled tokens, its ``tokens_on_device``).
            The host then builds plans, routes tokens and wakes streams while the GPU computes,
            instead of the GPU idling for it on every step.  A sequence that samples a stop token has already
            been fed to the next step; that step's token for it is discarded (its slot is freed afterwards),
            and sequences that reach their length limit are left out of the step ahead, so no step goes past
            ``max_new_tokens`` or the context.  Constrained requests (structured output) keep the overlap: the
            sampler reads each one's previous token when it masks (``qwen_chat.engine.core.constraints``).  A
            step prefilling more than ``COLLECT_FIRST_TOKENS`` prompt tokens is launched after the step in
            flight was collected (its launch takes as long as its GPU work).
        constraints: the ``constraints.ConstraintTable`` the sampler masks with (rank 0), or None (requests
            with constraints are then refused).
        idle_captures: (padded batch, context bucket) decode graphs to capture, one per step, whenever the
            engine has had nothing to do for ``batch.IDLE_S`` seconds (``StepPlan.capture``).
        conversation_cache: keep the state where each prompt's next turn will continue (``conv_cache``) and
            start later prompts that share it from there; the kept prefixes use the state rows and KV blocks
            no running sequence needs.
        speculative_tokens, speculative_max_batch, drafter: speculative decoding (``batch.Batch``): k drafts per
            step (0: off), the largest decode batch that speculates, drafts from the host (None: the MTP head).
        speculative_min_acceptance: the acceptance under which a sequence stops speculating (``spec_policy``).
            A speculative step is run waited for (the step in flight is collected first): what it accepts
            decides the next step's lengths.
    """

    def __init__(
        self,
        executor,
        *,
        num_slots: int,
        max_queue: int,
        eos_ids: Iterable[int],
        max_context: Optional[int] = None,
        prefill_token_budget: int = 4096,
        num_blocks: Optional[int] = None,
        block_tokens: int = BLOCK_TOKENS,
        on_fatal: Optional[Callable[[str], None]] = None,
        overlap: bool = False,
        constraints=None,
        idle_captures: Optional[list[tuple[int, int]]] = None,
        conversation_cache: bool = False,
        speculative_tokens: int = 0,
        speculative_max_batch: int = 8,
        drafter=None,
        speculative_min_acceptance: float = MIN_ACCEPTANCE,
    ) -> None:
        if num_slots < 1 or max_queue < 0:
            raise ValueError(f"num_slots must be >= 1 and max_queue >= 0, got {num_slots}, {max_queue}")
        self.executor = executor
        self.on_fatal = on_fatal
        #: Called (no arguments) on the scheduler thread after every step's tokens were delivered and once more
        #: after the final drain: ``core.link`` sends the step's output to the front from there.
        self.on_step: Optional[Callable[[], None]] = None
        self.overlap = bool(overlap)
        if self.overlap and not (hasattr(executor, "launch") and hasattr(executor, "collect")):
            raise ValueError("overlap needs an executor with launch() and collect() (LocalExecutor, "
                             "DistributedExecutor)")
        self._batch = Batch(num_slots=num_slots, max_queue=max_queue, eos_ids=eos_ids, max_context=max_context,
                            prefill_token_budget=prefill_token_budget, constraints=constraints,
                            num_blocks=num_blocks, block_tokens=block_tokens,
                            idle_captures=idle_captures, conversation_cache=conversation_cache,
                            speculative_tokens=speculative_tokens, speculative_max_batch=speculative_max_batch,
                            drafter=drafter, speculative_min_acceptance=speculative_min_acceptance)
        self._last_collect_at = 0.0
        self._fatal_reported = False
        self._step_started_at: Optional[float] = None  # time.monotonic() when the running step began
        self._healthy = True
        self._unhealthy_reason = ""
        self._thread = threading.Thread(target=self._loop, name="qwen-chat-scheduler", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------------------------
    def submit(self, prompt: PreparedPrompt, sampling: SamplingParams, cancel: CancelToken) -> RequestHandle:
        """Queue a request; returns its token stream at once (prefill happens on the scheduler thread).

        Raises:
            Busy: ``max_queue`` requests already wait for a slot ("busy, N requests queued, try again").
            ContextTooLong: the prompt alone fills ``max_context``.
            NotReady: the scheduler was shut down.
        """
        return self._batch.submit(prompt, sampling, cancel)

    def submit_choices(self, prompt: PreparedPrompt, samplings: list[SamplingParams],
                       cancel: CancelToken, constraints: Optional[list] = None, sink=None) -> list[RequestHandle]:
        """Queue the n = ``len(samplings)`` choices of one request: n handles (``index`` 0..n-1) on one shared
        queue (``handles.group_chunks``); the choices that find free slots together share one prefill.
        ``constraints``: one ``constraints.Constraint`` per choice (structured output), or None.  ``sink``: the
        queue the handles push to (any object with ``put``; ``core.link`` collects a whole step's output
        there), default a new one.  Raises like ``submit`` (``Busy`` unless all n fit the queue)."""
        return self._batch.submit_choices(prompt, samplings, cancel, constraints, sink)

    def stats(self) -> dict:
        """Counters for metrics: active/queued now, slots, totals since start, health.

        Keys: ``active`` (running sequences), ``queued`` (waiting for a slot), ``num_slots``, ``max_queue``,
        ``kv_blocks``, ``kv_blocks_used`` (KV blocks of the runner that running sequences hold now) and
        ``kv_blocks_cached`` (blocks only kept prefixes hold: evicted as soon as a sequence needs them),
        ``block_tokens``, ``cache`` (None with the conversation cache off, else {entries (kept prefixes now),
        queries (prompts admitted), hits, cached_tokens (prompt tokens not prefilled thanks to a hit),
        system_hits (hits on a shared system block's state)}),
        ``healthy`` (bool), ``reason`` (why unhealthy), ``step_running_s`` (seconds the step in progress has
        been running, 0.0 when idle), ``totals`` {requests, rejected_busy, prompt_tokens,
        generated_tokens, steps, step_seconds (wall seconds spent inside the executor's steps), decode_steps,
        max_decode_batch, preemptions, prefill_chunks, spec_steps (speculative steps), spec_drafted and
        spec_accepted (draft tokens verified and kept), nonfinite_logits (replies ended because their logits held
        a NaN or an infinity), finished {stop, length, cancelled, error}}.
        """
        started = self._step_started_at
        batch = self._batch
        with batch.cond:
            cached_blocks = batch.kv.cached
            totals = dict(batch.totals)
            totals["finished"] = dict(batch.totals["finished"])
            return {
                "active": len(batch.running),
                "queued": len(batch.waiting),
                "num_slots": batch.num_slots,
                "max_queue": batch.max_queue,
                "kv_blocks": batch.kv.num_blocks,
                "kv_blocks_used": batch.kv.used - cached_blocks,
                "kv_blocks_cached": cached_blocks,
                "cache": None if batch.cache is None else {
                    "entries": len(batch.cache), "queries": batch.cache.queries, "hits": batch.cache.hits,
                    "cached_tokens": batch.cache.cached_tokens, "system_hits": batch.cache.system_hits},
                "block_tokens": batch.kv.block_tokens,
                "healthy": self._healthy,
                "reason": self._unhealthy_reason,
                "step_running_s": 0.0 if started is None else time.monotonic() - started,
                "totals": totals,
            }

    @property
    def healthy(self) -> bool:
        """False after the executor raised (or the loop died); ``stats()['reason']`` says why."""
        return self._healthy and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel every waiting and running request, stop the thread (waits up to ``timeout`` seconds)."""
        self._batch.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            runner = getattr(self.executor, "runner", None)  # a local runner allocates its blocks itself again
            if runner is not None and not self._thread.is_alive():
                runner.own_blocks()

    # ---- the model thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        inflight: Optional[_InFlight] = None  # the step launched on the device whose tokens are not back yet
        try:
            while True:
                if inflight is not None and self._batch.spec_ready():  # speculate on known lengths
                    self._collect_now(inflight)
                    inflight = None
                ahead = inflight.requests if inflight is not None else None
                plan, prefilled, decoded = self._batch.next_plan(ahead, self.overlap)
                if plan is None:
                    return
                launched = failure = None
                if plan.free_slots or plan.prefills or plan.decode_slots or plan.capture or plan.blocks:
                    if inflight is not None and prompt_tokens(plan) > COLLECT_FIRST_TOKENS:
                        done, inflight = inflight, None  # its tokens first: this launch takes long
                        error = self._collect_now(done)
                        if error is not None:
                            settled = {id(r) for r in done.requests}  # failed with it already
                            self._fail_step(prefilled + [r for r in decoded if id(r) not in settled], error)
                            continue
                    if self.overlap and not plan.spec_k:
                        launched, failure = self._launch(plan, prefilled, decoded, inflight)
                    else:
                        self._run(plan, prefilled, decoded)
                if inflight is not None:  # what the previous step produced reaches its streams first
                    self._collect(inflight, launched)
                if failure is not None:
                    self._step_failed(*failure)
                inflight = launched
                if self.on_step is not None:  # the step's tokens have reached their handles: send them on
                    self.on_step()
        except BaseException as exc:  # the loop itself broke: nobody may wait forever on a stream
            log.exception("scheduler loop died")
            self._mark_unhealthy(f"scheduler loop died: {exc!r}")
            raise
        finally:
            self._batch.drain("cancelled" if self._healthy else "error")
            if self.on_step is not None:
                self.on_step()
            if not self._healthy:
                self._report_fatal()

    def _run(self, plan: StepPlan, prefilled: list[Request], decoded: list[Request]) -> None:
        """One step, waiting for its tokens (``executor.execute``), then route them."""
        try:
            try:
                self._step_started_at = time.monotonic()
                tokens = self.executor.execute(plan)
            except BaseException:
                self._batch.free_again(plan.free_slots)
                raise
            finally:
                self._batch.totals["step_seconds"] += time.monotonic() - self._step_started_at
                self._step_started_at = None
        except Exception as exc:  # noqa: BLE001 - see _step_failed
            self._step_failed(exc, prefilled, decoded)
            return
        self._batch.deliver(prefilled + decoded, tokens)

    def _launch(self, plan: StepPlan, prefilled: list[Request], decoded: list[Request],
                inflight: Optional["_InFlight"]) -> tuple[Optional["_InFlight"], Optional[tuple]]:
        """Queue a step on the device (overlap mode).  Returns (the step, None), or (None, arguments for
        ``_step_failed``) when it was refused or failed; the caller collects the step in flight first."""
        started = time.monotonic()
        if self._step_started_at is None:
            self._step_started_at = started
        try:
            try:
                launched = self.executor.launch(plan)
            except BaseException:
                self._batch.free_again(plan.free_slots)
                raise
        except Exception as exc:  # noqa: BLE001 - see _step_failed
            if inflight is None:
                self._step_started_at = None
            others = [] if isinstance(exc, ChatError) or inflight is None else inflight.requests
            return None, (exc, prefilled, decoded + [r for r in others if r not in decoded])
        return _InFlight(launched, prefilled, decoded, started), None

    def _collect(self, step: "_InFlight", following: Optional["_InFlight"]) -> Optional[Exception]:
        """Wait for a launched step's tokens and route them (overlap mode).  Returns None, or the exception the
        executor raised (the step's requests and ``following``'s are failed, the scheduler marked unhealthy)."""
        try:
            tokens = self.executor.collect(step.launched)
        except Exception as exc:  # noqa: BLE001 - a device failure: the state may be corrupted
            log.exception("engine step failed; failing %d request(s)", len(step.requests))
            self._fail_step(step.requests + (following.requests if following else []), exc)
            return exc
        finally:
            now = time.monotonic()
            self._batch.totals["step_seconds"] += now - max(step.started, self._last_collect_at)
            self._last_collect_at = now
            self._step_started_at = following.started if following is not None else None
        self._batch.deliver(step.requests, tokens)
        return None

    def _collect_now(self, step: "_InFlight") -> Optional[Exception]:
        """Collect ``step`` before planning or launching the next one (``_collect``, nothing following) and send
        its tokens on (``on_step``).  Returns what ``_collect`` returns."""
        error = self._collect(step, None)
        if self.on_step is not None:
            self.on_step()
        return error

    def _step_failed(self, exc: Exception, prefilled: list[Request], decoded: list[Request]) -> None:
        """A step raised: fail whom it concerns (see the comments); a non-ChatError marks the engine broken."""
        if isinstance(exc, NotReady):
            # The executor was closed under us (rank 0's SIGTERM sends the workers their exit before this thread
            # stops): a shutdown, not a failure.  The loop stops and ends every open stream "cancelled".
            log.info("the executor is shutting down; ending %d open request(s)",
                     len(self._batch.running) + len(self._batch.waiting))
            self._batch.stop()
            return
        if isinstance(exc, ChatError):
            if not prefilled:  # a decode step refused its input: nothing local to blame, treat as fatal
                log.error("decode step refused its input (%s); failing %d request(s)", exc, len(decoded))
                self._fail_step(decoded, exc)
                return
            # A prompt the runner refused (it raises before touching the decode state): only this step's new
            # requests fail, with the user-facing message; running sequences re-run the same decode in the
            # next step (their state and their sampler were not advanced).
            log.warning("prefill refused (%s); failing %d new request(s)", exc, len(prefilled))
            self._batch.fail(prefilled, str(exc))
            return
        log.error("engine step failed; failing %d request(s)", len(prefilled) + len(decoded), exc_info=exc)
        self._fail_step(prefilled + decoded, exc)

    def _fail_step(self, reqs: list[Request], exc: Exception) -> None:
        """The executor failed in a way that may have left the model state inconsistent: fail every request of
        the step with a user-facing message (details only in the log) and mark the scheduler unhealthy."""
        self._batch.fail(reqs, f"the engine failed while generating ({type(exc).__name__}); see the server log")
        self._mark_unhealthy(f"engine step failed: {type(exc).__name__}: {exc}")
        self._report_fatal()

    def _report_fatal(self) -> None:
        if self.on_fatal is None or self._fatal_reported:
            return
        self._fatal_reported = True
        try:
            self.on_fatal(self._unhealthy_reason)
        except Exception:  # noqa: BLE001 - the hook must not take the scheduler thread down with it
            log.exception("on_fatal hook failed")

    def _mark_unhealthy(self, reason: str) -> None:
        with self._batch.cond:
            self._healthy = False
            self._unhealthy_reason = reason


def prompt_tokens(plan: StepPlan) -> int:
    """The prompt tokens ``plan`` prefills (over all its chunks)."""
    return sum(c.stop() - c.start for c in plan.prefills)
