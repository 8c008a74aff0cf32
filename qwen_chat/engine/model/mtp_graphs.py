"""CUDA graphs of the MTP head's drafting (``mtp.MtpDrafter.draft``): one graph per (padded batch, context
bucket, drafts per step).

Drafting runs the MTP layer over each slot's recorded rows, then once per further draft, with an lm_head and an
argmax per draft: eagerly about 150 small kernels per K = 1 step, whose launches took 2.7 ms of the 8.9 ms of a
speculative step on an H200 against 4.8 ms for a plain decode step (docs/speculative.md), so drafting as it
was cost more than a trained head's drafts would save.  Replayed from a graph the host launches one graph.

Inputs per slot (slot, first recorded position, kept positions, first position of its MTP context, rotary
shift) are written on the host into a pinned buffer and sent with one asynchronous copy, as the decode graphs'
(``graphs.CudaGraphs``); a batch of B slots runs in the graph of the smallest padded size >= B, the padding
columns on the scratch slot (whose block table row is all null block: its writes touch no sequence).  The
graphs share one memory pool of their own and are captured through the runner's ``CudaGraphs.warm_and_capture``
(warm-up on its side stream, so Inductor compiles the attention outside the capture).  Used on CUDA when the
runner has decode graphs and no grammar masks the drafts (those need the host between drafts: eager).
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

log = logging.getLogger(__name__)


class DraftGraphs:
    """The drafting graphs of one ``MtpDrafter``.

    Args: drafter (``mtp.MtpDrafter``), cuda_graphs (the runner's ``graphs.CudaGraphs``: its capture helper),
    scratch_slot (the runner's ``num_slots``), ladder (padded batch sizes, ascending: the verify step's).
    """

    def __init__(self, drafter, cuda_graphs, *, scratch_slot: int, ladder: Sequence[int]) -> None:
        self._draft, self._capture = drafter.draft, cuda_graphs.warm_and_capture
        self._scratch, self._ladder = int(scratch_slot), tuple(ladder)
        device = drafter.runner.device
        n = self._ladder[-1]
        self._s_in = torch.zeros(5, n, dtype=torch.long, device=device)
        self._h_in = torch.zeros(5, n, dtype=torch.long, pin_memory=True)
        self._h_np = self._h_in.numpy()
        self._copied = torch.cuda.Event()
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._out: dict[tuple[int, int, int], torch.Tensor] = {}

    def count(self) -> int:
        """Drafting graphs held."""
        return len(self._graphs)

    def _pad(self, columns: slice) -> None:
        """Padding columns of the host buffer: the scratch slot at position 0, one kept position, context from 0."""
        h = self._h_np
        h[:, columns] = 0
        h[0, columns] = self._scratch
        h[2, columns] = 1

    @torch.no_grad()
    def capture(self, batch: int, ctx: int, k: int) -> None:
        """Capture the drafting of ``k`` drafts for padded batch ``batch`` and context bucket ``ctx`` unless held
        (warm-up and capture on padding inputs: the scratch slot)."""
        key = (batch, ctx, k)
        if key in self._graphs:
            return
        t0 = time.perf_counter()
        self._copied.synchronize()
        self._pad(slice(0, batch))
        self._s_in.copy_(self._h_in)
        self._graphs[key], self._out[key] = self._capture(self._draft, (self._s_in[:, :batch], ctx, k),
                                                          pool=self._pool)
        log.debug("drafting graph (batch %d, context %d, %d drafts) captured in %.0f ms", batch, ctx, k,
                  (time.perf_counter() - t0) * 1e3)

    @torch.no_grad()
    def run(self, rows: Sequence[Sequence[int]], ctx: int, k: int) -> torch.Tensor:
        """``MtpDrafter.draft`` of ``rows`` (one (slot, p, n, start, rotary shift) per slot, at most the ladder's
        largest size) through the graph of its padded batch (captured on first use).  The only wait is for the
        previous call's input copy.  Returns int64 [B, k] (a copy of the graph's output).  Raises ValueError for
        more slots than the ladder holds."""
        B = len(rows)
        if not 0 < B <= self._ladder[-1]:
            raise ValueError(f"drafting graphs hold 1..{self._ladder[-1]} slots, got {B}")
        bp = next(b for b in self._ladder if b >= B)
        self.capture(bp, ctx, k)
        self._copied.synchronize()  # the previous call's copy has read the pinned buffer
        self._pad(slice(B, bp))
        self._h_np[:, :B] = list(zip(*rows))
        self._s_in.copy_(self._h_in, non_blocking=True)
        self._copied.record()
        key = (bp, ctx, k)
        self._graphs[key].replay()
        return self._out[key][:B].clone()
