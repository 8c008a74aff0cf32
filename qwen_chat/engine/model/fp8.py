"""FP8 weights in the 128 x 128 block format, as the engine holds them: ``Fp8Weight``, ``Fp8Linear``, the one
``linear`` that multiplies by a bf16 or an FP8 weight, and block quantisation.

Format (DeepSeek-V3's, used by Qwen/Qwen3.5-9B-FP8 and community FP8 exports; docs/checkpoints.md, "FP8"):
``data`` float8_e4m3fn [N, K] and ``scale`` fp32 [ceil(N/128), ceil(K/128)] (stored as ``<name>.weight_scale_inv``:
the name says it is the inverse of the quantisation scale, i.e. it multiplies), w[n, k] = data[n, k] *
scale[n // 128, k // 128].  ``quantize_blocks`` makes it from a weight: per block scale = amax / 448 (448 is the
largest finite e4m3fn value, ``torch.finfo(torch.float8_e4m3fn).max``), data = round-to-nearest-even(w / scale),
the rule of transformers 5.23's ``integrations/finegrained_fp8.Fp8Quantize`` (blocks that are all zero get scale 1).

``linear(x, w)`` is x @ w^T for either kind of weight: an FP8 weight goes through the Triton GEMV
(``fp8_gemv``) for up to ``fp8_gemv.MAX_ROWS`` rows on CUDA when ``fast`` is set, else through its
dequantisation to the activation dtype (one [N, K] temporary; prefill, the CPU path); a bf16 tensor through
``gemv`` or ``F.linear``.  Activations are never quantised (weight-only FP8; ``activation_scheme`` "dynamic"
in the checkpoint means no stored activation scales).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from qwen_chat.engine.model import fp8_gemv, gemv, int4
from qwen_chat.engine.model.int4 import GROUP, Int4Weight, int4_summary
from qwen_chat.engine.model.memory import size_text

BLOCK = fp8_gemv.BLOCK
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite float8_e4m3fn value (``torch.finfo(torch.float8_e4m3fn).max``).
FP8_MAX = 448.0


def blocks(n: int) -> int:
    """Scale blocks that cover ``n`` rows or columns: ceil(n / 128)."""
    return -(-int(n) // BLOCK)


class BlockAlignmentError(ValueError):
    """A slice of an FP8 weight would cut a 128 x 128 scale block (its scale would belong to two pieces)."""


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight: ``data`` float8_e4m3fn [N, K], ``scale`` fp32 [ceil(N/128), ceil(K/128)] (see the module
    docstring).  A view object: it holds the tensors, does not copy them."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """[N, K] (out, in features)."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: one per weight plus four per scale."""
        return self.data.numel() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """w = data * scale as a new [N, K] tensor in ``dtype`` (fp32 products, one rounding): the Triton kernel on
        CUDA, else PyTorch."""
        if fp8_gemv.dequantize_supported(self.data, self.scale) and self.data.is_cuda:
            return fp8_gemv.dequantize(self.data, self.scale, dtype)
        n, k = self.data.shape
        s = self.scale.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        return (self.data.float() * s).to(dtype)

    def rows(self, start: int, stop: int) -> "Fp8Weight":
        """Rows start..stop-1 (a view).  Raises BlockAlignmentError unless ``start`` is a multiple of 128 and
        ``stop`` is one too or the last row."""
        n = self.shape[0]
        if start % BLOCK or (stop % BLOCK and stop != n) or not 0 <= start < stop <= n:
            raise BlockAlignmentError(f"rows {start}..{stop} of {n} cut a {BLOCK} x {BLOCK} block")
        return Fp8Weight(self.data[start:stop], self.scale[start // BLOCK:blocks(stop)])

    def cols(self, start: int, stop: int) -> "Fp8Weight":
        """Columns start..stop-1 (copies: contiguous).  Raises BlockAlignmentError as ``rows`` does."""
        k = self.shape[1]
        if start % BLOCK or (stop % BLOCK and stop != k) or not 0 <= start < stop <= k:
            raise BlockAlignmentError(f"columns {start}..{stop} of {k} cut a {BLOCK} x {BLOCK} block")
        return Fp8Weight(self.data[:, start:stop].contiguous(),
                         self.scale[:, start // BLOCK:blocks(stop)].contiguous())

    @staticmethod
    def cat_rows(parts: Sequence["Fp8Weight"]) -> "Fp8Weight":
        """The parts stacked by rows (new tensors).  Raises BlockAlignmentError when a part other than the last
        has a row count that is not a multiple of 128 (its last scale block would cover the next part's rows)."""
        if any(p.shape[0] % BLOCK for p in parts[:-1]):
            raise BlockAlignmentError("only the last part may end inside a 128-row block: "
                                      f"{[int(p.shape[0]) for p in parts]}")
        return Fp8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]))


#: A projection's weight: a bf16/fp32 tensor, an FP8 weight or a 4-bit one (``int4.Int4Weight``).
Weight = Union[torch.Tensor, Fp8Weight, Int4Weight]


@torch.no_grad()
def quantize_blocks(w: torch.Tensor) -> Fp8Weight:
    """The block-format FP8 weight of ``w`` [N, K] (any float dtype; computed in fp32 on w's device): per 128 x
    128 block scale = amax / 448, data = w / scale rounded to nearest even (the module docstring); an all-zero
    block gets scale 1.  Error bound per element (half a step of e4m3's 3 mantissa bits; subnormals below
    2^-6 step by 2^-9): |w - dequantized| <= 2^-4 |w| + 2^-10 scale, so at most amax(block) / 16."""
    n, k = w.shape
    nb, kb = blocks(n), blocks(k)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, BLOCK, kb, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))                                               # [nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(), scale.contiguous())


