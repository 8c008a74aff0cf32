"""Prefix states kept for later prompts: what a follow-up turn of a conversation needs to prefill only what is
new.

A hybrid model cannot reuse its KV cache alone: the Gated DeltaNet layers carry a conv ring and a recurrent
state that sum up every earlier token and cannot be rewound.  So a kept prefix (an *entry*) is the state at one
exact position n: the KV blocks of positions 0..n-1 (reference-counted, ``paged.BlockTables.hold``) and a copy
of the slot's conv and recurrent state in a row of its own (the rows after the scratch slot,
``state.SlotState(num_snapshots=)``), with the slot's M-RoPE delta.

``restore(entry, slot)`` starts a slot from an entry: it shares the entry's full blocks, copies the partly filled
last block into a block of its own (the slot writes positions >= n into it; the entry and others keep reading
theirs), copies the conv and recurrent state, and leaves the slot at length n, ready for a prefill chunk that
starts at n (``ModelRunner.prefill_batch``).  Which prompt may continue which entry (the same first n token
ids) is the caller's decision; every rank is given the same entry ids, so every rank keeps the same entries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen_chat.engine.model.paged import blocks_for


@dataclass
class _Entry:
    """A kept prefix: its length (tokens), M-RoPE delta and blocks (position order)."""

    n: int
    rope_delta: int
    blocks: tuple


class PrefixSnapshots:
    """The kept prefixes of one runner (see the module docstring).

    Args:
        runner: the ``ModelRunner`` whose state rows ``num_slots + 1 ..`` hold the entries.
        count: entries that can be kept at once (ids 0..count-1).
    """

    def __init__(self, runner, count: int) -> None:
        self._runner = runner
        self.count = int(count)
        self._base = runner.num_slots + 1  # state row of entry 0 (after the live slots and the scratch slot)
        self._entries: dict[int, _Entry] = {}

    def __contains__(self, entry: int) -> bool:
        return entry in self._entries

    def length(self, entry: int) -> int:
        """Tokens of the kept prefix ``entry``.  Raises KeyError for an entry not kept."""
        return self._entries[entry].n

    def _check(self, entry: int) -> None:
        if not 0 <= entry < self.count:
            raise ValueError(f"prefix entry {entry} out of range 0..{self.count - 1}")

    @torch.no_grad()
    def take(self, slot: int, entry: int) -> None:
        """Keep ``slot``'s state at its current length as ``entry`` (replacing what the entry held).  Queued on
        the device; the slot goes on unchanged.  Raises ValueError for an entry out of range or an empty slot."""
        r = self._runner
        self._check(entry)
        n = r.lengths[slot]
        if n < 1:
            raise ValueError(f"slot {slot} holds no tokens to keep")
        self.forget(entry)
        blocks = tuple(r.tables.blocks(slot)[:blocks_for(n, r.block_tokens)])
        r.tables.hold(blocks)
        row = self._base + entry
        for state in (r.conv_state, r.rec_state):
            for t in state.values():
                t[row].copy_(t[slot])
        self._entries[entry] = _Entry(n, r.rope_deltas[slot], blocks)

    @torch.no_grad()
    def restore(self, entry: int, slot: int) -> int:
        """Start ``slot`` (freed first) from ``entry``; returns the entry's length n, the slot's length now.
        Raises KeyError for an entry not kept; ``paged.OutOfBlocks`` when no block is free for the copy of a
        partly filled last block."""
        r = self._runner
        e = self._entries[entry]
        r.free(slot)
        bt = r.block_tokens
        full = e.n // bt
        r.tables.share(slot, e.blocks[:full])
        if e.n % bt:
            r.tables.ensure(slot, e.n)
            src = torch.tensor([e.blocks[full]], device=r.device)
            dst = torch.tensor([r.tables.blocks(slot)[full]], device=r.device)
            for cache in (r.k_cache, r.v_cache):
                for t in cache.values():
                    t[dst] = t[src]
        row = self._base + entry
        for state in (r.conv_state, r.rec_state):
            for t in state.values():
                t[slot].copy_(t[row])
        r.lengths[slot] = e.n
        r.rope_deltas[slot] = e.rope_delta
        r._restored.add(slot)
        return e.n

    def forget(self, entry: int) -> None:
        """Let go of ``entry`` (its blocks return to the free list unless a slot or another entry owns them)."""
        e = self._entries.pop(entry, None)
        if e is not None:
            self._runner.tables.drop(e.blocks)
