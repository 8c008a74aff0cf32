"""Prefix states kept for later prompts: what a follow-up turn of a conversation needs to prefill only what is
new (the runner's half; which prompt continues which kept state is the scheduler's: ``core.conv_cache``).

A hybrid model cannot reuse its KV cache alone: the Gated DeltaNet layers carry a conv ring and a recurrent
state that sum up every earlier token and cannot be rewound.  So a kept prefix is the state at one exact
position n, held by a state row of its own (a slot that runs no sequence): the conv ring and recurrent state at
n, the M-RoPE delta, and a block table sharing the KV blocks of positions 0..n-1 with the sequence that made it
(reference-counted, ``paged.BlockTables``).  It is written during a prefill: a chunk's keep point
(``types.PrefillItem.keeps``) makes the forward also write the Gated DeltaNet state at that position into the row
(``delta_rule``), and ``keep_blocks`` then gives the row its blocks.  The row is read-only from then on; the
sequence that made it writes positions >= n into the last, partly filled block they share, which the kept
prefix never reads.

``restore(src, dst)`` starts a slot from a kept row: it shares the row's full blocks, copies the partly filled
last block into a block of its own (copy on write: the slot writes positions >= n into it), copies the conv and
recurrent state, and leaves the slot at length n, ready for a prefill chunk that starts at n.  Under a scheduler
the blocks are the plan's: ``dst``'s table already shares them and the plan copied the partly filled block
(``StepPlan.block_copies``), so only the state is copied here (``ModelRunner.copy_slot`` copies that block
itself, after the prefill that wrote it).  The same copy
starts the other choices of a request from its prefill (``ModelRunner.copy_slot``).  ``restore(row, row)`` takes
the kept row over in place (the scheduler does so when no other row is free: ``core.prefill_plan``): the row
keeps its state and full blocks, and its partly filled last block is copied the same way.  Every rank is given
the same rows, so every rank keeps the same prefixes.
"""
from __future__ import annotations

import torch

from qwen_chat.engine.model.paged import blocks_for


def keep_blocks(runner, slot: int, row: int, n: int, rope_delta: int) -> None:
    """After a prefill wrote the state at position n into ``row``: ``row`` (empty) shares ``slot``'s blocks of
    positions 0..n-1 and holds length n and ``rope_delta``.  Raises ValueError when ``row`` holds blocks."""
    runner.tables.share(row, runner.tables.blocks(slot)[:blocks_for(n, runner.block_tokens)])
    runner.lengths[row] = n
    runner.rope_deltas[row] = rope_delta


@torch.no_grad()
def restore(runner, src: int, dst: int) -> int:
    """Start ``dst`` from the state ``src`` holds at its length n (a kept row, or a prefilled slot); queued on the
    device.  ``dst`` is freed first; ``dst == src`` takes the kept row over in place (the sequence continues its
    state, the row no longer keeps it).  Returns n.  Raises ValueError for an empty ``src``;
    ``paged.OutOfBlocks`` when no block is free for the copy of a partly filled last block."""
    n = runner.lengths[src]
    if n < 1:
        raise ValueError(f"restore needs a source that holds tokens (got {src} -> {dst})")
    rope_delta = runner.rope_deltas[src]
    bt = runner.block_tokens
    full = n // bt
    blocks = runner.tables.blocks(src)
    if runner.tables.following:  # the scheduler gave ``dst`` its blocks; the plan copied the partial one
        runner.free(dst)
        runner.tables.ensure(dst, n)
    else:
        runner.tables.hold(blocks)  # they outlive freeing ``dst`` (``src`` itself when taken over) until copied
        try:
            runner.free(dst)
            runner.tables.share(dst, blocks[:full])
            if n % bt:
                runner.tables.ensure(dst, n)
                runner.copy_blocks([(blocks[full], runner.tables.blocks(dst)[full])])
        finally:
            runner.tables.drop(blocks)
    if src != dst:
        for state in (runner.conv_state, runner.rec_state):
            for t in state.values():
                t[dst].copy_(t[src])
    runner.lengths[dst] = n
    runner.rope_deltas[dst] = rope_delta
    return n


def check_keeps(runner, chunks, slots: set) -> None:
    """Refuse the keep points of a prefill's chunks (``types.PrefillItem``) before any state changes: raises
    ValueError for keep points out of order or outside their chunk, and for a keep row out of range, among the
    step's slots ``slots``, kept twice in the step or holding anything."""
    rows = set()
    for c in chunks:
        points = [p for p, _ in c.keeps]
        if points != sorted(set(points)):
            raise ValueError(f"keep points {points} of one chunk are not in increasing order")
        for p, row in c.keeps:
            if not 0 <= row < runner.num_slots:
                raise ValueError(f"keep row {row} out of range 0..{runner.num_slots - 1}")
            if not c.start < p <= c.stop():
                raise ValueError(f"keep point {p} is outside the chunk {c.start}..{c.stop()}")
            held = runner.tables.count(row) and not runner.tables.following  # a plan gave it the shared blocks
            if row in slots or row in rows or runner.lengths[row] or held:
                raise ValueError(f"keep row {row} is in use")
            rows.add(row)