def linear(x: torch.Tensor, w: Weight, out: Optional[torch.Tensor] = None, *, fast: bool = False,
           swiglu: bool = False) -> torch.Tensor:
    """x [..., K] @ w^T for a bf16/fp32 weight tensor [N, K], an ``Fp8Weight`` or an ``int4.Int4Weight``; returns
    [..., N] in x's dtype (into ``out`` [rows, N] when given).  ``fast``: the Triton GEMVs where they apply
    (``gemv.supports``, ``fp8_gemv.supports``, ``int4_gemv.supports``); otherwise cuBLAS / CPU on the weight (an
    FP8 or 4-bit weight dequantised to x's dtype first: one [N, K] temporary).
    ``swiglu``: x is [B, 2K] = [gate | up] and the input is silu(gate) * up (``fuses_swiglu`` must hold).
    Raises ValueError for ``swiglu`` where ``fuses_swiglu`` is false."""
    x2 = x.reshape(-1, x.shape[-1])
    if swiglu and not fuses_swiglu(x2, w):
        raise ValueError("linear(swiglu=True) needs fuses_swiglu(x, w)")
    if isinstance(w, Int4Weight):
        return int4.linear(x, w, out, fast=fast)
    if isinstance(w, Fp8Weight):
        if fast and x2.shape[0] <= fp8_gemv.MAX_ROWS and not x2.is_contiguous():
            x2 = x2.contiguous()  # a few rows: copying them beats dequantising the weight
        if fast and fp8_gemv.supports(x2, w.data, w.scale, swiglu):
            y = fp8_gemv.gemv_fp8(x2, w.data, w.scale, out=out, swiglu=swiglu)
            return y.reshape(*x.shape[:-1], w.shape[0])
        w = w.dequantize(x.dtype)
    elif swiglu or (fast and gemv.supports(x2, w)):
        return gemv.gemv(x2, w, out=out, swiglu=swiglu).reshape(*x.shape[:-1], w.shape[0])
    if out is not None:
        return torch.matmul(x2, w.t(), out=out)
    return F.linear(x, w)


def fuses_swiglu(x: torch.Tensor, w: Weight) -> bool:
    """True when ``linear(x, w, swiglu=True, fast=True)`` runs one kernel that computes the SwiGLU as it loads x
    [B, 2K] (``gemv.supports`` / ``fp8_gemv.supports`` with ``swiglu``; never for a 4-bit weight)."""
    if isinstance(w, Int4Weight):
        return False
    if isinstance(w, Fp8Weight):
        return fp8_gemv.supports(x, w.data, w.scale, swiglu=True)
    return gemv.supports(x, w, swiglu=True)


