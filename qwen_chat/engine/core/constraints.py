"""Constrained decoding under continuous batching: each constrained reply's grammar state and the token masks
the sampler applies, on rank 0.

Who does what:

* ``StructuredOutput.constraints_for(settings, n)`` (``ChatEngine.stream_chat``, the request's thread) compiles
  the grammar a request needs (``qwen_chat.engine.model.grammar.Grammars``; None when it needs none) and
  gives each of its n choices a ``Constraint``: an xgrammar matcher and where the reply is.  Compiling is
  where a schema is refused (``InvalidInput``, HTTP 400), before the request is queued.
* The scheduler (``batch.Batch``) binds a choice's constraint to the slot it gets (``ConstraintTable.bind``)
  and unbinds it when the choice ends.
* The sampler (``Sampler.constraints``, rank 0 only) calls ``ConstraintTable.mask(slots, logits)`` before
  each draw and ``ConstraintTable.drawn(slots, last_tokens)`` after it.  ``drawn`` queues a copy of the
  sampler's token table to pinned host memory and an event; ``mask`` first feeds each constrained slot the
  token of its previous draw (``Constraint.accept``; it waits for that event, i.e. for the previous step's
  sampling only), then the CPU fills one bitmask row per active constraint (xgrammar), one copy takes the
  rows to the logits' device and ``grammar.apply_token_bitmask`` sets the forbidden logits to -inf.  A batch
  without a bound slot returns its logits untouched: no copy, no fill, no kernel.
* A speculative step (``model.spec_step``) verifies k drafts per sequence: ``ConstraintTable.mask_drafts``
  masks each verified position of a constrained row with what the grammar allows after the drafts before it
  (the matcher walks them and rolls back), so a draft the grammar refuses is never kept and the tokens drawn
  are those a plain constrained draw allows; ``ConstraintTable.emitted`` then feeds each row its emitted run.
  The MTP head's drafts are masked too (``ConstraintTable.mask_next_draft``: before each draft's argmax, what
  the grammar allows after the drafts before it), so a constrained row drafts tokens its grammar allows.

With thinking on, a constraint waits for the reasoning to end: it becomes active after ``</think>`` (sampled
by the model or forced by the thinking budget), or, for a grammar of tool calls, at a ``<tool_call>`` inside
the reasoning (the template puts calls after the reasoning, so that token ends it; the matcher accepts it as
the grammar's first token).  While waiting it masks nothing.

Steps launched ahead (the scheduler's overlap) keep working for constrained replies: the runner's forward of
step N+1 is queued on the device before its sampler call, and that call waits (on the host) only for step N's
sampling, so the GPU runs the forward while the CPU feeds the matcher and fills the mask.  A token drawn after
a reply's stop token (the step ahead, whose token the scheduler discards) finds its matcher terminated: that
row is left unmasked.  Under tensor parallelism only rank 0 has constraints: its sampler masks and draws, and
every rank records rank 0's token (``Sampler.token_sync``, always set when several ranks run), so the worker
ranks never need the grammar.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

import torch
import xgrammar as xgr

from qwen_chat.chat_types import GenerationSettings, InvalidInput
from qwen_chat.engine.model.grammar import Grammars, apply_token_bitmask

log = logging.getLogger(__name__)

#: Pinned bitmask buffers the table cycles through (CUDA): one ``mask`` call per prefill group and per decode
#: of a step, each buffer reused only after its copy to the device has finished (an event per buffer).
MASK_BUFFERS = 4


class Constraint:
    """The grammar state of one reply (rank 0; used by the scheduler thread only).

    Args:
        compiled: the reply's ``xgrammar.CompiledGrammar``.
        after_reasoning: True with thinking on: inactive until the reasoning ends (module docstring).
        think_end_id: ``</think>`` (248069 in Qwen3.5, docs/facts.md, "Tokens").
        opening_ids: ids that end the reasoning and are the grammar's first token (``<tool_call>`` for a
            grammar of tool calls), or ().
    """

    def __init__(self, compiled: xgr.CompiledGrammar, *, after_reasoning: bool, think_end_id: int,
                 opening_ids: Sequence[int] = ()) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.active = not after_reasoning
        self.broken = False
        self._think_end = int(think_end_id)
        self._opening = frozenset(int(i) for i in opening_ids)

    def _takes(self, token: int, active: bool) -> tuple[bool, bool]:
        """(active after ``token``, whether the matcher takes ``token``) for a constraint ``active`` before it: an
        active one feeds every token; an inactive one wakes at ``</think>`` (not fed) or at an opening token
        (fed: the grammar's first)."""
        if active or token in self._opening:
            return True, True
        return token == self._think_end, False

    def accept(self, token: int) -> None:
        """The token sampled for this reply (read back by ``ConstraintTable``), in order."""
        token = int(token)
        if self.broken or self.matcher.is_terminated():  # (after the grammar's end: past the reply's stop token)
            return
        self.active, feed = self._takes(token, self.active)
        if feed:
            self._feed(token)

    def draft_rows(self, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int,
                   last_only: bool = False) -> None:
        """The masks of a speculative verify window: row ``first_row + j`` of ``bitmask`` (int32, rows preset to
        all allowed, -1) gets what the grammar allows after the reply's tokens so far and drafts d_1 .. d_j,
        j = 0 .. len(drafts) (``last_only``: only j = len(drafts), into row ``first_row``: the mask of the next
        draft).  A row after a draft the grammar refuses (or after the grammar ended) stays all allowed: that
        draft's own row forbids it, so the verify never keeps it nor uses the rows after it.  The matcher ends
        where it began (``GrammarMatcher.rollback``); the constraint's state is unchanged."""
        if self.broken:
            return
        active, fed = self.active, 0
        try:
            for j in range(len(drafts) + 1):
                if j:
                    active, feed = self._takes(int(drafts[j - 1]), active)
                    if feed:
                        if self.matcher.is_terminated() or not self.matcher.accept_token(int(drafts[j - 1])):
                            break
                        fed += 1
                if active and not self.matcher.is_terminated() and (not last_only or j == len(drafts)):
                    self.matcher.fill_next_token_bitmask(bitmask, first_row + (0 if last_only else j))
        finally:
            if fed:
                self.matcher.rollback(fed)

    def _feed(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            # Not expected: every token of an active constraint was drawn under its mask.  The reply goes on
            # unconstrained rather than failing.
            log.warning("constrained reply: token %d is not allowed by its grammar; the rest is unconstrained",
                        token)
            self.broken = True
            self.active = False


class ConstraintTable:
    """Slot -> ``Constraint`` of the running constrained replies, and the sampler's mask hook.

    Args: ``num_slots`` (rows at most per draw), ``vocab_size`` (logits width V), ``device`` (the logits').
    Memory: ``MASK_BUFFERS`` pinned int32 [num_slots, ceil(V / 32)] buffers on CUDA (31 KB per row for
    Qwen3.5), one pageable buffer on CPU; a pinned int64 [num_slots] copy of the sampled tokens.
    Used by the scheduler thread only.
    """

    def __init__(self, num_slots: int, vocab_size: int, device) -> None:
        self.num_slots = int(num_slots)
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self._by_slot: dict[int, Constraint] = {}
        pinned = self.device.type == "cuda"
        count = MASK_BUFFERS if pinned else 1
        self._buffers = [xgr.allocate_token_bitmask(self.num_slots, self.vocab_size) for _ in range(count)]
        if pinned:
            self._buffers = [b.pin_memory() for b in self._buffers]
        self._copied: list[Optional[torch.cuda.Event]] = [None] * count
        self._turn = 0
        self._batch_fill = xgr.BatchGrammarMatcher()
        self._tokens = torch.zeros(self.num_slots, dtype=torch.long, pin_memory=pinned)
        self._tokens_copied: Optional[torch.cuda.Event] = None
        self._unfed: set[int] = set()  # bound slots whose last drawn token the constraint has not seen
        self._draft_mask: Optional[torch.Tensor] = None  # int32 [B * T, ceil(V / 32)]: ``mask_drafts``'s rows

    def bind(self, slot: int, constraint: Constraint) -> None:
        """The reply in ``slot`` follows ``constraint`` from its next draw on."""
        self._by_slot[int(slot)] = constraint
        self._unfed.discard(int(slot))

    def unbind(self, slot: int) -> None:
        """The slot's reply ended (or had no constraint): its rows are no longer masked."""
        self._by_slot.pop(int(slot), None)
        self._unfed.discard(int(slot))

    @property
    def slots(self) -> frozenset[int]:
        """The slots bound to a constraint now."""
        return frozenset(self._by_slot)

    def mask(self, slots: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (float [B, V], row i drawn for ``slots[i]``) with each active constraint's forbidden
        tokens at -inf (a new tensor), or ``logits`` itself when no row of the batch is constrained."""
        if not self._by_slot:
            return logits
        self._feed([int(s) for s in slots])
        rows = [(i, c) for i, s in enumerate(slots) if (c := self._by_slot.get(int(s))) is not None and c.active
                and not c.matcher.is_terminated()]
        if not rows:
            return logits
        buf = self._next_buffer()
        n = len(slots)
        buf[:n].fill_(-1)  # all allowed: unconstrained rows pass unchanged
        if len(rows) == 1:
            rows[0][1].matcher.fill_next_token_bitmask(buf, rows[0][0])
        else:  # several rows: xgrammar fills them on its own threads
            self._batch_fill.batch_fill_next_token_bitmask([c.matcher for _, c in rows], buf,
                                                           [i for i, _ in rows])
        if self.device.type != "cuda":
            return apply_token_bitmask(logits, buf[:n])
        on_device = buf[:n].to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._copied[self._turn] = done
        return apply_token_bitmask(logits, on_device)

    def mask_drafts(self, slots: Sequence[int], logits: torch.Tensor, drafts: Sequence[Sequence[int]]
                    ) -> torch.Tensor:
        """The verify logits of a speculative step (fp32 [B, T, V], row b for ``slots[b]``, position j after its
        drafts d_1 .. d_j; ``drafts``: B lists of T - 1 host ids) with each constrained row's forbidden tokens at
        -inf at every position (``Constraint.draft_rows``; a new tensor), or ``logits`` itself when no row is
        bound.  A draft the grammar refuses is then never kept (greedy or sampled: its probability is 0)."""
        bound = [(b, c) for b, s in enumerate(slots) if (c := self._by_slot.get(int(s))) is not None]
        if not bound:
            return logits
        self._feed([int(s) for s in slots])
        B, T, V = logits.shape
        buf = self._draft_buffer(B * T)
        for b, c in bound:
            c.draft_rows(list(drafts[b])[:T - 1], buf, b * T)
        # (the caller waits for the step's results before the next call: the buffer is free again by then)
        return apply_token_bitmask(logits.reshape(B * T, V), buf.to(logits.device)).view(B, T, V)

    def mask_next_draft(self, slots: Sequence[int], logits: torch.Tensor, prefixes: Sequence[Sequence[int]]
                        ) -> torch.Tensor:
        """The MTP head's logits for the next draft (float [B, V], row b for ``slots[b]``, whose drafts so far are
        ``prefixes[b]``, host ids) with what the grammar forbids there at -inf (a new tensor), or ``logits``
        itself when no row is bound: the drafts of a constrained row are tokens its grammar allows."""
        bound = [(b, c) for b, s in enumerate(slots) if (c := self._by_slot.get(int(s))) is not None]
        if not bound:
            return logits
        self._feed([int(s) for s in slots])
        buf = self._draft_buffer(logits.shape[0])
        for b, c in bound:
            c.draft_rows(list(prefixes[b]), buf, b, last_only=True)
        return apply_token_bitmask(logits, buf.to(logits.device))

    def _draft_buffer(self, rows: int) -> torch.Tensor:
        """``rows`` rows of the drafts' bitmask buffer, all allowed (-1)."""
        if self._draft_mask is None or self._draft_mask.shape[0] < rows:
            self._draft_mask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        buf = self._draft_mask[:rows]
        buf.fill_(-1)
        return buf

    def emitted(self, runs: dict[int, Sequence[int]]) -> None:
        """After a speculative step: each bound slot's emitted run (kept drafts and the last token, host ids;
        a negative id marks a failed row and is not fed) goes to its constraint, in order."""
        for slot, run in runs.items():
            c = self._by_slot.get(int(slot))
            if c is not None:
                for token in run:
                    if int(token) >= 0:
                        c.accept(int(token))

    def drawn(self, slots: Sequence[int], last_tokens: torch.Tensor) -> None:
        """After a draw: ``last_tokens`` (the sampler's int64 [num_slots] table, this draw's tokens recorded) goes
        to the host without waiting, for the next ``mask`` of these slots to feed their constraints."""
        bound = [int(s) for s in slots if int(s) in self._by_slot]
        if not bound:
            return
        if last_tokens.device.type == "cuda":
            self._tokens.copy_(last_tokens, non_blocking=True)
            self._tokens_copied = torch.cuda.Event()
            self._tokens_copied.record()
        else:
            self._tokens = last_tokens
        self._unfed.update(bound)

    def _feed(self, slots: list[int]) -> None:
        """Give the constraints of ``slots`` the tokens of their previous draw (waits for that draw only)."""
        due = [s for s in slots if s in self._unfed]
        if not due:
            return
        if self._tokens_copied is not None:
            self._tokens_copied.synchronize()
        for s in due:
            self._by_slot[s].accept(int(self._tokens[s]))
            self._unfed.discard(s)

    def _next_buffer(self) -> torch.Tensor:
        self._turn = (self._turn + 1) % len(self._buffers)
        pending = self._copied[self._turn]
        if pending is not None:
            pending.synchronize()  # its last copy to the device has been read
        return self._buffers[self._turn]


class StructuredOutput:
    """Rank 0's structured output: the grammars (compiled on first use: building xgrammar's view of the
    vocabulary takes about a second), each reply's ``Constraint`` and the ``ConstraintTable`` the sampler reads.

    Args:
        tokenizer: the loaded tokenizer; ``vocab_size``, ``device``, ``num_slots``: the sampler's.
        stop_ids: ids that end a reply; ``think_end_id``: ``</think>``; ``tool_ids``: ``(<tool_call>,
        </tool_call>)`` or None.
    """

    def __init__(self, tokenizer, *, vocab_size: int, device, num_slots: int, stop_ids: Sequence[int],
                 think_end_id: int, tool_ids: Optional[tuple[int, int]]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_ids = tuple(stop_ids)
        self.think_end_id = int(think_end_id)
        self.tool_ids = tool_ids
        self.table = ConstraintTable(num_slots, vocab_size, device)
        self._grammars: Optional[Grammars] = None
        self._lock = threading.Lock()

    def grammars(self) -> Grammars:
        """The compiler (built once, thread-safe)."""
        with self._lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.stop_ids, self.tool_ids)
            return self._grammars

    def constraints_for(self, settings: GenerationSettings, n: int) -> Optional[list[Constraint]]:
        """One ``Constraint`` per choice, or None when the request constrains nothing (``tool_choice`` auto or
        none without ``json_schema``).  Raises InvalidInput (400) for a schema xgrammar cannot enforce."""
        tools = settings.tools if settings.tool_choice != "none" else ()
        required = settings.tool_choice == "required" or settings.forced_tool is not None
        if not required and settings.json_schema is None:
            return None
        if required and not tools:
            raise InvalidInput("tool_choice requires a tool call but no tools were given", param="tool_choice")
        grammars = self.grammars()
        if required:
            compiled = grammars.tool_calls(tools, forced=settings.forced_tool, parallel=settings.parallel_tool_calls)
        elif tools:
            compiled = grammars.or_tool_calls(settings.json_schema, tools, parallel=settings.parallel_tool_calls)
        else:
            compiled = grammars.json_schema(settings.json_schema)
        opening = (self.tool_ids[0],) if tools and self.tool_ids is not None else ()
        return [Constraint(compiled, after_reasoning=settings.enable_thinking, think_end_id=self.think_end_id,
                           opening_ids=opening) for _ in range(n)]


def reply_constraints(structure: Optional[StructuredOutput], settings: GenerationSettings
                      ) -> Optional[list[Constraint]]:
    """The constraints of a request's choices (``StructuredOutput.constraints_for``), or None when it needs
    none.  Raises InvalidInput for a schema that cannot be enforced, and when the request needs constraints
    but ``structure`` is None (an executor without a sampler of its own to mask with)."""
    needed = settings.json_schema is not None or settings.tool_choice == "required" or settings.forced_tool
    if not needed:
        return None
    if structure is None:
        raise InvalidInput("structured output (response_format, a required tool call) is not available with "
                           "this engine's executor", param="response_format")
    return structure.constraints_for(settings, settings.n)
