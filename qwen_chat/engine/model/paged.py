"""Paged KV cache bookkeeping: fixed-size blocks of ``BLOCK_TOKENS`` positions and one block table per slot.

The KV cache of each full-attention layer is one tensor of ``num_blocks + 1`` blocks (``state.SlotState``); a
sequence holds only the blocks its length needs (``blocks_for``), taken from a free list when a prefill or a
decode step first writes into them, and given back when its slot is freed or preempted.  Block
``num_blocks`` is the *null block*: unused table entries and the padding rows of graph-padded decode batches
point at it, so nothing live is ever overwritten by them.

One allocator: under a scheduler the block ids are chosen by the scheduler alone (``core.kv_budget``: a
``BlockTables`` without a device), and each plan carries the table entries it changed since the last plan
(``take_changes`` -> ``types.StepPlan.blocks``).  Every rank's runner applies them to its own tables
(``follow``), so every rank holds the scheduler's tables; the runner's own calls (``ensure``, ``share``,
``release``, ``hold``, ``drop``) then only check that the plan gave what the step needs.  A runner used without a
scheduler (tests, benchmarks, the start-up self-check) allocates from its own free list; ``own`` hands the
allocation back to it after a scheduler.

Blocks are reference-counted: a slot's table and any number of holders outside the tables (``hold``: a prefix
kept for a later prompt that shares it) may own one block; it returns to the free list when the last owner lets
go (``release``, ``drop``).  A slot that starts from a held prefix takes its blocks with ``share``; blocks
shared by several owners are read-only for them (a slot copies the block it would write into first).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

#: Positions (tokens) per KV block.  64 keeps the last, partly filled block of each sequence small (at most 63
#: unused positions, 2 MiB across the 8 attention layers of the 9B in bf16) while each block is a contiguous
#: 32 KiB read per layer for the decode attention.
BLOCK_TOKENS = 64


def blocks_for(n_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """KV blocks that hold ``n_tokens`` positions: ceil(n_tokens / block_tokens) (0 for 0 tokens)."""
    return -(-int(n_tokens) // int(block_tokens))


class OutOfBlocks(RuntimeError):
    """A slot needed a KV block and none was free (the scheduler admits and preempts so that this never
    happens; seeing it means its accounting and the runner's disagree)."""


class BlockTables:
    """Free list of KV blocks and the block table of every slot, on the host and mirrored on the device.

    Args:
        num_slots: live slots; the device table has one more row (the scratch slot, all null).
        num_blocks: usable blocks; id ``num_blocks`` is the null block.
        max_blocks: table width (blocks of the longest sequence: ``blocks_for(max_context)``).
        device: where the device table lives; None: no device table (the scheduler's allocator,
            ``core.kv_budget``: its changes are taken by ``take_changes``).
        block_tokens: positions per block.

    Attributes:
        device_table: int64 [num_slots + 1, max_blocks] on ``device`` (None without a device); row s lists slot
            s's blocks in position order, the null block after them.  Read by the forward (decode graphs hold it
            as a static input); written only by ``flush``.
        null_block: the id of the null block.
        following: True while the tables follow a scheduler's plans (``follow``), False while they allocate.
    """

    def __init__(self, *, num_slots: int, num_blocks: int, max_blocks: int, device: Optional[torch.device],
                 block_tokens: int = BLOCK_TOKENS) -> None:
        if num_blocks < 1 or max_blocks < 1:
            raise ValueError(f"num_blocks and max_blocks must be >= 1 (got {num_blocks}, {max_blocks})")
        self.block_tokens = int(block_tokens)
        self.num_blocks = int(num_blocks)
        self.max_blocks = int(max_blocks)
        self.null_block = self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self._refs = [0] * self.num_blocks  # owners of each block: slot tables and holders
        self._owned: list[list[int]] = [[] for _ in range(num_slots + 1)]
        self.device_table = None if device is None else torch.full(
            (num_slots + 1, self.max_blocks), self.null_block, dtype=torch.long, device=device)
        self._updates: list[tuple[int, int, int]] = []  # (slot, index, block): to flush or to take
        self.following = False

    @property
    def free_blocks(self) -> int:
        """Blocks nobody owns (following: blocks in no table)."""
        if self.following:
            return self.num_blocks - len({b for owned in self._owned for b in owned})
        return len(self._free)

    def blocks(self, slot: int) -> Sequence[int]:
        """Block ids of ``slot`` in position order (read-only view)."""
        return tuple(self._owned[slot])

    def count(self, slot: int) -> int:
        """Blocks ``slot`` holds now."""
        return len(self._owned[slot])

    def ensure(self, slot: int, n_tokens: int) -> None:
        """Give ``slot`` the blocks for positions 0..n_tokens-1 (it keeps those it has).

        Raises OutOfBlocks when the free list runs dry (nothing is allocated then), ValueError past
        ``max_blocks``."""
        self.ensure_all([(slot, n_tokens)])

    def ensure_all(self, wants: Sequence[tuple[int, int]]) -> None:
        """``ensure`` for each (slot, tokens) of ``wants`` (distinct slots), all or nothing: raises OutOfBlocks,
        allocating nothing, when the free list cannot cover them together; ValueError past ``max_blocks``.
        Following a scheduler: allocates nothing and raises OutOfBlocks when a slot holds too few blocks."""
        if self.following:
            for slot, n_tokens in wants:
                if blocks_for(n_tokens, self.block_tokens) > len(self._owned[slot]):
                    raise OutOfBlocks(f"slot {slot} holds {len(self._owned[slot])} KV block(s) but {n_tokens} "
                                      f"positions need {blocks_for(n_tokens, self.block_tokens)}: the plan gave "
                                      "too few")
            return
        extra = []
        for slot, n_tokens in wants:
            need = blocks_for(n_tokens, self.block_tokens)
            if need > self.max_blocks:
                raise ValueError(f"{n_tokens} tokens need {need} KV blocks; a table holds {self.max_blocks}")
            extra.append(max(0, need - len(self._owned[slot])))
        if sum(extra) > len(self._free):
            raise OutOfBlocks(f"{sum(extra)} more KV block(s) needed but {len(self._free)} are free")
        for (slot, _), k in zip(wants, extra):
            owned = self._owned[slot]
            for _ in range(k):
                block = self._free.pop()
                self._refs[block] = 1
                self._updates.append((slot, len(owned), block))
                owned.append(block)

    def release(self, slot: int) -> None:
        """Let go of all of ``slot``'s blocks (each returns to the free list when nothing else owns it) and point
        its table row at the null block.  Following a scheduler: nothing (the plan released them)."""
        owned = self._owned[slot]
        if not owned or self.following:
            return
        self._updates.extend((slot, i, self.null_block) for i in range(len(owned)))
        self.drop(owned)
        self._owned[slot] = []

    def hold(self, blocks: Sequence[int]) -> None:
        """Own ``blocks`` once more outside any table (they must be allocated; following: nothing)."""
        if self.following:
            return
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is free; only allocated blocks can be held")
            self._refs[b] += 1

    def drop(self, blocks: Sequence[int]) -> None:
        """Let go of one ownership of each of ``blocks``; a block nobody owns returns to the free list (following:
        nothing)."""
        if self.following:
            return
        for b in reversed(list(blocks)):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def share(self, slot: int, blocks: Sequence[int]) -> None:
        """Start the empty ``slot`` with ``blocks`` (allocated, in position order) as its first table entries,
        owning each once more.  Raises ValueError when the slot holds blocks; following a scheduler, when the
        slot's table does not start with ``blocks`` (the plan shared them)."""
        if self.following:
            if tuple(self._owned[slot][:len(blocks)]) != tuple(blocks):
                raise ValueError(f"slot {slot} does not start with blocks {list(blocks)[:4]}...: the plan's "
                                 "tables differ")
            return
        if self._owned[slot]:
            raise ValueError(f"slot {slot} holds blocks; release it first")
        self.hold(blocks)
        self._owned[slot] = list(blocks)
        self._updates.extend((slot, i, b) for i, b in enumerate(blocks))

    def owners(self, block: int) -> int:
        """How many tables and holders own ``block`` (0: free).  Not while following (raises RuntimeError)."""
        if self.following:
            raise RuntimeError("a runner's tables that follow a scheduler count no owners")
        return self._refs[block]

    def take_changes(self) -> list[tuple[int, int, int]]:
        """The table entries changed since the last call, in order: [(slot, index, block id)], the null block
        where an entry was let go (the allocator of a scheduler, without a device table)."""
        out = list(self._updates)
        self._updates.clear()
        return out

    def follow(self, changes: Sequence[tuple[int, int, int]]) -> None:
        """Apply a scheduler's table changes (``take_changes`` of its tables, in order).  The first call empties
        every table and stops this object allocating (``following``): from then on only the plans change it.
        Raises ValueError for an entry out of range."""
        if not self.following:
            for slot, owned in enumerate(self._owned):
                self._updates.extend((slot, i, self.null_block) for i in range(len(owned)))
            self._owned = [[] for _ in self._owned]
            self._free, self._refs = [], [0] * self.num_blocks
            self.following = True
        touched = set()
        for slot, i, block in changes:
            if not (0 <= slot < len(self._owned) and 0 <= i < self.max_blocks and 0 <= block <= self.null_block):
                raise ValueError(f"table change {(slot, i, block)} is out of range")
            owned = self._owned[slot]
            if i >= len(owned):
                owned.extend([self.null_block] * (i + 1 - len(owned)))
            owned[i] = block
            touched.add(slot)
            self._updates.append((slot, i, block))
        for slot in touched:
            owned = self._owned[slot]
            while owned and owned[-1] == self.null_block:
                owned.pop()

    def own(self) -> None:
        """Stop following a scheduler: allocate from a free list again, rebuilt from the tables as they are (the
        benchmarks and tests that use a runner directly after a scheduler)."""
        if not self.following:
            return
        self._refs = [0] * self.num_blocks
        for owned in self._owned:
            for b in owned:
                self._refs[b] += 1
        self._free = [b for b in range(self.num_blocks - 1, -1, -1) if self._refs[b] == 0]
        self.following = False

    def positions(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Flat cache rows (block * block_tokens + offset) of ``slot``'s positions start..end-1: int64
        [end - start] on the host.  The slot must own the blocks (``ensure``)."""
        pos = torch.arange(start, end, dtype=torch.long)
        owned = torch.tensor(self._owned[slot], dtype=torch.long)
        return owned[pos // self.block_tokens] * self.block_tokens + pos % self.block_tokens

    def flush(self) -> None:
        """Write the table changes since the last flush into ``device_table`` (queued on the current stream, so
        steps launched after it see them)."""
        if not self._updates:
            return
        last = {(slot, i): block for slot, i, block in self._updates}  # a later change of one entry wins
        self._updates.clear()
        upd = torch.tensor([(slot, i, block) for (slot, i), block in last.items()], dtype=torch.long)
        dev = self.device_table.device
        if dev.type == "cuda":
            upd = upd.pin_memory().to(dev, non_blocking=True)
        self.device_table[upd[:, 0], upd[:, 1]] = upd[:, 2].to(dev)
