"""Continuous-batching scheduler: the one thread that drives the model, and the per-request token streams.

Callers ``submit`` a prepared prompt and get a ``RequestHandle`` that yields the sampled token ids as they
come.  One background thread loops: build a ``StepPlan`` (free finished slots, prefill waiting requests into
free slots, one decode step for every running sequence), hand it to the executor, route each sampled token to
the stream of the request that owns the slot.  New requests therefore join the running decode batch between
steps, and finished, cancelled or abandoned requests leave at once and free their slot.

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

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

from qwen_chat.chat_types import Busy, CancelToken, ChatError, ContextTooLong, FinishReason, NotReady
from qwen_chat.engine.serving.requests import PrefillItem, PreparedPrompt, SamplingParams, StepPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Finish:
    """Sentinel put on a handle's queue after its last token."""

    reason: FinishReason
    error: str = ""


class RequestHandle:
    """The token stream of one submitted request (thread-safe; consumed by one reader).

    Iterating yields sampled token ids (int) in order, excluding the stop token itself, and ends when the
    request finishes; then ``finish_reason`` is 'stop' (a stop id was sampled), 'length' (``max_new_tokens``
    or the context was reached), 'cancelled' (CancelToken, ``close()``, or shutdown) or 'error' (the executor
    failed; ``error`` holds a message meant for the user, without internals).  ``close()`` tells the scheduler the consumer went away; the request
    leaves the batch at the next step.

    Attributes (set by the scheduler thread): ``prompt_tokens`` (tokens), ``completion_tokens`` (sampled
    tokens including a final stop token, as OpenAI counts them), ``ttft_s`` (seconds from submit to the first
    sampled token, or None), ``submitted_at`` (``time.monotonic()`` seconds).
    """

    def __init__(self, request_id: int, prompt_tokens: int, cancel: CancelToken, wake) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.ttft_s: Optional[float] = None
        self.submitted_at = time.monotonic()
        self.finish_reason: Optional[FinishReason] = None
        self.error = ""
        self._cancel = cancel
        self._closed = threading.Event()
        self._queue: "queue.Queue[int | _Finish]" = queue.Queue()
        self._wake = wake

    # ---- consumer side -------------------------------------------------------------------------------
    @property
    def abandoned(self) -> bool:
        """True once the consumer closed the handle or cancelled its token."""
        return self._closed.is_set() or self._cancel.cancelled

    def close(self) -> None:
        """Stop the request (if still running) at the next step; safe to call many times, from any thread."""
        if not self._closed.is_set():
            self._closed.set()
            self._wake()

    def __iter__(self) -> Iterator[int]:
        for chunk in self.chunks():
            yield from chunk

    def chunks(self, timeout: Optional[float] = None) -> Iterator[list[int]]:
        """Yield lists of token ids: everything sampled since the previous list (at least one id).

        Blocks until a token or the finish arrives.  With ``timeout`` (seconds) an empty list is yielded
        whenever nothing arrived in that time, so the consumer can check its own cancellation.
        """
        while True:
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                yield []
                continue
            batch: list[int] = []
            while True:
                if isinstance(item, _Finish):
                    if batch:
                        yield batch
                    return
                batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            yield batch

    # ---- scheduler side ------------------------------------------------------------------------------
    def _push(self, token: int) -> None:
        self._queue.put(token)

    def _finish(self, reason: FinishReason, error: str = "") -> None:
        self.finish_reason = reason
        self.error = error
        self._queue.put(_Finish(reason, error))


