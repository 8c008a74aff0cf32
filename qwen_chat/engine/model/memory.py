"""How many sequences and how much context a memory budget holds: the split of the budget into Gated DeltaNet
state slots and KV blocks, and the budget itself on a GPU.

Rule (``plan_memory``): the state slots (fixed size each: the conv ring and the fp32 recurrent state of every
Gated DeltaNet layer) take at most ``STATE_SHARE`` of the budget and at most ``max_slots``; the rest, less what
the longest context costs in transient buffers (the decode attention's scores, ``scores_reserve``: at most
``SCORES_BYTES_MAX`` since the attention runs in row groups, ``attention_rows``; the keys and values a later
prompt chunk gathers from one attention layer), is KV blocks.  The longest
context is the model's own limit, capped by ``--max-context`` and by the KV tokens the blocks hold (one
sequence may use every block).  A budget that cannot hold one slot and one sequence of ``min_context``
tokens is refused with one line naming the numbers and the flags to change (``MemoryBudgetError``).

On a GPU (``gpu_memory``, ``runner_setup.size_memory``) the budget is ``utilization`` x the device's memory,
and at most the allocator's limit when ``torch.cuda.set_per_process_memory_fraction`` set one (less ``CAP_MARGIN_BYTES``), minus what this
process holds now (the weights), minus the activation reserve of prefill and decode (``activation_reserve``),
and at most what the device has free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from qwen_chat.config import DEFAULT_MAX_SLOTS
from qwen_chat.engine.model.paged import BLOCK_TOKENS
from qwen_chat.engine.model.state import Geometry

GIB = 1024 ** 3
#: Share of the budget the state slots may take at most: the rest is KV cache, so that the sequences that fit
#: are not all short.
STATE_SHARE = 0.5
#: Fixed part of the activation reserve: CUDA graph pool, cuBLAS and compiler workspaces, allocator slack.
FIXED_RESERVE_BYTES = GIB // 2
#: Kept below an allocator limit set with ``torch.cuda.set_per_process_memory_fraction`` (a hard limit).
CAP_MARGIN_BYTES = GIB // 4
#: Prefill chunk sizes (tokens per step) ``prefill_chunk`` picks from, largest first.
CHUNK_CHOICES = (4096, 2048, 1024, 512)
#: Share of the memory left after the weights that a prefill step's activations may take (``prefill_chunk``).
CHUNK_SHARE = 0.1


def size_text(n_bytes: float) -> str:
    """``n_bytes`` for a person: GiB from 1 GiB up, else MiB (1 GiB = 2**30 bytes)."""
    return f"{n_bytes / GIB:.2f} GiB" if abs(n_bytes) >= GIB else f"{n_bytes / 2**20:.1f} MiB"


#: What to change when a budget holds no sequence, on a GPU and on CPU (``plan_memory``'s ``advice``).
GPU_ADVICE = ("lower --max-context, raise --gpu-memory-utilization (or --memory-budget-gib), or shard the model "
              "over more GPUs (tensor parallel) or offload it (ZeRO-3)")
CPU_ADVICE = "lower --max-context or raise --memory-budget-gib"


class MemoryBudgetError(ValueError):
    """The budget cannot hold one sequence; the message (one line) names the numbers and the flags to change."""


@dataclass(frozen=True)
class MemoryPlan:
    """The split of one budget (all bytes; ``max_context`` and ``kv_tokens`` in tokens)."""

    budget_bytes: int
    num_slots: int
    num_blocks: int
    block_tokens: int
    max_context: int
    slot_bytes: int
    kv_token_bytes: int
    scores_bytes: int

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV cache the blocks hold in all."""
        return self.num_blocks * self.block_tokens

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"memory budget {size_text(self.budget_bytes)}: {self.num_slots} state slots "
                f"({self.slot_bytes / 2**20:.1f} MiB each), {self.num_blocks} KV blocks x {self.block_tokens} "
                f"tokens = {self.kv_tokens} tokens of KV ({self.kv_token_bytes / 1024:.1f} KiB per token), "
                f"{size_text(self.scores_bytes)} kept for the decode attention's scores and a later prompt "
                f"chunk's keys at the longest context; at most {self.num_slots} sequences at once, context up to "
                f"{self.max_context} tokens")


