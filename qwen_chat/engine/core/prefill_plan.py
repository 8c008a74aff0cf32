"""The prompt chunks of one step (``plan_prefill``), and the state rows and KV blocks they take, from free ones
or by evicting kept conversation prefixes (``conv_cache``).

Order, under the per-step token budget: prompts already being prefilled continue first, then preempted
sequences (recomputed from their prompt and fed tokens), then the waiting queue, first come first served.  A
sequence is admitted only when a state row and the KV blocks of its whole prompt are free or can be freed by
evicting kept prefixes (least recently used first, never one this plan restores or keeps).  A prompt whose
first tokens a kept prefix holds starts from it (``PrefillItem.restore``) and prefills only the rest (not from a
prefix this same plan keeps: its state is written by the plan's prefill, after the plan's restores).  A waiting
prompt never waits for a running sequence while a row holds only a kept prefix: it takes a free row, else
evicts the least recently used prefix other than the one it starts from, else takes over the row of the
prefix it starts from (``restore`` from that row into itself: the state is continued in place, and the prefix
is no longer kept) unless this plan already restores from that row (then it is admitted at the next step).  A chunk
that covers one of its prompt's keep points (a conversation turn's end; a long system block's end, shared by
other conversations: ``conv_cache``) keeps the state there in a row of its own (``PrefillItem.keeps``), when a
row is free or can be freed and no kept prefix holds those tokens already.  The later choices of a request whose whole prompt is prefilled in one step share
its prefill (``PrefillItem.copies``) when rows allow; the others get their own later.

Every function here runs under the batch's lock (``Batch.cond``) and takes the ``Batch`` as its first argument.
"""
from __future__ import annotations

from typing import Optional

from qwen_chat.engine.core.request_state import Request
from qwen_chat.engine.types import PrefillItem, StepPlan


def plan_prefill(b, plan: StepPlan, in_flight: set) -> list[Request]:
    """Plan the step's prompt chunks into ``plan`` (see the module docstring).  ``in_flight``: ids of the
    requests of the step in flight (a preempted one among them waits).  Returns the requests with a chunk."""
    budget = b.prefill_token_budget
    kv = b.kv
    prefilled: list[Request] = []
    pinned: set[int] = set()  # rows this plan restores from or keeps into
    kept: set[int] = set()  # rows this plan keeps into: written by its prefill, so no restore from them in it

    def chunk(req: Request, restore: Optional[int] = None) -> None:
        nonlocal budget
        start = req.cached
        end = min(req.target.num_tokens, start + budget)
        budget -= end - start
        keeps = _keep_points(b, req, start, end, plan, pinned)
        kept.update(row for _, row in keeps)
        req.cached = end
        plan.prefills.append(PrefillItem(req.slot, req.target, req.sampling, start=start, end=end,
                                         resume=req.resume, restore=restore, keeps=keeps))
        prefilled.append(req)

    for req in sorted((r for r in b.running.values() if r.prefilling), key=lambda r: r.order):
        if budget <= 0:
            return prefilled
        chunk(req)
    for req in sorted((r for r in b.running.values() if r.target is None), key=lambda r: r.order):
        if budget <= 0 or id(req) in in_flight:
            return prefilled
        target = req.recompute_prompt()
        hit = _lookup(b, req, target, kept)
        need = kv.restore_need(hit.n if hit else 0, target.num_tokens + 1)
        if not make_room(b, need, plan, pinned | _rows(hit), alone=b.alone(req)):
            return prefilled  # first come first served: nobody overtakes a preempted sequence
        req.target, req.resume = target, bool(req.generated)
        _start(b, req, hit, pinned)
        chunk(req, hit.row if hit else None)
    while b.waiting and budget > 0:
        req = b.waiting[0]
        hit = _lookup(b, req, req.prompt, kept)
        keep_out = pinned | _rows(hit)
        # the prefix's own row is taken over when no other row can be had (never one this plan reads or writes)
        adoptable = hit is not None and hit.row not in pinned
        if not b.free_rows and (b.cache is None or b.cache.victim(keep_out) is None) and not adoptable:
            break
        need = kv.restore_need(hit.n if hit else 0, req.prompt.num_tokens)
        if not make_room(b, need, plan, keep_out, alone=b.alone(req)):
            break
        row = take_row(b, plan, keep_out)
        if row is None and adoptable:
            row = hit.row
            b.cache.remove(row)  # the sequence continues the kept state in its row: no longer a kept prefix
        if row is None:
            break
        b.waiting.popleft()
        b.admit(req, row)
        if b.cache is not None:
            b.cache.record(hit)  # counted once, at admission (the lookup above may repeat over steps)
        req.handle.cached_tokens = hit.n if hit else 0
        _start(b, req, hit, pinned)
        whole = req.prompt.num_tokens - req.cached <= budget
        chunk(req, hit.row if hit else None)
        item = plan.prefills[-1]
        for sib in req.siblings if whole else ():  # later choices start from this prefill, as rows allow
            if not b.free_rows or sib not in b.waiting or not kv.fits(kv.blocks(req.prompt.num_tokens)):
                break
            b.waiting.remove(sib)
            b.admit(sib, b.free_rows.pop(0))
            kv.start_from(sib.slot, req.slot, sib.prompt.num_tokens, sib.prompt.num_tokens, copy=False)
            sib.cached = sib.target.num_tokens
            prefilled.append(sib)
            item.copies.append((sib.slot, sib.sampling))
    return prefilled


