"""The chunked gated delta rule of a packed prefill, with the recurrent state kept at inner positions.

The Gated DeltaNet layers of a prefill run the chunked gated delta rule over every prompt chunk of the step
(fla's Triton kernel over packed sequences on CUDA, transformers' reference one sequence at a time elsewhere;
``resolve_chunk_rule``).  A chunk may also ask for its state at an inner position (a *keep point*, kept for a
later prompt that shares the tokens up to there: ``prefix_cache``).  The recurrent state cannot be rewound, so
such a chunk is run in two segments: its tokens up to the keep point (whose final state is the kept one), then
the rest, started from that state.  With the packed kernel this is one call over all segments (the tails start
from a placeholder state, their outputs are discarded) and one small call over the tails from the kept states,
so a step with keep points costs one more kernel call per layer, not one per sequence: fla's fused recurrent
kernel (one launch) for the few tokens of a generation prompt where fla is installed.  A chunk may hold several
keep points (a system prompt's end and a conversation turn's end): it is cut at each, one more call per cut.
"""
from __future__ import annotations

import functools
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


#: Longest tail (tokens of one segment after a keep point) run by fla's fused recurrent kernel, which steps
#: through the tokens one at a time in one launch: right for the few tokens of a generation prompt after a
#: conversation's keep point, while the tail after a system prompt's keep point (the first user message) can
#: be thousands of tokens long and goes through the chunked kernel.
TAIL_RECURRENT_MAX = 64


@dataclass
class Segments:
    """Host-side layout of the packed rule for one step (``segments``).

    A chunk with keep points is cut at each of them into consecutive segments.  ``bounds``: (first row, end
    row) in the packed tokens of every segment, chunk by chunk, in position order; ``h0``: per segment the
    chunk whose initial state it starts from, or -1 (it starts from the final state of the segment before it,
    in a later round); ``depth``: per segment its round (0 for a chunk's first segment, r for its r-th keep
    point's tail); ``final``: per chunk, the index of its last segment; ``kept``: per keep point (chunk order,
    then position order), the index of the segment that ends at it.
    """

    bounds: list[tuple[int, int]]
    h0: list[int]
    depth: list[int]
    final: list[int]
    kept: list[int]

    @property
    def rounds(self) -> int:
        """Calls of the rule the packed path makes: 1 + the most keep points inside one chunk."""
        return 1 + max(self.depth, default=0)

    def round_segments(self, r: int) -> list[int]:
        """Indexes of the segments of round ``r``."""
        return [s for s, d in enumerate(self.depth) if d == r]

    @functools.cached_property
    def longest(self) -> list[int]:
        """Per round, the tokens of its longest segment (computed once per step, read by every layer)."""
        out = [0] * self.rounds
        for (lo, hi), d in zip(self.bounds, self.depth):
            out[d] = max(out[d], hi - lo)
        return out


def segments(chunks: Sequence[tuple[int, int, Sequence[int]]]) -> Segments:
    """The segments of packed chunks ``(offset, n, keeps)``: ``keeps`` the tokens of the chunk before each of
    its keep points (each 1..n, increasing), empty for none.  Raises ValueError for a keep point outside 1..n
    or keep points out of order."""
    bounds, h0, depth, final, kept = [], [], [], [], []
    for j, (off, n, keeps) in enumerate(chunks):
        keeps = list(keeps)
        if any(not 0 < p <= n for p in keeps) or keeps != sorted(set(keeps)):
            raise ValueError(f"keep points {keeps} are not increasing positions inside the chunk of {n} tokens")
        cuts = [p for p in keeps if p < n]
        lo = 0
        for d, hi in enumerate(cuts + [n]):
            bounds.append((off + lo, off + hi))
            h0.append(j if d == 0 else -1)
            depth.append(d)
            if hi in keeps:
                kept.append(len(bounds) - 1)
            lo = hi
        final.append(len(bounds) - 1)
    return Segments(bounds, h0, depth, final, kept)


def packed_delta_rule(rule: Callable, varlen: bool, seg: Segments, q, k, v, g, beta, h0: torch.Tensor,
                      index: dict, tail_rule: Optional[Callable] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the chunked gated delta rule over packed chunks with keep points (``tail_rule``: the packed rule
    for short tails after keep points, ``resolve_chunk_rule``; None: ``rule``).

    q, k: [1, T, HV, dk]; v: [1, T, HV, dv]; g, beta: [1, T, HV] (the rule's inputs, heads already repeated);
    h0: [N, HV, dk, dv] each chunk's initial state (key-major, as the rule takes it); seg: ``segments`` of the
    N chunks; index: the device copies of the layout (``host_index``; each bounds tensor ``<name>`` also as
    ``<name>_cpu`` on the host).  The packed path makes one call over all segments (those after a keep point
    start from a placeholder state and are run again), then one call per further round over the segments of
    that round, each from the final state of the segment before it: a step with keep points costs one more
    call per layer for each keep point inside one chunk, not one per sequence.
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
        states_all = torch.cat(states, dim=0)  # in segment order
        return out, states_all[seg.final], states_all[seg.kept]
    first = h0.index_select(0, index["h0"].clamp(min=0))
    if seg.rounds > 1:
        first = first * (index["h0"] >= 0).to(first.dtype)[:, None, None, None]
    out, states = rule(q, k, v, g=g, beta=beta, initial_state=first, output_final_state=True,
                       use_qk_l2norm_in_kernel=False, cu_seqlens=index["cu"], cu_seqlens_cpu=index["cu_cpu"])
    for r in range(1, seg.rounds):
        rows = index[f"t{r}_rows"]
        fn = tail_rule if tail_rule is not None and seg.longest[r] <= TAIL_RECURRENT_MAX else rule
        extra = {"cu_seqlens_cpu": index[f"t{r}_cu_cpu"]} if fn is rule else {}
        o2, st2 = fn(q[:, rows], k[:, rows], v[:, rows], g=g[:, rows], beta=beta[:, rows],
                     initial_state=states.index_select(0, index[f"t{r}_seg"] - 1), output_final_state=True,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=index[f"t{r}_cu"], **extra)
        out = out.index_copy(1, rows, o2.to(out.dtype))
        states = states.index_copy(0, index[f"t{r}_seg"], st2.to(states.dtype))
    return out, states.index_select(0, index["final"]), states.index_select(0, index["kept"])


def host_index(seg: Segments) -> dict[str, torch.Tensor]:
    """The layout as int64 host tensors (the forward sends them to the device in one copy): ``h0``, ``cu``
    (segment bounds, [S + 1]), ``final``, ``kept``, and per later round r: ``t<r>_rows`` (its packed rows),
    ``t<r>_cu`` (their bounds) and ``t<r>_seg`` (its segments; each starts from segment index - 1)."""
    t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    out = dict(h0=t(seg.h0), cu=t([0] + [hi for _, hi in seg.bounds]), final=t(seg.final), kept=t(seg.kept))
    for r in range(1, seg.rounds):
        segs = seg.round_segments(r)
        cu = [0]
        for s in segs:
            cu.append(cu[-1] + seg.bounds[s][1] - seg.bounds[s][0])
        out[f"t{r}_rows"] = t([row for s in segs for row in range(*seg.bounds[s])])
        out[f"t{r}_cu"] = t(cu)
        out[f"t{r}_seg"] = t(segs)
    return out


def host_bounds(index: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The host copies ``packed_delta_rule`` also wants: ``<name>_cpu`` for each bounds tensor ``<name>`` of
    ``host_index`` (fla's kernel plans its launch from them without waiting for the device)."""
    return {f"{key}_cpu": value for key, value in index.items() if key.endswith("cu")}
