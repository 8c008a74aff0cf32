"""The chunked gated delta rule of a packed prefill, with the recurrent state kept at inner positions.

The Gated DeltaNet layers of a prefill run the chunked gated delta rule over every prompt chunk of the step
(fla's Triton kernel over packed sequences on CUDA, transformers' reference one sequence at a time elsewhere;
``resolve_chunk_rule``).  A chunk may also ask for its state at an inner position (a *keep point*, kept for a
later prompt that shares the tokens up to there: ``prefix_cache``).  The recurrent state cannot be rewound, so
such a chunk is run in two segments: its tokens up to the keep point (whose final state is the kept one), then
the rest, started from that state.  With the packed kernel this is one call over all segments (the tails start
from a placeholder state, their outputs are discarded) and one small call over the tails from the kept states,
so a step with keep points costs one more kernel call per layer, not one per sequence: fla's fused recurrent
kernel (one launch; the tails are the few tokens of a generation prompt) where fla is installed.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from qwen_chat.engine.model.precision import exact_fp32


def resolve_chunk_rule(device: torch.device, dtype: torch.dtype
                       ) -> tuple[Callable, str, bool, Optional[Callable]]:
    """Pick the chunked gated-delta-rule implementation for prefill: fla-core's Triton kernel on CUDA if
    importable (it takes packed sequences: ``cu_seqlens``), else transformers' reference
    ``torch_chunk_gated_delta_rule`` (one sequence at a time).  Both take q, k, v [B, L, H, D], g, beta
    [B, L, H] and return (out [B, L, H, Dv], final_state [B, H, Dk, Dv]).  In fp32 on CUDA the reference is
    used (the PyTorch function itself: transformers' module attribute is a dispatcher that runs fla's kernel
    when fla is installed) and ``precision.exact_fp32`` switches TF32 and SDPA's fused kernels off
    (process-wide), so an fp32 run is plain fp32: fla's ``tl.dot`` calls and cuDNN's conv1d round fp32 inputs
    to TF32, which made the full model differ from an fp32 reference by 0.3-0.4% (docs/performance.md, "FP8
    weights").  Returns (rule, name, varlen, tail_rule): ``tail_rule`` is fla's
    ``fused_recurrent_gated_delta_rule`` (same inputs and outputs, packed, one kernel) for the tails after keep
    points, or None (the rule itself runs them)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    # transformers wraps its reference in a dispatcher that calls fla's kernel when fla is installed (its
    # ``use_kernel_func_from_hub_with_fallback``); the reference itself is the unwrapped function
    reference = (inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule),
                 "transformers.torch_chunk_gated_delta_rule (per sequence)", False, None)
    if device.type != "cuda":
        return reference
    if dtype == torch.float32:
        exact_fp32()
        return reference
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # type: ignore

        return (chunk_gated_delta_rule, "fla.chunk_gated_delta_rule (packed, varlen)", True,
                fused_recurrent_gated_delta_rule)
    except Exception:  # fla missing or broken on this host: the reference implementation is exact, only slower
        return reference


@dataclass
class Segments:
    """Host-side layout of the packed rule for one step (``segments``).

    ``bounds``: (first row, end row) in the packed tokens of every segment, in order; ``h0``: per segment the
    chunk whose initial state it starts from, or -1 (a tail: started from the kept state in the second call);
    ``tails``: (first row, end row) of each tail; ``tail_from``: per tail the segment whose final state it
    starts from; ``final``: per chunk, the index of its final state in (first call's states, then the tails');
    ``kept``: per keep point, the index of the kept state in the same list.
    """

    bounds: list[tuple[int, int]]
    h0: list[int]
    tails: list[tuple[int, int]]
    tail_from: list[int]
    final: list[int]
    kept: list[int]


