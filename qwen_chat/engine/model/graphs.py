"""CUDA graphs of the runner's decode step, and the buckets they are captured for.

``CudaGraphs`` is handed the decode step function (tensor ops only, so capturable) and owns everything around
it: static input buffers, one graph per (padded batch size of ``BATCH_LADDER``, context bucket), one memory
pool, warm-up before capture.  A batch of B rows runs in the smallest ladder size >= B; the extra rows point at
the scratch slot (whose block table row is all null block).  Inputs (slot, token, position, rope position per
row) are written on the host into a pinned buffer and sent with one asynchronous copy per step; the block
tables are read on the device (``paged.BlockTables.device_table``).  Prefill runs eagerly: it packs the
step's prompt chunks into one sequence of tokens (``forward.ModelForward.prefill``), whose shape changes every
step.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import torch

from qwen_chat.engine.model.paged import BLOCK_TOKENS, blocks_for

log = logging.getLogger(__name__)

#: Batch sizes for which a decode graph is captured; a batch of B runs in the smallest size >= B.
BATCH_LADDER = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
#: Smallest context bucket (tokens) of the decode attention; buckets double up to ``max_context``.
MIN_CONTEXT_BUCKET = 512

#: ``decode_step(slot_idx, tokens, pos, rope_pos, ctx) -> fp32 logits [B, V]`` (int64 [B] each; ctx static).
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def graph_batch_sizes(num_slots: int) -> list[int]:
    """Padded batch sizes a decode can run at: the ladder up to the first size >= num_slots."""
    out = []
    for b in BATCH_LADDER:
        out.append(b)
        if b >= num_slots:
            break
    return out


def _top(max_context: int, block_tokens: int) -> int:
    """The largest window: max_context rounded up to whole blocks."""
    return blocks_for(max_context, block_tokens) * block_tokens


def context_bucket(n: int, max_context: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Smallest bucket (MIN_CONTEXT_BUCKET doubling, capped at max_context rounded up to whole blocks) holding
    n positions; always a multiple of ``block_tokens``."""
    b = MIN_CONTEXT_BUCKET
    while b < n:
        b *= 2
    return min(b, _top(max_context, block_tokens))


