"""The scheduler's batch state: who waits, who runs in which slot, and what the next step does.

``Batch`` is the deciding half of the continuous-batching scheduler; ``Scheduler``
(``qwen_chat.engine.core.scheduler``) owns the model thread and the executor and calls it.  All state lives
under one condition variable, ``Batch.cond``:

- admission (``submit``): the context check, the queue bound (``Busy``), one ``RequestHandle`` per request, one
  per choice for a request with n > 1 (the n choices queue as n requests, one after the other);
- planning (``next_plan``): requests whose consumer went away leave; running sequences decode one token, each
  taking a new KV block when it needs one; when the blocks run out, kept conversation prefixes are evicted
  first, then the newest sequences are preempted (their blocks given back, their slot and sampler state kept)
  and later recomputed from their prompt and the tokens they were fed; then prompt chunks are planned under the
  per-step token budget (``prefill_plan``: admission by free state rows and KV blocks, ``kv_budget``; the
  conversation cache, ``conv_cache``); a long prompt goes in chunks over several steps, so running streams are
  delayed by at most one chunk;
- delivery (``deliver``): each sampled token goes to the request that owns the slot; a stop id or a limit ends it;
  ``NONFINITE_TOKEN`` (the step's logits for that sequence held a NaN or an infinity) ends it with an error;
- retirement (``retire``, ``fail``, ``drain``): a finished request gives its slot back; the runner state of that
  slot is released by the next plan (``StepPlan.free_slots``).

Invariants: a slot belongs to at most one request, and a token sampled for a slot goes only to that request's
stream; every decision that must be the same on every rank (slots, input tokens, seeds, stopping) is made here
on rank 0 and carried in the plan.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Iterable, Optional

from qwen_chat.chat_types import Busy, CancelToken, ContextTooLong, FinishReason, NotReady
from qwen_chat.engine.model.paged import BLOCK_TOKENS, blocks_for
from qwen_chat.engine.core import prefill_plan
from qwen_chat.engine.core.conv_cache import ConversationCache, prompt_key
from qwen_chat.engine.core.handles import RequestHandle
from qwen_chat.engine.core.kv_budget import BlockBudget
from qwen_chat.engine.core.request_state import Request
from qwen_chat.engine.core.spec_policy import MIN_ACCEPTANCE
from qwen_chat.engine.model.spec_sampling import eligible
from qwen_chat.engine.types import NONFINITE_MESSAGE, NONFINITE_TOKEN, PreparedPrompt, SamplingParams, StepPlan

log = logging.getLogger(__name__)

#: Seconds with nothing to do after which the engine captures one more decode graph (``idle_captures``); long
#: enough that a capture (seconds) rarely lands between the requests of one conversation or burst.
IDLE_S = 3.0


class Batch:
    """Waiting queue, running slots and counters of one scheduler (see the module docstring).

    Args: as ``Scheduler``: ``num_slots`` (sequences decoded together), ``max_queue`` (requests that may wait),
    ``eos_ids`` (token ids that end every request), ``max_context`` (tokens per sequence, or None),
    ``prefill_token_budget`` (prompt tokens prefilled in one step at most), ``constraints`` (the
    ``constraints.ConstraintTable`` the sampler masks with, or None: a constrained request's slot is bound to its
    ``Constraint`` while it runs), ``num_blocks`` and ``block_tokens`` (the runner's KV blocks; None: enough for
    every slot at ``max_context``), ``conversation_cache`` (keep prefix states for later prompts of the same
    conversation: ``conv_cache``), ``speculative_tokens`` (k drafts per speculative step, 0: off),
    ``speculative_max_batch`` (larger decode batches never speculate), ``drafter`` (``drafter(request, k) -> k ids``
    on the host, e.g. ``spec_policy.OracleDrafter``; None: the MTP head drafts), ``speculative_min_acceptance``.

    Attributes read by the scheduler: ``cond`` (the lock of everything here), ``stopping`` (no new work; the
    loop ends), ``waiting`` (deque of ``Request``), ``running`` ({slot: Request}), ``totals`` (counters, see
    ``Scheduler.stats``), ``cache`` (the ``ConversationCache``, or None).  Used by ``prefill_plan``:
    ``free_rows`` (state rows nobody uses, sorted), ``to_free`` (rows the next plan frees in the runner), ``kv``.
    """

    def __init__(self, *, num_slots: int, max_queue: int, eos_ids: Iterable[int], max_context: Optional[int],
                 prefill_token_budget: int, constraints=None, num_blocks: Optional[int] = None,
                 block_tokens: int = BLOCK_TOKENS, idle_captures: Optional[list] = None,
                 conversation_cache: bool = False, speculative_tokens: int = 0, speculative_max_batch: int = 8,
                 drafter=None, speculative_min_acceptance: float = MIN_ACCEPTANCE) -> None:
        if prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {prefill_token_budget}")
        self.num_slots = num_slots
        if num_blocks is None:
            num_blocks = num_slots * blocks_for(max_context or 2 ** 30, block_tokens)
        if max_context is None or max_context > num_blocks * block_tokens:
            max_context = num_blocks * block_tokens  # one sequence may use every block, no more
        self.kv = BlockBudget(num_blocks, num_slots, blocks_for(max_context, block_tokens), block_tokens)
        self.cache = ConversationCache() if conversation_cache else None
        self._idle_captures = list(idle_captures or ())
        self._order = itertools.count()
        self.constraints = constraints
        self.max_queue = max_queue
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.max_context = max_context
        self.prefill_token_budget = int(prefill_token_budget)
        self.cond = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.free_rows = list(range(num_slots))
        self.to_free: list[int] = []  # rows whose runner state must be released in the next plan
        self._ids = itertools.count(1)
        self.stopping = False
        self.spec_tokens, self.spec_max_batch = int(speculative_tokens), int(speculative_max_batch)
        self.spec_min = float(speculative_min_acceptance)
        self.drafter = drafter
        self.totals = {
            "spec_steps": 0, "spec_drafted": 0, "spec_accepted": 0,
            "requests": 0, "rejected_busy": 0, "prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
            "nonfinite_logits": 0,
            "step_seconds": 0.0,
            "decode_steps": 0, "max_decode_batch": 0, "preemptions": 0, "prefill_chunks": 0,
            "finished": {"stop": 0, "length": 0, "cancelled": 0, "error": 0},
        }

    def notify(self) -> None:
        """Wake the scheduler thread (a new request, a closed handle, a shutdown)."""
        with self.cond:
            self.cond.notify()

    def stop(self) -> None:
        """Take no new work; the scheduler loop ends at its next plan."""
        with self.cond:
            self.stopping = True
            self.cond.notify()

    # ---- admission -----------------------------------------------------------------------------------
    def submit(self, prompt: PreparedPrompt, sampling: SamplingParams, cancel: CancelToken) -> RequestHandle:
        """Queue a request (see ``Scheduler.submit``).  Raises Busy, ContextTooLong or NotReady."""
        return self.submit_choices(prompt, [sampling], cancel)[0]

    def submit_choices(self, prompt: PreparedPrompt, samplings: list[SamplingParams],
                       cancel: CancelToken, constraints: Optional[list] = None,
                       sink=None) -> list[RequestHandle]:
        """Queue the ``len(samplings)`` choices of one request (see ``Scheduler.submit_choices``): handles with
        indexes 0.. that share one queue (``sink`` when given: any object with ``put``).  Raises Busy, ContextTooLong or NotReady, or ValueError for
        ``constraints`` without a table to bind them to."""
        if constraints is not None and self.constraints is None:
            raise ValueError("constrained requests need a ConstraintTable (the sampler's grammar masks)")
        n = prompt.num_tokens
        if self.max_context is not None and n >= self.max_context:
            raise ContextTooLong.for_prompt(n, self.max_context)
        key = prompt_key(prompt) if self.cache is not None else None  # hashes images: not under the lock
        with self.cond:
            if self.stopping:
                raise NotReady("the engine is shutting down")
            # Waiting requests that a free row (or a kept prefix's) will take at the next step are not queued.
            queued = len(self.waiting) - len(self.free_rows) - (len(self.cache) if self.cache is not None else 0)
            if queued + len(samplings) - 1 >= self.max_queue:
                self.totals["rejected_busy"] += 1
                raise Busy(f"busy, {max(queued, 0)} requests queued, try again in a moment")
            if sink is None and len(samplings) > 1:
                sink = queue.Queue()
            group = []
            for index, sampling in enumerate(samplings):
                handle = RequestHandle(next(self._ids), n, cancel, self.notify, index=index, sink=sink)
                stop_ids = self.eos_ids | frozenset(int(t) for t in sampling.stop_token_ids)
                group.append(Request(handle, prompt, sampling, stop_ids, constraints[index] if constraints is not None
                                     else None, key=key, spec_min=self.spec_min))
            for i, req in enumerate(group):
                req.siblings = group[i + 1:]
            self.waiting.extend(group)
            self.totals["requests"] += 1
            self.totals["prompt_tokens"] += n
            self.cond.notify()
        return [req.handle for req in group]

    # ---- planning ------------------------------------------------------------------------------------
    def next_plan(self, ahead: Optional[list[Request]], overlap: bool
                  ) -> tuple[Optional[StepPlan], list[Request], list[Request]]:
        """Build the next plan under the lock: ``(plan, prefilled, decoded)``, or ``(None, [], [])`` once stopping.

        Waits while there is nothing to do and no step is in flight (``ahead`` is None).  ``ahead``: the requests
        of the step in flight (overlap mode); they are decoded again on the device's copy of their last token,
        except those whose in-flight token reaches ``max_new_tokens`` or the context.  ``overlap``: plans carry
        ``tokens_on_device`` instead of ``decode_tokens``."""
        with self.cond:
            while ahead is None and not self._has_work():
                if not self._idle_captures:
                    self.cond.wait()
                elif not self.cond.wait(IDLE_S) and not self._has_work():  # idle for IDLE_S: capture one graph
                    return StepPlan(capture=[self._idle_captures.pop(0)]), [], []
            if self.stopping:
                return None, [], []
            # Requests whose consumer cancelled or went away leave now, before this step runs.
            for slot, req in list(self.running.items()):
                if req.handle.abandoned:
                    self.retire(req, "cancelled")
            for req in [r for r in self.waiting if r.handle.abandoned]:
                self.waiting.remove(req)
                self.retire(req, "cancelled")
            plan = StepPlan(free_slots=self.to_free, tokens_on_device=overlap)
            self.to_free = []
            in_flight = {id(r) for r in ahead} if ahead is not None else set()
            decoded = self._plan_decode(plan, in_flight, overlap)
            prefilled = prefill_plan.plan_prefill(self, plan, in_flight)
            plan.blocks, plan.block_copies = self.kv.take_changes(), self.kv.take_copies()
            self.totals["steps"] += 1
            self.totals["prefill_chunks"] += len(plan.prefills)
            if decoded:
                self.totals["decode_steps"] += 1
                self.totals["max_decode_batch"] = max(self.totals["max_decode_batch"], len(decoded))
            return plan, prefilled, decoded

    def _has_work(self) -> bool:
        """Something for the next plan: a stop, waiting or running requests, slots to free (caller holds
        ``cond``)."""
        return bool(self.stopping or self.waiting or self.running or self.to_free)

    def _plan_decode(self, plan: StepPlan, in_flight: set, overlap: bool) -> list[Request]:
        """Every decoding sequence feeds one token, except those whose token in flight reaches a limit.  Those
        that enter a new KV block take one; when too few are free, kept prefixes are evicted, then the newest
        sequences are preempted until the rest fit (caller holds ``cond``).  Returns the decoded requests, in
        slot order of ``running``."""
        decoded = [r for r in self.running.values() if r.decoding
                   and not (id(r) in in_flight and self.at_limit(r, 1))]
        kv = self.kv
        k = self.spec_k(decoded) if not in_flight else 0
        while True:
            growing = [r for r in decoded if kv.blocks(r.cached + k + 1) > kv.held(r.slot)]
            if prefill_plan.make_room(self, len(growing), plan, set(), alone=True):  # no watermark for growth
                break
            victim = max((r for r in self.running.values() if r.target is not None), key=lambda r: r.order)
            self._preempt(victim, plan)
            decoded = [r for r in decoded if r is not victim]
        for r in growing:
            kv.ensure(r.slot, r.cached + k + 1)
        for r in decoded:
            r.cached += 1  # a speculative step adds its accepted drafts when it delivers (``deliver``)
        plan.decode_slots = [r.slot for r in decoded]
        if k and decoded:
            plan.spec_k, plan.tokens_on_device = k, False
            plan.spec_plain = [r.slot for r in decoded if not self._speculates(r)]
            if self.drafter is not None:
                plan.drafts = [list(self.drafter(r, k)) if self._speculates(r) else [0] * k for r in decoded]
        if not plan.tokens_on_device:
            plan.decode_tokens = [int(r.last_token) for r in decoded]
        return decoded

    def spec_k(self, decoded: list[Request]) -> int:
        """Drafts per sequence for a step decoding ``decoded`` (caller holds ``cond``): ``speculative_tokens`` when
        there are 1 .. ``speculative_max_batch`` of them, each has room for k + 1 more tokens in the context and
        at least one speculates (``_speculates``), else 0 (a plain step).  In a speculative step the others take
        one plainly sampled token (``StepPlan.spec_plain``), so whether a sequence speculates never depends on
        the rest of the batch."""
        k = self.spec_tokens
        if not k or not decoded or len(decoded) > self.spec_max_batch:
            return 0
        if self.max_context is not None and any(r.cached + k + 1 > self.max_context for r in decoded):
            return 0
        return k if any(self._speculates(r) for r in decoded) else 0

    @staticmethod
    def _speculates(r: Request) -> bool:
        """Whether ``r`` takes drafts in a speculative step: no log-probabilities or thinking budget
        (``spec_sampling.eligible``; a grammar masks its verified positions: ``constraints.mask_drafts``), and its
        acceptance is high enough or a probe is due (``spec_policy.SpecStats``)."""
        return eligible(r.sampling) and r.spec.wants()

    def spec_ready(self) -> bool:
        """True when the next step would speculate if nothing were in flight: the scheduler then waits for the
        step in flight first (a speculative step's lengths depend on what it accepts)."""
        if not self.spec_tokens:  # speculation off (the default): no lock, no pass over the batch per step
            return False
        with self.cond:
            return self.spec_k([r for r in self.running.values() if r.decoding]) > 0

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Take ``req``'s KV blocks back; it keeps its slot (and so its sampler and grammar state) and is
        recomputed later (``Request.recompute_prompt``).  Caller holds ``cond``."""
        self.kv.release(req.slot)
        req.target, req.cached = None, 0
        if req.slot not in plan.free_slots:
            plan.free_slots.append(req.slot)
        self.totals["preemptions"] += 1
        log.info("request %d preempted (KV blocks ran out); it resumes when blocks are free",
                 req.handle.request_id)

    def alone(self, req: Request) -> bool:
        """True when no sequence but ``req`` holds KV blocks (it may then use the watermark too)."""
        return all(r is req or self.kv.held(r.slot) == 0 for r in self.running.values())

    def admit(self, req: Request, row: int) -> None:
        """Give ``req`` the state row ``row`` (its blocks: ``prefill_plan``); caller holds ``cond``."""
        req.slot = row
        req.order = next(self._order)
        req.target, req.cached, req.resume = req.prompt, 0, False
        self.running[row] = req
        self._bind(req)

    def _bind(self, req: Request) -> None:
        """A request got its slot: its draws follow its constraint from now on (when it has one)."""
        if self.constraints is not None:
            if req.constraint is not None:
                self.constraints.bind(req.slot, req.constraint)
            else:
                self.constraints.unbind(req.slot)

    def at_limit(self, req: Request, pending: int = 0) -> bool:
        """True when ``req`` has reached max_new_tokens or the context after ``pending`` more tokens."""
        done = req.handle.completion_tokens + pending
        return done >= req.sampling.max_new_tokens or (
            self.max_context is not None and req.handle.prompt_tokens + done >= self.max_context)

    def free_again(self, slots: list[int]) -> None:
        """A step raised: it may have stopped before its frees ran, so the next plan frees ``slots`` again
        (freeing a slot twice is harmless)."""
        with self.cond:
            self.to_free.extend(s for s in slots if s not in self.to_free)

    # ---- delivery and retirement ---------------------------------------------------------------------
    def deliver(self, reqs: list[Request], tokens: dict[int, int]) -> None:
        """Route a step's sampled tokens ({slot: token id}) to the requests that still own those slots."""
        now = time.monotonic()
        with self.cond:
            for req in reqs:
                if req.slot is None or self.running.get(req.slot) is not req or req.slot not in tokens:
                    continue  # gone, or a prompt chunk that is not its last: no token yet
                run = tokens[req.slot]
                if run == NONFINITE_TOKEN or run == [NONFINITE_TOKEN]:  # its logits held a NaN or an infinity
                    self.totals["nonfinite_logits"] += 1
                    log.error("request %d: non-finite logits (NaN or infinity) after %d token(s); ended with an "
                              "error", req.handle.request_id, req.handle.completion_tokens)
                    self._fail_one(req, NONFINITE_MESSAGE)  # its kept prefix states may hold the fault: dropped
                    continue
                if isinstance(run, list):  # a speculative step: its kept drafts, then one more
                    req.cached += len(run) - 1
                    req.spec.spec_step(self.spec_tokens, len(run) - 1)
                    self.totals["spec_steps"] += 1
                    self.totals["spec_drafted"] += self.spec_tokens
                    self.totals["spec_accepted"] += len(run) - 1
                else:
                    run = [run]
                    if req.decoding and req.generated:
                        req.spec.plain_step()
                for token in run:
                    if self._deliver_one(req, int(token), tokens, now):
                        break

    def _deliver_one(self, req: Request, token: int, tokens, now: float) -> bool:
        """Give ``req`` one token; returns True when that ended it (caller holds ``cond``)."""
        req.generated.append(token)
        h = req.handle
        h.completion_tokens += 1
        self.totals["generated_tokens"] += 1
        if h.ttft_s is None:
            h.ttft_s = now - h.submitted_at
        req.last_token = token
        if token in req.stop_ids:
            self.retire(req, "stop")
            return True
        h.push_token(token, getattr(tokens, "logprobs", {}).get(req.slot))
        if self.at_limit(req):
            self.retire(req, "length")
            return True
        return False

    def retire(self, req: Request, reason: FinishReason, error: str = "") -> None:
        """Finish a request and release its slot (caller holds ``cond``)."""
        if req.slot is not None and self.running.get(req.slot) is req:
            del self.running[req.slot]
            self.kv.release(req.slot)
            if self.constraints is not None:
                self.constraints.unbind(req.slot)
            self.to_free.append(req.slot)
            self.free_rows.append(req.slot)
            self.free_rows.sort()
        req.slot = None
        h = req.handle
        self.totals["finished"][reason] += 1
        h.finish(reason, error)
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

    def fail(self, reqs: list[Request], message: str) -> None:
        """End those of ``reqs`` that still hold their slot with 'error' and ``message`` (meant for the user)."""
        with self.cond:
            for req in reqs:
                self._fail_one(req, message)

    def _fail_one(self, req: Request, message: str) -> None:
        """``fail`` for one request (caller holds ``cond``)."""
        if req.slot is not None and self.running.get(req.slot) is req:
            self.retire(req, "error", message)
        for entry in req.kept:
            if self.cache is not None and self.cache.holds(entry):
                prefill_plan.evict(self, entry.row, None)  # its keep point may not have run

    def drain(self, reason: FinishReason) -> None:
        """End every open stream (shutdown or a dead loop) so that no consumer blocks forever."""
        with self.cond:
            self.stopping = True
            for req in list(self.running.values()) + list(self.waiting):
                self.retire(req, reason)
            self.waiting.clear()