class _Request:
    __slots__ = ("handle", "prompt", "sampling", "stop_ids", "slot", "last_token")

    def __init__(self, handle: RequestHandle, prompt: PreparedPrompt, sampling: SamplingParams, stop_ids):
        self.handle = handle
        self.prompt = prompt
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.slot: Optional[int] = None
        self.last_token: Optional[int] = None


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
    """Owns the slots, the waiting queue and the single model thread (started by the constructor).

    Args:
        executor: object with ``execute(StepPlan) -> {slot: token}`` (``LocalExecutor``/``DistributedExecutor``).
        num_slots: sequences decoded together at most (the runner's ``num_slots``).
        max_queue: requests allowed to wait for a slot; one more raises ``Busy``.
        eos_ids: token ids that end every request (Qwen3.5: ``<|endoftext|>`` 248044, ``<|im_end|>`` 248046,
            qwen3_5-facts.md "Tokens"); each request's ``SamplingParams.stop_token_ids`` are added to them.
        max_context: tokens a sequence may hold (prompt + generated; the runner's ``max_context``), or None.
        prefill_token_budget: prompt tokens prefilled in one step at most (one prompt always goes, however
            long); running streams wait for the step's prefills, so this bounds their stall.
        on_fatal: called once, with the reason, on the scheduler thread after an engine failure (a step
            raised something other than a ``ChatError``, or the loop itself broke) once the affected streams
            have ended; the service uses it to exit the process so that Supervisor restarts it.
        overlap: launch each step before the previous step's tokens reach the host (the executor must have
            ``launch(plan)``/``collect(launched)``, and plans carry ``tokens_on_device``: a ``LocalExecutor``,
            one process).  The host then builds plans, routes tokens and wakes streams while the GPU computes,
            instead of the GPU idling for it on every step.  A sequence that samples a stop token has already
            been fed to the next step; that step's token for it is discarded (its slot is freed afterwards),
            and sequences that reach their length limit are left out of the step ahead, so no step goes past
            ``max_new_tokens`` or the context.
    """

    def __init__(
        self,
        executor,
        *,
        num_slots: int,
        max_queue: int,
        eos_ids: Iterable[int],
        max_context: Optional[int] = None,
        prefill_token_budget: int = 8192,
        on_fatal: Optional[Callable[[str], None]] = None,
        overlap: bool = False,
    ) -> None:
        if num_slots < 1 or max_queue < 0:
            raise ValueError(f"num_slots must be >= 1 and max_queue >= 0, got {num_slots}, {max_queue}")
        self.executor = executor
        self.num_slots = num_slots
        self.max_queue = max_queue
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.max_context = max_context
        self.prefill_token_budget = int(prefill_token_budget)
        self.on_fatal = on_fatal
        self.overlap = bool(overlap)
        if self.overlap and not (hasattr(executor, "launch") and hasattr(executor, "collect")):
            raise ValueError("overlap needs an executor with launch() and collect() (LocalExecutor)")
        self._last_collect_at = 0.0
        self._fatal_reported = False
        self._step_started_at: Optional[float] = None  # time.monotonic() when the running step began
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}  # slot -> request
        self._free_slots = list(range(num_slots))
        self._to_free: list[int] = []  # slots whose runner state must be released in the next plan
        self._ids = itertools.count(1)
        self._stopping = False
        self._healthy = True
        self._unhealthy_reason = ""
        self._totals = {
            "requests": 0, "rejected_busy": 0, "prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
            "step_seconds": 0.0,
            "decode_steps": 0, "max_decode_batch": 0,
            "finished": {"stop": 0, "length": 0, "cancelled": 0, "error": 0},
        }
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
        n = prompt.num_tokens
        if self.max_context is not None and n >= self.max_context:
            raise ContextTooLong(
                f"prompt is {n} tokens but the context holds {self.max_context}; shorten the conversation",
                prompt_tokens=n, context_length=self.max_context,
            )
        stop_ids = self.eos_ids | frozenset(int(t) for t in sampling.stop_token_ids)
        with self._cond:
            if self._stopping:
                raise NotReady("the engine is shutting down")
            # Waiting requests that a free slot will take at the next step do not count as queued.
            queued = len(self._waiting) - len(self._free_slots)
            if queued >= self.max_queue:
                self._totals["rejected_busy"] += 1
                raise Busy(f"busy, {queued} requests queued, try again in a moment")
            handle = RequestHandle(next(self._ids), n, cancel, self._notify)
            self._waiting.append(_Request(handle, prompt, sampling, stop_ids))
            self._totals["requests"] += 1
            self._totals["prompt_tokens"] += n
            self._cond.notify()
        return handle

    def stats(self) -> dict:
        """Counters for metrics: active/queued now, slots, totals since start, health.

        Keys: ``active`` (running sequences), ``queued`` (waiting for a slot), ``num_slots``, ``max_queue``,
        ``healthy`` (bool), ``reason`` (why unhealthy), ``step_running_s`` (seconds the step in progress has
        been running, 0.0 when idle), ``totals`` {requests, rejected_busy, prompt_tokens,
        generated_tokens, steps, step_seconds (wall seconds spent inside the executor's steps), decode_steps,
        max_decode_batch, finished {stop, length, cancelled, error}}.
        """
        started = self._step_started_at
        with self._cond:
            totals = dict(self._totals)
            totals["finished"] = dict(self._totals["finished"])
            return {
                "active": len(self._running),
                "queued": len(self._waiting),
                "num_slots": self.num_slots,
                "max_queue": self.max_queue,
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
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- the model thread ----------------------------------------------------------------------------
    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    def _loop(self) -> None:
        inflight: Optional[_InFlight] = None  # the step launched on the device whose tokens are not back yet
        try:
            while True:
                plan, prefilled, decoded = self._next_plan(inflight)
                if plan is None:
                    return
                launched = failure = None
                if plan.free_slots or plan.prefills or plan.decode_slots:
                    if self.overlap:
                        launched, failure = self._launch(plan, prefilled, decoded, inflight)
                    else:
                        self._run(plan, prefilled, decoded)
                if inflight is not None:  # what the previous step produced reaches its streams first
                    self._collect(inflight, launched)
                if failure is not None:
                    self._step_failed(*failure)
                inflight = launched
        except BaseException as exc:  # the loop itself broke: nobody may wait forever on a stream
            log.exception("scheduler loop died")
            self._mark_unhealthy(f"scheduler loop died: {exc!r}")
            raise
        finally:
            self._drain("cancelled" if self._healthy else "error")
            if not self._healthy:
                self._report_fatal()

    def _run(self, plan: StepPlan, prefilled: list[_Request], decoded: list[_Request]) -> None:
        """One step, waiting for its tokens (``executor.execute``), then route them."""
        try:
            try:
                self._step_started_at = time.monotonic()
                tokens = self.executor.execute(plan)
            except BaseException:
                self._free_again(plan)
                raise
            finally:
                self._totals["step_seconds"] += time.monotonic() - self._step_started_at
                self._step_started_at = None
        except Exception as exc:  # noqa: BLE001 - see _step_failed
            self._step_failed(exc, prefilled, decoded)
            return
        self._deliver(prefilled + decoded, tokens)

    def _free_again(self, plan: StepPlan) -> None:
        """A step raised: it may have stopped before its frees ran, so the next plan frees those slots again
        (freeing a slot twice is harmless)."""
        with self._cond:
            self._to_free.extend(s for s in plan.free_slots if s not in self._to_free)

    def _launch(self, plan: StepPlan, prefilled: list[_Request], decoded: list[_Request],
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
                self._free_again(plan)
                raise
        except Exception as exc:  # noqa: BLE001 - see _step_failed
            if inflight is None:
                self._step_started_at = None
            others = [] if isinstance(exc, ChatError) or inflight is None else inflight.requests
            return None, (exc, prefilled, decoded + [r for r in others if r not in decoded])
        return _InFlight(launched, prefilled, decoded, started), None

    def _collect(self, step: "_InFlight", following: Optional["_InFlight"]) -> None:
        """Wait for a launched step's tokens and route them (overlap mode)."""
        try:
            tokens = self.executor.collect(step.launched)
        except Exception as exc:  # noqa: BLE001 - a device failure: the state may be corrupted
            log.exception("engine step failed; failing %d request(s)", len(step.requests))
            self._fail_step(step.requests + (following.requests if following else []), exc)
            return
        finally:
            now = time.monotonic()
            self._totals["step_seconds"] += now - max(step.started, self._last_collect_at)
            self._last_collect_at = now
            self._step_started_at = following.started if following is not None else None
        self._deliver(step.requests, tokens)

    def _step_failed(self, exc: Exception, prefilled: list[_Request], decoded: list[_Request]) -> None:
        """A step raised: fail whom it concerns (see the comments); a non-ChatError marks the engine broken."""
        if isinstance(exc, NotReady):
            # The executor was closed under us (rank 0's SIGTERM sends the workers their exit before this thread
            # stops): a shutdown, not a failure.  The loop stops and ends every open stream "cancelled".
            log.info("the executor is shutting down; ending %d open request(s)", len(self._running) + len(self._waiting))
            with self._cond:
                self._stopping = True
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
            self._fail_requests(prefilled, str(exc))
            return
        log.error("engine step failed; failing %d request(s)", len(prefilled) + len(decoded), exc_info=exc)
        self._fail_step(prefilled + decoded, exc)

    def _next_plan(self, inflight: Optional["_InFlight"] = None
                   ) -> tuple[Optional[StepPlan], list[_Request], list[_Request]]:
        """Build the next plan under the lock (waits while there is nothing to do and no step is in flight).

        With a step in flight (overlap mode) its sequences are decoded again on the device's copy of their
        last token, except those whose in-flight token reaches ``max_new_tokens`` or the context."""
        with self._cond:
            while inflight is None and not (self._stopping or self._waiting or self._running or self._to_free):
                self._cond.wait()
            if self._stopping:
                return None, [], []
            # Requests whose consumer cancelled or went away leave now, before this step runs.
            for slot, req in list(self._running.items()):
                if req.handle.abandoned:
                    self._retire(req, "cancelled")
            for req in [r for r in self._waiting if r.handle.abandoned]:
                self._waiting.remove(req)
                self._retire(req, "cancelled")
            plan = StepPlan(free_slots=self._to_free, tokens_on_device=self.overlap)
            self._to_free = []
            # Running sequences decode one token; waiting ones are prefilled into free slots.
            decoded = list(self._running.values())
            if inflight is not None:
                ahead = {id(r) for r in inflight.requests}
                decoded = [r for r in decoded if id(r) not in ahead or not self._at_limit(r, 1)]
            plan.decode_slots = [r.slot for r in decoded]
            if not self.overlap:
                plan.decode_tokens = [int(r.last_token) for r in decoded]
            prefilled: list[_Request] = []
            budget = self.prefill_token_budget
            while self._waiting and self._free_slots:
                # At least one prefill per step; more only while they fit the budget, so that a burst of long
                # prompts does not stall the running streams for many prefills in a row.
                if prefilled and self._waiting[0].prompt.num_tokens > budget:
                    break
                req = self._waiting.popleft()
                budget -= req.prompt.num_tokens
                req.slot = self._free_slots.pop(0)
                self._running[req.slot] = req
                prefilled.append(req)
                plan.prefills.append(PrefillItem(req.slot, req.prompt, req.sampling))
            self._totals["steps"] += 1
            if decoded:
                self._totals["decode_steps"] += 1
                self._totals["max_decode_batch"] = max(self._totals["max_decode_batch"], len(decoded))
            return plan, prefilled, decoded

    def _at_limit(self, req: _Request, pending: int = 0) -> bool:
        """True when ``req`` has reached max_new_tokens or the context after ``pending`` more tokens."""
        h = req.handle
        done = h.completion_tokens + pending
        return done >= req.sampling.max_new_tokens or (
            self.max_context is not None and h.prompt_tokens + done >= self.max_context)

    def _deliver(self, reqs: list[_Request], tokens: dict[int, int]) -> None:
        now = time.monotonic()
        with self._cond:
            for req in reqs:
                if req.slot is None or self._running.get(req.slot) is not req:
                    continue
                token = int(tokens[req.slot])
                h = req.handle
                h.completion_tokens += 1
                self._totals["generated_tokens"] += 1
                if h.ttft_s is None:
                    h.ttft_s = now - h.submitted_at
                req.last_token = token
                if token in req.stop_ids:
                    self._retire(req, "stop")
                    continue
                h._push(token)
                if self._at_limit(req):
                    self._retire(req, "length")

    def _retire(self, req: _Request, reason: FinishReason, error: str = "") -> None:
        """Finish a request and release its slot (caller holds the lock)."""
        if req.slot is not None and self._running.get(req.slot) is req:
            del self._running[req.slot]
            self._to_free.append(req.slot)
            self._free_slots.append(req.slot)
            self._free_slots.sort()
        req.slot = None
        h = req.handle
        self._totals["finished"][reason] += 1
        h._finish(reason, error)
        if h.ttft_s is not None:
            elapsed = time.monotonic() - h.submitted_at
            decode_s = elapsed - h.ttft_s
            rate = (h.completion_tokens - 1) / decode_s if decode_s > 0 and h.completion_tokens > 1 else 0.0
            log.info(
                "request %d %s: prompt %d tok, completion %d tok, TTFT %.3f s, decode %.1f tok/s",
                h.request_id, reason, h.prompt_tokens, h.completion_tokens, h.ttft_s, rate,
            )
        else:
            log.info("request %d %s before its first token", h.request_id, reason)

    def _fail_requests(self, reqs: list[_Request], message: str) -> None:
        with self._cond:
            for req in reqs:
                if req.slot is not None and self._running.get(req.slot) is req:
                    self._retire(req, "error", message)

    def _fail_step(self, reqs: list[_Request], exc: Exception) -> None:
        """The executor failed in a way that may have left the model state inconsistent: fail every request of
        the step with a user-facing message (details only in the log) and mark the scheduler unhealthy."""
        self._fail_requests(reqs, f"the engine failed while generating ({type(exc).__name__}); see the server log")
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
        with self._cond:
            self._healthy = False
            self._unhealthy_reason = reason

    def _drain(self, reason: FinishReason) -> None:
        """End every open stream (shutdown or a dead loop) so that no consumer blocks forever."""
        with self._cond:
            self._stopping = True
            for req in list(self._running.values()) + list(self._waiting):
                self._retire(req, reason)
            self._waiting.clear()