def context_buckets(max_context: int, block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Attention windows of the decode graphs: MIN_CONTEXT_BUCKET doubling, the last one max_context rounded up
    to whole blocks."""
    top = _top(max_context, block_tokens)
    out, b = [], MIN_CONTEXT_BUCKET
    while True:
        out.append(min(b, top))
        if b >= top:
            return out
        b *= 2


class CudaGraphs:
    """Decode graphs of one runner (captured on first use or by ``capture_decode``).

    Args:
        device: the runner's CUDA device.
        scratch_slot: the slot that padding rows and capture runs write into (no live sequence is touched).
        decode_step: the runner's decode step (``DecodeStep``).
        ladder: the padded row counts (default ``BATCH_LADDER``; the verify step of speculative decoding uses
            multiples of its tokens per sequence, ``speculative``).
    """

    def __init__(self, *, device: torch.device, scratch_slot: int, decode_step: DecodeStep,
                 ladder: Sequence[int] = BATCH_LADDER) -> None:
        self._device, self._scratch = device, scratch_slot
        self._decode_step = decode_step
        self._ladder = tuple(ladder)
        self._pool = None
        self._warm_stream = torch.cuda.Stream(device)
        self._decode: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._decode_out: dict[tuple[int, int], torch.Tensor] = {}
        #: Seconds each decode graph took to warm up and capture (compiling included), by (batch, context).
        self.capture_s: dict[tuple[int, int], float] = {}
        n = self._ladder[-1]
        # Graph inputs, rows: slot, token, position, rope position.  Filled on the host in a pinned buffer and
        # sent with one asynchronous copy per step; the event guards the pinned buffer against reuse too early.
        self._s_in = torch.zeros(4, n, dtype=torch.long, device=device)
        self._s_slots, self._s_tokens, self._s_pos, self._s_rope = self._s_in.unbind(0)
        self._h_in = torch.zeros(4, n, dtype=torch.long, pin_memory=True)
        self._h_in_np = self._h_in.numpy()
        self._in_copied = torch.cuda.Event()

    # ------------------------------------------------------------------ what is held
    def decode_shapes(self) -> list[tuple[int, int]]:
        """(padded batch size, context bucket) of every captured decode graph, sorted."""
        return sorted(self._decode)

    def decode_graph(self, batch: int, ctx: int) -> torch.cuda.CUDAGraph:
        """The captured decode graph of padded batch ``batch`` and context bucket ``ctx`` (replaying it runs one
        step on whatever the static inputs hold; for benchmarks).  Raises KeyError when not captured."""
        return self._decode[(batch, ctx)]

    def count(self) -> int:
        """Decode graphs held."""
        return len(self._decode)

    # ------------------------------------------------------------------ capture
    def warm_and_capture(self, fn: Callable, args: tuple, warm_runs: int = 2,
                         pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run ``fn(*args)`` ``warm_runs`` times on the side stream (Inductor compilation, Triton autotuning and
        cuBLAS workspaces happen there, outside the capture), then capture one call into a CUDA graph in the memory
        pool ``pool`` (``torch.cuda.graph_pool_handle()``; default: the one this runner's decode graphs share).
        One side stream for every capture: the caching allocator keeps a stream's freed blocks for that stream
        only, so a new stream per capture would keep every warm-up's activations reserved.  Call it under
        ``torch.no_grad()``: with autograd on, each captured graph keeps its activations alive for a backward pass
        (measured: 40 GiB for the prefill graphs, docs/performance.md).
        Returns (graph, the captured call's output tensor, rewritten by each replay)."""
        stream = self._warm_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for _ in range(warm_runs):
                fn(*args)
        torch.cuda.current_stream(self._device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if pool is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            pool = self._pool
        with torch.cuda.graph(graph, pool=pool):
            out = fn(*args)
        return graph, out

    def capture_decode(self, batch: int, ctx: int, why: str = "") -> None:
        """Capture the decode step for padded batch ``batch`` and context bucket ``ctx`` unless held (inputs point
        at the scratch slot during warm-up and capture).  Logs the milliseconds it took: at info level when
        ``why`` says when it happened while serving ("on first use": a request's step waits for it; "while idle":
        a request arriving meanwhile waits for it), at debug level before the service is ready (``why`` empty)."""
        if (batch, ctx) in self._decode:
            return
        t0 = time.perf_counter()
        self._s_in.zero_()
        self._s_slots.fill_(self._scratch)
        args = (self._s_slots[:batch], self._s_tokens[:batch], self._s_pos[:batch], self._s_rope[:batch], ctx)
        self._decode[(batch, ctx)], self._decode_out[(batch, ctx)] = self.warm_and_capture(self._decode_step, args)
        took = self.capture_s[(batch, ctx)] = time.perf_counter() - t0
        log.log(logging.INFO if why else logging.DEBUG, "decode graph (batch %d, context %d) captured%s in %.0f ms",
                batch, ctx, f" {why}" if why else "", took * 1e3)

    def slowest_captures(self, n: int = 4) -> str:
        """The ``n`` decode graphs that took longest to warm up and capture: ``"batch 1 / context 2048 21.3 s,
        ..."`` (the first capture of a shape family compiles its glue), or ``"none"``."""
        ranked = sorted(self.capture_s.items(), key=lambda kv: -kv[1])[:n]
        return ", ".join(f"batch {b} / context {c} {secs:.1f} s" for (b, c), secs in ranked) or "none"

    # ------------------------------------------------------------------ replay
    def decode(self, slots: Sequence[int], tokens: Optional[torch.Tensor], pos: Sequence[int], rope: Sequence[int],
               ctx: int, token_table: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One decode step of ``len(slots) <=`` the ladder's largest rows through the graph of its padded batch and
        ``ctx`` (captured on first use).  tokens: int64 [B] on the host or the device, or None to read
        ``token_table[slot]`` on the device.  The only wait is for the previous step's input copy.  Returns fp32
        logits [B, V] (a copy of the graph's output)."""
        B = len(slots)
        bp = next(b for b in self._ladder if b >= B)
        key = (bp, ctx)
        self.capture_decode(bp, ctx, why="on first use")
        h = self._h_in_np
        self._in_copied.synchronize()  # the previous step's copy has read the pinned buffer
        h[:, B:bp] = 0
        h[0, :bp] = self._scratch
        h[0, :B], h[2, :B], h[3, :B] = slots, pos, rope
        on_host = tokens is not None and tokens.device.type == "cpu"
        if on_host:
            h[1, :B] = tokens.reshape(-1).numpy()
        self._s_in.copy_(self._h_in, non_blocking=True)
        self._in_copied.record()
        if tokens is None:
            torch.index_select(token_table, 0, self._s_slots[:B], out=self._s_tokens[:B])
        elif not on_host:
            self._s_tokens[:B].copy_(tokens.reshape(-1))
        self._decode[key].replay()
        return self._decode_out[key][:B].clone()
