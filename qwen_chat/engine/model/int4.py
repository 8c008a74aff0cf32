"""4-bit weights (W4A16) as the engine holds them: ``Int4Weight``, ``Int4Linear``, group-wise round-to-nearest
quantisation and the summary for ``/v1/models``.

One format inside the engine, whatever the checkpoint used (GPTQ, AWQ and compressed-tensors ``pack-quantized``
are converted to it on load, ``int4_format`` / ``int4_loading``; docs/checkpoints.md, "4-bit weights"):

- ``packed`` int32 [N, K/8]: eight unsigned 4-bit values q in 0..15 per int32 along the input dimension, value j
  of word i (bits 4j..4j+3, lowest first) being column 8i + j (compressed-tensors' ``weight_packed`` layout);
- ``scale`` fp32 [N, K/128] and ``zero`` uint8 [N, K/128] per group of 128 input columns (``GROUP``),

w[n, k] = (q[n, k] - zero[n, k // 128]) * scale[n, k // 128].  A symmetric checkpoint has zero = 8 everywhere.
The scales are kept in fp32 (the checkpoints store fp16 or bf16: the conversion is exact); the weights then take
0.5 + 5/128 bytes each instead of 2.

Rows are independent (groups run along K), so any row range slices and stacks; input columns slice only on
group boundaries (``GroupAlignmentError``), which is where tensor parallelism cuts a row-parallel projection.

``quantize_groups`` (``--quantize int4``) is asymmetric min-max round-to-nearest per group of 128, the rule of
the GPTQ reference quantiser without the error feedback (IST-DASLab/gptq, ``quant.py``, ``Quantizer.find_params``
with ``sym=False``): range [min(w_min, 0), max(w_max, 0)] (so 0 is exact), scale = range / 15, zero =
round(-min / scale), q = clamp(round(w / scale) + zero, 0, 15); an all-zero group gets scale 1 (as the reference
sets min -1, max 1 there, any scale represents it exactly).  ``linear`` in ``fp8`` multiplies by an
``Int4Weight``: the Triton GEMV (``int4_gemv``) for decode rows on CUDA, else the dequantised weight.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from qwen_chat.engine.model import int4_gemv

#: Input columns per scale and zero point (the format's ``group_size``).
GROUP = int4_gemv.GROUP
#: 4-bit values per packed int32.
PACK = 8
#: Largest 4-bit value (2^4 - 1).
QMAX = 15


class GroupAlignmentError(ValueError):
    """A slice of a 4-bit weight would cut a group of 128 input columns (its scale would belong to two pieces)."""


def pack(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values q [N, K] (integers 0..15, K a multiple of 8) into int32 [N, K/8], value j of word i at
    bits 4j..4j+3 (column 8i + j).  Raises ValueError for K not a multiple of 8 or values outside 0..15."""
    n, k = q.shape
    if k % PACK:
        raise ValueError(f"pack: {k} columns is not a multiple of {PACK}")
    q32 = q.to(torch.int32)
    if bool(((q32 < 0) | (q32 > QMAX)).any()):
        raise ValueError("pack: values outside 0..15")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (q32.view(n, k // PACK, PACK) << shifts).sum(dim=-1, dtype=torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of ``packed`` int32 [N, K/8] as uint8 [N, K] (inverse of ``pack``)."""
    n, w = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & QMAX).to(torch.uint8).view(n, w * PACK)


@dataclass(frozen=True)
class Int4Weight:
    """A 4-bit weight (module docstring): ``packed`` int32 [N, K/8], ``scale`` fp32 [N, K/128], ``zero`` uint8
    [N, K/128].  A view object: it holds the tensors, does not copy them."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """[N, K] (out, in features)."""
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * PACK))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes held: half a byte per weight, plus four per scale and one per zero point."""
        return self.packed.numel() * 4 + self.scale.numel() * 4 + self.zero.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """w = (q - zero) * scale as a new [N, K] tensor in ``dtype`` (computed in fp32, rounded once): the Triton
        kernel on CUDA, else PyTorch."""
        if self.packed.is_cuda and int4_gemv.dequantize_supported(self.packed, self.scale, self.zero):
            return int4_gemv.dequantize(self.packed, self.scale, self.zero, dtype)
        n, k = self.shape
        q = unpack(self.packed).view(n, k // GROUP, GROUP).float()
        w = (q - self.zero.float()[:, :, None]) * self.scale[:, :, None]
        return w.view(n, k).to(dtype)

    def rows(self, start: int, stop: int) -> "Int4Weight":
        """Rows start..stop-1 (views).  Raises ValueError for an empty or out-of-range span."""
        if not 0 <= start < stop <= self.shape[0]:
            raise ValueError(f"rows {start}..{stop} of {self.shape[0]}")
        return Int4Weight(self.packed[start:stop], self.scale[start:stop], self.zero[start:stop])

    def cols(self, start: int, stop: int) -> "Int4Weight":
        """Input columns start..stop-1 (copies: contiguous).  Raises GroupAlignmentError unless both ends are
        multiples of 128 (``stop`` may be the last column when K is)."""
        k = self.shape[1]
        if start % GROUP or stop % GROUP or not 0 <= start < stop <= k:
            raise GroupAlignmentError(f"columns {start}..{stop} of {k} cut a group of {GROUP} input columns")
        g0, g1 = start // GROUP, stop // GROUP
        return Int4Weight(self.packed[:, start // PACK:stop // PACK].contiguous(),
                          self.scale[:, g0:g1].contiguous(), self.zero[:, g0:g1].contiguous())

    @staticmethod
    def cat_rows(parts: Sequence["Int4Weight"]) -> "Int4Weight":
        """The parts stacked by rows (new tensors); all must have the same K."""
        if len({int(p.shape[1]) for p in parts}) != 1:
            raise ValueError(f"cat_rows: different input widths {[int(p.shape[1]) for p in parts]}")
        return Int4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))


@torch.no_grad()
def quantize_groups(w: torch.Tensor, symmetric: bool = False) -> Int4Weight:
    """The 4-bit weight of ``w`` [N, K] (any float dtype, K a multiple of 128; computed in fp32 on w's device) by
    round-to-nearest per group of 128 input columns: asymmetric min-max (module docstring), or with
    ``symmetric`` the GPTQ reference's symmetric rule (scale = max|w| / 7.5, zero point 8; compressed-tensors'
    symmetric int4 is the same).  Error bound per element: |w - dequantized| <= scale / 2.  Raises
    GroupAlignmentError when K is not a multiple of 128."""
    n, k = w.shape
    if k % GROUP:
        raise GroupAlignmentError(f"{k} input columns is not a multiple of the group size {GROUP}")
    g = w.float().view(n, k // GROUP, GROUP)
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    if symmetric:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    scale = (hi - lo) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.full_like(scale, 8.0) if symmetric else torch.round(-lo / scale).clamp_(0, QMAX)
    q = (torch.round(g / scale[:, :, None]) + zero[:, :, None]).clamp_(0, QMAX)
    return Int4Weight(pack(q.view(n, k).to(torch.uint8)), scale.contiguous(), zero.to(torch.uint8).contiguous())


class Int4Linear(torch.nn.Module):
    """A bias-free linear layer with a 4-bit weight: ``weight_packed`` int32 [out, in/8] (a Parameter without
    gradient, so ``parameters()`` and ``.to(device)`` see it and DeepSpeed does not cast it), ``weight_scale``
    fp32 and ``weight_zero_point`` uint8 [out, in/128] (buffers: DeepSpeed's bf16 cast of parameters leaves
    them).  forward(x [..., in]) -> [..., out] in x's dtype (``fp8.linear``: the Triton GEMV for decode rows on
    CUDA, else the dequantised weight).  ``source``: where the weight came from ("gptq", "awq",
    "compressed-tensors" or "--quantize int4"), for the start-up log and ``/v1/models``."""

    def __init__(self, weight: Int4Weight, source: str = "") -> None:
        super().__init__()
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        self.source = source
        self.weight_packed = torch.nn.Parameter(weight.packed, requires_grad=False)
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("weight_zero_point", weight.zero)

    def int4_weight(self) -> Int4Weight:
        """The current weight as an ``Int4Weight`` (built on each call: ``.to()`` replaces buffers)."""
        return Int4Weight(self.weight_packed, self.weight_scale, self.weight_zero_point)

    def set_weight(self, weight: Int4Weight) -> None:
        """Rebind the weight (fusion views); the shape must not change.  Raises ValueError otherwise."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"set_weight: {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        self.weight_packed = torch.nn.Parameter(weight.packed, requires_grad=False)
        self.weight_scale = weight.scale
        self.weight_zero_point = weight.zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.int4_weight(), fast=x.is_cuda)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP}"
                f"{', ' + self.source if self.source else ''}")


def linear(x: torch.Tensor, w: Int4Weight, out: Optional[torch.Tensor] = None, *, fast: bool = False) -> torch.Tensor:
    """x [..., K] @ w^T for a 4-bit weight; returns [..., N] in x's dtype (into ``out`` [rows, N] when given).
    ``fast``: the Triton GEMV where ``int4_gemv.supports`` holds (up to ``int4_gemv.MAX_ROWS`` rows; a strided
    input is copied first); otherwise the weight dequantised to x's dtype (one [N, K] temporary) and a matmul.
    ``fp8.linear`` hands 4-bit weights here."""
    x2 = x.reshape(-1, x.shape[-1])
    if fast and x2.shape[0] <= int4_gemv.MAX_ROWS and not x2.is_contiguous():
        x2 = x2.contiguous()
    if fast and int4_gemv.supports(x2, w.packed, w.scale, w.zero):
        return int4_gemv.gemv_int4(x2, w.packed, w.scale, w.zero, out=out).reshape(*x.shape[:-1], w.shape[0])
    wd = w.dequantize(x.dtype)
    if out is not None:
        return torch.matmul(x2, wd.t(), out=out)
    return torch.nn.functional.linear(x, wd)


def is_local_int4(m: torch.nn.Module) -> bool:
    """An ``Int4Linear`` itself without forward hooks: its weight may be read directly."""
    return type(m) is Int4Linear and not m._forward_hooks and not m._forward_pre_hooks


def int4_summary(model: torch.nn.Module) -> dict:
    """Which weights are 4-bit: ``{"int4_modules": count, "int4_bytes": bytes held by them (packed values,
    scales, zero points), "int4_kinds": {"mlp.gate_proj": count, ...}, "int4_group_size": 128,
    "int4_sources": [...]}``; {} when none.  A module holds one when its ``int4_weight()`` returns an
    ``Int4Weight`` (``Int4Linear``, ``tp_layers.RowParallelLinear``)."""
    found = []
    for name, m in model.named_modules():
        get = getattr(m, "int4_weight", None)
        w = get() if callable(get) else None
        if isinstance(w, Int4Weight):
            found.append((name, m, w))
    if not found:
        return {}
    kinds = Counter(".".join(n.split(".")[-2:]) for n, _, _ in found)
    sources = sorted({getattr(m, "source", "") for _, m, _ in found} - {""})
    return {"int4_modules": len(found), "int4_bytes": sum(w.nbytes for _, _, w in found),
            "int4_kinds": dict(sorted(kinds.items())), "int4_group_size": GROUP, "int4_sources": sources}
