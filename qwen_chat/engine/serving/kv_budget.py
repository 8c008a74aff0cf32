"""The scheduler's count of KV blocks: how many the running sequences hold, so that admission, growth and
preemption never ask the runner for more than it has.

The runner allocates the actual block ids itself (``qwen_chat.engine.model.paged.BlockTables``), the same way on
every rank; the scheduler only needs counts.  Each request is charged, on admission, the blocks of its whole
prompt (``blocks_for(prompt tokens)``), and one more block each time a decode step takes it into a new block;
it gives them all back when it finishes or is preempted.  The runner holds at most what is charged (a prompt
still being prefilled in chunks holds fewer), so it never runs out.
"""
from __future__ import annotations

from qwen_chat.engine.model.paged import BLOCK_TOKENS, blocks_for


class BlockBudget:
    """Free-block count of one scheduler.

    Args:
        num_blocks: KV blocks of the runner (``ModelRunner.num_blocks``).
        block_tokens: positions per block.

    Attributes: ``num_blocks``, ``block_tokens``, ``used`` (blocks charged now), ``watermark`` (blocks an
    admission must leave free, so that the running sequences can grow for a while before anyone is
    preempted: 1 % of the blocks, at least 1).
    """

    def __init__(self, num_blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.block_tokens = int(block_tokens)
        self.used = 0
        self.watermark = max(1, self.num_blocks // 100)

    @property
    def free(self) -> int:
        """Blocks not charged to any sequence."""
        return self.num_blocks - self.used

    def blocks(self, n_tokens: int) -> int:
        """Blocks that hold n_tokens positions (``paged.blocks_for``)."""
        return blocks_for(n_tokens, self.block_tokens)

    def can_admit(self, n_tokens: int, *, alone: bool = False) -> bool:
        """True when a sequence of n_tokens fits and leaves the watermark free (all of it when ``alone``: no
        other sequence holds blocks, so none can need the watermark)."""
        return self.blocks(n_tokens) + (0 if alone else self.watermark) <= self.free

    def charge(self, req, n_blocks: int) -> None:
        """Charge ``req`` (anything with an int attribute ``blocks``) n_blocks more."""
        req.blocks += n_blocks
        self.used += n_blocks

    def release(self, req) -> None:
        """Give back everything charged to ``req``."""
        self.used -= req.blocks
        req.blocks = 0