#: Bytes the decode attention's fp32 scores and probabilities of one call may take at most: rows beyond that run
#: in groups (``attention_rows``), so the memory kept for them stops growing with the slots and the context.
SCORES_BYTES_MAX = 256 * 2 ** 20
#: Bytes of scores per query head and position of the window: fp32 scores and probabilities (the compiled
#: kernels were measured holding one of the two, docs/performance.md).
SCORE_BYTES = 2 * 4


def attention_rows(query_heads: int, ctx: int) -> int:
    """Rows (sequences) the decode attention over a window of ``ctx`` tokens takes in one call: as many as keep
    their fp32 scores and probabilities (``SCORE_BYTES`` per query head and position) within
    ``SCORES_BYTES_MAX``, at least 1."""
    return max(1, SCORES_BYTES_MAX // max(SCORE_BYTES * query_heads * ctx, 1))


def scores_reserve(slots: int, query_heads: int, ctx: int) -> int:
    """Bytes of the decode attention's scores and probabilities when ``slots`` rows attend over ``ctx`` tokens
    (``attention_rows`` of them at a time)."""
    return SCORE_BYTES * query_heads * ctx * min(slots, attention_rows(query_heads, ctx))


def state_slots(geometry: Geometry, budget_bytes: float, max_slots: Optional[int] = None) -> int:
    """State slots a budget gives: ``STATE_SHARE`` of it in slots of ``geometry.slot_bytes()``, at most
    ``max_slots`` (None: ``DEFAULT_MAX_SLOTS``); may be 0."""
    return int(min(max_slots or DEFAULT_MAX_SLOTS, (budget_bytes * STATE_SHARE) // max(geometry.slot_bytes(), 1)))


def plan_memory(geometry: Geometry, *, budget_bytes: int, model_context: int, max_slots: Optional[int] = None,
                max_context: Optional[int] = None, block_tokens: int = BLOCK_TOKENS,
                min_context: int = 2048, advice: str = GPU_ADVICE) -> MemoryPlan:
    """Split ``budget_bytes`` into state slots and KV blocks (see the module docstring).

    geometry: the model's local widths (``state.probe_geometry``); model_context: its own limit (tokens);
    max_slots / max_context: the ``--max-batch`` / ``--max-context`` caps (None: ``DEFAULT_MAX_SLOTS`` / the
    model's limit); min_context: the shortest context worth serving when ``max_context`` is not given;
    advice: the flags to change, for the error (``GPU_ADVICE``, ``CPU_ADVICE``).
    Raises MemoryBudgetError when not even one slot and one sequence of the asked context fit.
    """
    slot = geometry.slot_bytes()
    per_token = geometry.kv_token_bytes()
    want_ctx = min(model_context, max_context) if max_context else model_context
    need_ctx = min(want_ctx, max_context or min_context)
    slots = state_slots(geometry, budget_bytes, max_slots)
    heads = geometry.query_heads()
    gather = geometry.layer_kv_token_bytes()
    kv_bytes = budget_bytes - slots * slot
    # per token of the longest context: its KV, the keys and values of one layer that a later prompt chunk
    # gathers, and the decode attention's scores at the top bucket (growing with the context while every slot
    # fits in one call, else the SCORES_BYTES_MAX of one row group)
    every_row = SCORE_BYTES * slots * heads  # scores per position with all slots in one call
    ctx = kv_bytes // max(per_token + every_row + gather, 1)
    if scores_reserve(slots, heads, ctx) < every_row * ctx:
        ctx = (kv_bytes - SCORES_BYTES_MAX) // max(per_token + gather, 1)
    ctx = int(max(min(want_ctx, ctx), 0))
    scores = scores_reserve(slots, heads, ctx) + gather * ctx
    kv_bytes -= scores
    blocks = int(max(kv_bytes, 0) // (per_token * block_tokens)) if per_token else 0
    ctx = int(min(ctx, blocks * block_tokens))
    if slots < 1 or ctx < need_ctx:
        raise MemoryBudgetError(
            f"the memory budget of {size_text(budget_bytes)} holds {max(slots, 0)} state slot(s) of "
            f"{slot / 2**20:.1f} MiB and {max(blocks, 0) * block_tokens} tokens of KV cache "
            f"({per_token / 1024:.1f} KiB per token), not one sequence of {need_ctx} tokens: {advice}")
    return MemoryPlan(budget_bytes=int(budget_bytes), num_slots=slots, num_blocks=blocks,
                      block_tokens=block_tokens, max_context=ctx, slot_bytes=slot, kv_token_bytes=per_token,
                      scores_bytes=scores)


def activation_bytes_per_token(text_config, geometry: Geometry) -> int:
    """Bytes of activations per token of a packed prefill step, estimated: the hidden, MLP and Gated DeltaNet
    widths in the model dtype, several alive at once (residual, norm output, projections, conv, fp32 q/k and
    gates, fla's chunk states)."""
    hidden, inter = int(text_config.hidden_size), int(text_config.intermediate_size)
    return 2 * (12 * hidden + 4 * inter + 10 * geometry.conv_width())


def prefill_chunk(text_config, geometry: Geometry, *, free_after_weights: int) -> int:
    """The largest ``CHUNK_CHOICES`` entry whose prefill activations take at most ``CHUNK_SHARE`` of the memory
    left after the weights (tokens per step; the smallest choice when none does)."""
    per_token = activation_bytes_per_token(text_config, geometry)
    for n in CHUNK_CHOICES:
        if n * per_token <= CHUNK_SHARE * free_after_weights:
            return n
    return CHUNK_CHOICES[-1]


def activation_reserve(text_config, geometry: Geometry, *, prefill_tokens: int, max_slots: int,
                       graph_prefill_tokens: int = 0) -> int:
    """Bytes to keep free for activations: a prefill step of ``prefill_tokens`` packed tokens
    (``activation_bytes_per_token``), the fp32 logits and sampler buffers of ``max_slots`` decode rows, and
    ``FIXED_RESERVE_BYTES``; with prefill graphs (``prefill_graph``) also twice the activations of their largest
    bucket, ``graph_prefill_tokens`` (their memory pool is held apart from the eager prefill's, and their delta
    rule runs two rows).  (What grows with the context is priced per token by ``plan_memory``.)"""
    per_token = activation_bytes_per_token(text_config, geometry)
    logits = 3 * max_slots * int(text_config.vocab_size) * 4
    return int((prefill_tokens + 2 * graph_prefill_tokens) * per_token + logits + FIXED_RESERVE_BYTES)


def gpu_memory(device: torch.device, *, utilization: float) -> tuple[int, int, str]:
    """(usable bytes, bytes this process holds now (allocated: the weights; after ZeRO-3's loading nearly
    nothing), how usable was found) on a CUDA device: ``utilization`` x
    its total memory, at most the allocator's limit (``set_per_process_memory_fraction``) less
    ``CAP_MARGIN_BYTES``, at most what is free plus what this process holds."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = 1.0
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        try:
            fraction = float(getter(device))
        except Exception:  # noqa: BLE001 - older torch: no way to read it, the device total applies
            fraction = 1.0
    held = torch.cuda.memory_allocated(device)  # what the allocator caches beyond this is free for the state
    usable = utilization * total
    how = f"{utilization:.2f} x {total / GIB:.1f} GiB"
    if fraction < 1.0 and fraction * total - CAP_MARGIN_BYTES < usable:
        usable = fraction * total - CAP_MARGIN_BYTES
        how = f"the allocator limit of {fraction * total / GIB:.1f} GiB less {CAP_MARGIN_BYTES / GIB:.2f}"
    if free + held < usable:
        usable = free + held
        how = f"{free / GIB:.1f} GiB free on the device + {held / GIB:.2f} GiB held"
    return int(usable), int(held), how