class Fp8Linear(torch.nn.Module):
    """A bias-free linear layer with an FP8 weight: ``weight`` float8_e4m3fn [out, in] (a Parameter without
    gradient: ``parameters()`` and ``.to(device)`` see it, and DeepSpeed does not cast it), ``weight_scale_inv``
    fp32 [ceil(out/128), ceil(in/128)] (a buffer, so DeepSpeed's bf16 cast of parameters leaves it fp32).  Names
    as in the checkpoint.  forward(x [..., in]) -> [..., out] in x's dtype (``linear``; the Triton GEMV for
    decode-sized inputs on CUDA)."""

    def __init__(self, weight: Fp8Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        self.weight = torch.nn.Parameter(weight.data, requires_grad=False)
        self.register_buffer("weight_scale_inv", weight.scale)

    def fp8_weight(self) -> Fp8Weight:
        """The current weight as an ``Fp8Weight`` (built on each call: ``.to()`` replaces buffers)."""
        return Fp8Weight(self.weight, self.weight_scale_inv)

    def set_weight(self, weight: Fp8Weight) -> None:
        """Rebind the weight and its scales (fusion views, a merged adapter); the shape must not change."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"set_weight: {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        self.weight = torch.nn.Parameter(weight.data, requires_grad=False)
        self.weight_scale_inv = weight.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.fp8_weight(), fast=x.is_cuda)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 blocks {BLOCK}x{BLOCK}"


def is_local_fp8(m: torch.nn.Module) -> bool:
    """An ``Fp8Linear`` itself without forward hooks: its weight may be read directly (``Fp8Linear.fp8_weight``)."""
    return type(m) is Fp8Linear and not m._forward_hooks and not m._forward_pre_hooks


def fp8_summary(model: torch.nn.Module) -> dict:
    """Which weights are FP8, for the start-up log and ``/v1/models``: ``{"fp8_modules": count, "fp8_bytes":
    bytes held by FP8 weights and their scales, "fp8_kinds": {"mlp.gate_proj": count, ...}}`` (kinds:
    the last two parts of the module names); {} when the model holds no FP8 weight.  A module holds one when it
    has an ``fp8_weight()`` method that returns an ``Fp8Weight`` (``Fp8Linear``, ``tp_layers.RowParallelLinear``)."""
    found = []
    for name, m in model.named_modules():
        get = getattr(m, "fp8_weight", None)
        w = get() if callable(get) else None
        if isinstance(w, Fp8Weight):
            found.append((name, w))
    if not found:
        return {}
    kinds = Counter(".".join(n.split(".")[-2:]) for n, _ in found)
    return {"fp8_modules": len(found), "fp8_bytes": sum(w.nbytes for _, w in found),
            "fp8_kinds": dict(sorted(kinds.items()))}


def weights_report(model: torch.nn.Module) -> dict:
    """The weights as ``/v1/models`` shows them (``engine.weights``): ``dtype`` of the other weights (the input
    embedding's), ``fp8_modules`` and ``int4_modules`` (0 without), with FP8 ``fp8_bytes`` and ``fp8_kinds``
    (``fp8_summary``), with 4-bit weights ``int4_bytes``, ``int4_kinds``, ``int4_group_size`` and
    ``int4_sources`` (``int4.int4_summary``); this rank's share under tensor parallelism."""
    dtype = str(model.get_input_embeddings().weight.dtype).replace("torch.", "")
    return {"dtype": dtype, "fp8_modules": 0, "int4_modules": 0, **fp8_summary(model), **int4_summary(model)}


def describe_weights(model: torch.nn.Module, source: str) -> str:
    """One start-up log line saying which weights are FP8 or 4-bit (``source``: where they came from, e.g.
    "checkpoint", "--quantize fp8" or "--quantize int4")."""
    r = weights_report(model)
    said = []
    if r["fp8_modules"]:
        kinds = ", ".join(f"{k} x{n}" for k, n in r["fp8_kinds"].items())
        said.append(f"FP8 e4m3 in {BLOCK} x {BLOCK} blocks ({source}) for {r['fp8_modules']} linear layers, "
                    f"{size_text(r['fp8_bytes'])} on this rank: {kinds}")
    if r["int4_modules"]:
        kinds = ", ".join(f"{k} x{n}" for k, n in r["int4_kinds"].items())
        said.append(f"4-bit (W4A16, groups of {GROUP} input columns, {'/'.join(r['int4_sources']) or source}) "
                    f"for {r['int4_modules']} linear layers, {size_text(r['int4_bytes'])} on this rank: {kinds}")
    if not said:
        return f"weights: {r['dtype']} (not quantised)"
    return (f"weights: {'; '.join(said)}; {r['dtype']} for the rest (embeddings, lm_head, vision tower, norms and "
            "the layers left unquantised)")