def _rows(hit) -> set:
    return {hit.row} if hit is not None else set()


def _lookup(b, req: Request, target, kept: set):
    """The kept prefix ``target`` (the request's prompt, or its recompute prompt) may start from, or None; not
    one of the rows ``kept`` by this plan (their state is written when the plan runs)."""
    if b.cache is None:
        return None
    key = req.key if target is req.prompt else req.key.extended(target.input_ids.reshape(-1))
    return b.cache.match(key, unwritten=kept)


def _start(b, req: Request, hit, pinned: set) -> None:
    """Give ``req`` (admitted, ``target`` set) the blocks of its target: shared from the kept prefix ``hit``
    and its own for the rest, or all its own; it continues at the prefix's length."""
    n = req.target.num_tokens
    if hit is not None:
        b.kv.start_from(req.slot, hit.row, hit.n, n)
        req.cached = hit.n
        pinned.add(hit.row)
    else:
        b.kv.ensure(req.slot, n)
        req.cached = 0


def _keep_points(b, req: Request, start: int, end: int, plan: StepPlan, pinned: set) -> tuple[tuple[int, int], ...]:
    """(position, row) of each keep point of ``req`` (``PromptKey.keeps``) the chunk start..end covers, for which
    a row can be had without taking one that a waiting request needs, and that no kept prefix holds already
    (the prefix is then registered in the cache).  Empty when none."""
    if b.cache is None:
        return ()
    out = []
    for p in req.key.keeps:
        if not start < p <= end or any(e.n == p for e in req.kept) or b.cache.holds_prefix(req.key, p):
            continue
        if b.waiting and len(b.free_rows) <= len(b.waiting):
            break
        row = take_row(b, plan, pinned)
        if row is None:
            break
        b.kv.keep(row, req.slot, p)
        req.kept.append(b.cache.add(row, req.key, p))
        pinned.add(row)
        out.append((p, row))
    return tuple(out)


def take_row(b, plan: StepPlan, pinned: set) -> Optional[int]:
    """A state row for a new sequence or kept prefix: a free one, else the row of the least recently used kept
    prefix not in ``pinned`` (evicted: the plan frees it before anything is written into it), else None."""
    if b.free_rows:
        return b.free_rows.pop(0)
    row = b.cache.victim(pinned) if b.cache is not None else None
    if row is None:
        return None
    evict(b, row, plan)
    b.free_rows.remove(row)
    return row


def make_room(b, need: int, plan: StepPlan, pinned: set, *, alone: bool = False) -> bool:
    """Evict kept prefixes (least recently used first, not those in ``pinned``) until ``need`` more KV blocks fit
    (``BlockBudget.fits``).  Returns whether they fit."""
    while not b.kv.fits(need, alone=alone):
        row = b.cache.victim(pinned) if b.cache is not None else None
        if row is None:
            return False
        evict(b, row, plan)
    return True


def evict(b, row: int, plan: Optional[StepPlan]) -> None:
    """Forget the prefix kept in ``row``: its blocks go back (those it shares stay with their other owners),
    the row is free, and the runner frees it with ``plan`` (or the next plan when None)."""
    b.cache.remove(row)
    b.kv.release(row)
    (plan.free_slots if plan is not None else b.to_free).append(row)
    b.free_rows.append(row)
    b.free_rows.sort()
