"""The scheduler's KV blocks: the one allocator of block ids, and the counts that admission, growth, eviction
and preemption decide by.

The scheduler allocates every block id (a host-only ``paged.BlockTables`` over the runner's state rows) and each
plan carries the table entries that changed since the last plan (``take_changes`` -> ``StepPlan.blocks``) and the
blocks to copy before it runs (``take_copies`` -> ``StepPlan.block_copies``); every rank's runner applies them
(``paged.BlockTables.follow``) and only checks that a step finds the blocks it needs.  A sequence is given, on
admission, the blocks of its whole prompt (a prompt prefilled in chunks holds them from its first chunk on); one
more block each time a decode step takes it into a new block (k + 1 positions ahead for a speculative step); a
sequence that starts from a kept prefix shares that prefix's full blocks and gets a block of its own for the
partly filled last one, into which the plan copies the prefix's (copy on write); the other choices of a request
share its prompt's full blocks the same way (the runner copies the last one after the prefill wrote it); a prefix
kept at position n shares its sequence's first ``blocks_for(n)`` blocks; everything goes back when a sequence
finishes or is preempted and when a kept prefix is evicted (or taken over in place by a sequence that continues
it).
"""
from __future__ import annotations

from qwen_chat.engine.model.paged import BLOCK_TOKENS, BlockTables, blocks_for


class BlockBudget:
    """Free-block count of one scheduler, per state row.

    Args:
        num_blocks: KV blocks of the runner (``ModelRunner.num_blocks``).
        num_rows: state rows (the runner's ``num_slots``): running sequences and kept prefixes.
        max_blocks: blocks of the longest sequence (``blocks_for(max_context)``).
        block_tokens: positions per block.

    Attributes: ``num_blocks``, ``block_tokens``, ``watermark`` (blocks an admission must leave free, so that
    the running sequences can grow for a while before anyone is preempted: 1 % of the blocks, at least 1),
    ``cached`` (blocks that only kept prefixes hold, counted as ownership changes: evictable).
    Raises ValueError for ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int, num_rows: int, max_blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.block_tokens = int(block_tokens)
        self.watermark = max(1, self.num_blocks // 100)
        self._tables = BlockTables(num_slots=num_rows, num_blocks=self.num_blocks, max_blocks=max(1, max_blocks),
                                   device=None, block_tokens=self.block_tokens)
        self._live = [0] * self.num_blocks  # owners of each block that are running sequences' rows
        self._kept_rows: set[int] = set()   # rows that hold kept prefixes
        self._copies: list[tuple[int, int]] = []  # (source block, target block) for the next plan
        self.cached = 0

    def take_changes(self) -> list[tuple[int, int, int]]:
        """Table entries changed since the last call, in order: [(row, index, block id or the null block)]
        (``paged.BlockTables.take_changes``), for the next plan (``StepPlan.blocks``)."""
        return self._tables.take_changes()

    def take_copies(self) -> list[tuple[int, int]]:
        """Blocks to copy before the next plan runs (source, target): the partly filled last block of each kept
        prefix a sequence started from since the last call (``start_from``)."""
        out, self._copies = self._copies, []
        return out

    @property
    def free(self) -> int:
        """Blocks nobody holds."""
        return self._tables.free_blocks

    @property
    def used(self) -> int:
        """Blocks held by sequences and kept prefixes (each shared block once)."""
        return self.num_blocks - self.free

    def _live_gain(self, blocks) -> None:
        """A running sequence's row took ``blocks`` (already owned by it): those only kept prefixes held are no
        longer ``cached``."""
        t = self._tables
        for b in blocks:
            if self._live[b] == 0 and t.owners(b) > 1:
                self.cached -= 1
            self._live[b] += 1

    def blocks(self, n_tokens: int) -> int:
        """Blocks that hold n_tokens positions (``paged.blocks_for``)."""
        return blocks_for(n_tokens, self.block_tokens)

    def table(self, row: int) -> tuple[int, ...]:
        """Block ids ``row`` holds, in position order (what the runners' tables hold once the plans ran)."""
        return tuple(self._tables.blocks(row))

    def held(self, row: int) -> int:
        """Blocks ``row`` holds now."""
        return self._tables.count(row)

    def fits(self, need: int, *, alone: bool = False) -> bool:
        """True when ``need`` more blocks fit and leave the watermark free (all of it when ``alone``: no other
        sequence holds blocks, so none can need the watermark)."""
        return need + (0 if alone else self.watermark) <= self.free

    def restore_need(self, n_prefix: int, n_tokens: int) -> int:
        """Blocks a sequence of ``n_tokens`` needs beyond the full blocks of the kept prefix of ``n_prefix``
        tokens it starts from (0: a new sequence)."""
        return self.blocks(n_tokens) - n_prefix // self.block_tokens

    def ensure(self, row: int, n_tokens: int) -> None:
        """``row`` holds the blocks of positions 0..n_tokens-1.  Raises ``paged.OutOfBlocks`` when too few are
        free (check ``fits`` first)."""
        held = self._tables.count(row)
        self._tables.ensure(row, n_tokens)
        self._live_gain(self._tables.blocks(row)[held:])

    def start_from(self, row: int, src: int, n_prefix: int, n_tokens: int, *, copy: bool = True) -> None:
        """``row`` (empty, or ``src`` itself: the kept row taken over in place) starts from the prefix of
        ``n_prefix`` tokens ``src`` holds: it shares the prefix's full blocks and takes its own for the rest of
        ``n_tokens``.  ``copy``: the partly filled last block of the prefix is copied into the row's own block
        before the next plan runs (``take_copies``); False: the caller copies it (the other choices of a
        request, after the prefill that writes it)."""
        src_blocks = self._tables.blocks(src)
        full = src_blocks[:n_prefix // self.block_tokens]
        partial = src_blocks[len(full)] if n_prefix % self.block_tokens else None
        self._tables.hold(full)  # the row taken over lets go of its blocks as a kept prefix first
        try:
            self.release(row)
            self._tables.share(row, full)
            self._live_gain(full)
        finally:
            self._tables.drop(full)
        self.ensure(row, n_tokens)
        if copy and partial is not None and self._tables.blocks(row)[len(full)] != partial:
            self._copies.append((partial, self._tables.blocks(row)[len(full)]))

    def keep(self, row: int, src: int, n_prefix: int) -> None:
        """``row`` (empty) keeps the prefix of ``n_prefix`` tokens of the sequence in ``src``: it shares that
        sequence's first ``blocks(n_prefix)`` blocks."""
        self._tables.share(row, self._tables.blocks(src)[:self.blocks(n_prefix)])
        self._kept_rows.add(row)

    def release(self, row: int) -> None:
        """Give back everything ``row`` holds (shared blocks stay with their other owners)."""
        t = self._tables
        kept = row in self._kept_rows
        self._kept_rows.discard(row)
        for b in t.blocks(row):
            if kept:
                if self._live[b] == 0 and t.owners(b) == 1:
                    self.cached -= 1  # its last kept owner lets go: free now
            else:
                self._live[b] -= 1
                if self._live[b] == 0 and t.owners(b) > 1:
                    self.cached += 1  # only kept prefixes hold it now
        t.release(row)