def segments(chunks: Sequence[tuple[int, int, int]]) -> Segments:
    """The segments of packed chunks ``(offset, n, keep)``: ``keep`` is the tokens of the chunk before its keep
    point (1..n), or 0 for a chunk without one.  Raises ValueError for a keep point outside 1..n."""
    bounds, h0, tails, tail_from, final, kept = [], [], [], [], [], []
    tail_final = []  # (chunk index, tail index) of the split chunks
    for j, (off, n, keep) in enumerate(chunks):
        if keep < 0 or keep > n:
            raise ValueError(f"keep point {keep} outside the chunk of {n} tokens")
        if 0 < keep < n:
            bounds += [(off, off + keep), (off + keep, off + n)]
            h0 += [j, -1]
            kept.append(len(bounds) - 2)
            tail_from.append(len(bounds) - 2)
            tails.append((off + keep, off + n))
            tail_final.append((j, len(tails) - 1))
            final.append(-1)
        else:
            bounds.append((off, off + n))
            h0.append(j)
            final.append(len(bounds) - 1)
            if keep == n:
                kept.append(len(bounds) - 1)
    for j, t in tail_final:
        final[j] = len(bounds) + t
    return Segments(bounds, h0, tails, tail_from, final, kept)


def packed_delta_rule(rule: Callable, varlen: bool, seg: Segments, q, k, v, g, beta, h0: torch.Tensor,
                      index: dict, tail_rule: Optional[Callable] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the chunked gated delta rule over packed chunks with keep points (``tail_rule``: the packed rule
    for the tails after keep points, ``resolve_chunk_rule``; None: ``rule``).

    q, k: [1, T, HV, dk]; v: [1, T, HV, dv]; g, beta: [1, T, HV] (the rule's inputs, heads already repeated);
    h0: [N, HV, dk, dv] each chunk's initial state (key-major, as the rule takes it); seg: ``segments`` of the
    N chunks; index: the device copies of the layout (``device_index``).
    Returns (out [1, T, HV, dv], final [N, HV, dk, dv], kept [number of keep points, HV, dk, dv]).
    """
    if not varlen:
        outs, states = [], []
        for (lo, hi), src in zip(seg.bounds, seg.h0):
            start = h0[src:src + 1] if src >= 0 else states[-1]
            o, st = rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi],
                         initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=False)
            outs.append(o)
            states.append(st)
        out = torch.cat(outs, dim=1)
        states_all = torch.cat(states, dim=0)  # in segment order: a tail right after its head
        final = states_all[[_seq_final(seg, j) for j in range(len(seg.final))]]
        return out, final, states_all[seg.kept]
    first = h0.index_select(0, index["h0"].clamp(min=0))
    if seg.tails:
        first = first * (index["h0"] >= 0).to(first.dtype)[:, None, None, None]
    out, st1 = rule(q, k, v, g=g, beta=beta, initial_state=first, output_final_state=True,
                    use_qk_l2norm_in_kernel=False, cu_seqlens=index["cu"], cu_seqlens_cpu=index["cu_cpu"])
    states = st1
    if seg.tails:
        rows = index["tail_rows"]
        extra = {} if tail_rule is not None else {"cu_seqlens_cpu": index["tail_cu_cpu"]}
        o2, st2 = (tail_rule or rule)(q[:, rows], k[:, rows], v[:, rows], g=g[:, rows], beta=beta[:, rows],
                                      initial_state=st1.index_select(0, index["tail_from"]),
                                      output_final_state=True, use_qk_l2norm_in_kernel=False,
                                      cu_seqlens=index["tail_cu"], **extra)
        out = out.index_copy(1, rows, o2)
        states = torch.cat([st1, st2], dim=0)
    return out, states.index_select(0, index["final"]), states.index_select(0, index["kept"])


def _seq_final(seg: Segments, j: int) -> int:
    """Per-sequence path: the index (in segment order) of chunk j's final state."""
    f = seg.final[j]
    if f < len(seg.bounds):
        return f
    return seg.tail_from[f - len(seg.bounds)] + 1  # the tail segment right after its head


def host_index(seg: Segments) -> dict[str, torch.Tensor]:
    """The layout as int64 host tensors (``device_index`` sends them): ``h0``, ``cu`` (segment bounds,
    [S + 1]), ``tail_rows``, ``tail_cu``, ``tail_from``, ``final``, ``kept``."""
    cu = [0] + [hi for _, hi in seg.bounds]
    tail_rows = [r for lo, hi in seg.tails for r in range(lo, hi)]
    tail_cu = [0]
    for lo, hi in seg.tails:
        tail_cu.append(tail_cu[-1] + hi - lo)
    t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return dict(h0=t(seg.h0), cu=t(cu), tail_rows=t(tail_rows), tail_cu=t(tail_cu), tail_from=t(seg.tail_from),
                final=t(seg.final), kept=t(seg.kept))
