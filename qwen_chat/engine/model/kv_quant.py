"""The KV cache's storage types: the model's dtype, or FP8 (e4m3) with one scale per token and KV head.

``--kv-cache-dtype fp8`` stores each attention layer's keys and values as ``torch.float8_e4m3fn`` (1 byte per
element instead of 2) beside an fp32 scale per (position, KV head) computed when the position is written:
scale = max |x| over the head's ``hd`` channels / 448 (the largest finite e4m3 value), element = x / scale
rounded to e4m3.  Per position and head, because a written position never changes: no scale has to grow
later (as a per-block or per-layer running scale would, re-quantising what was written before), and a
tensor-parallel shard owns whole heads, so every rank quantises its heads as one rank would.  Qwen3.5-9B's
attention layers (hd = 256, 4 KV heads, ``docs/facts.md``) then hold 2 x 4 x (256 + 4) = 2,080 bytes per token
and layer instead of 4,096: 1.97x the tokens per byte of KV (the memory plan also buys state slots, so a budget
holds 1.5-1.7x the tokens: docs/checkpoints.md).  The Gated DeltaNet states keep their dtype.

Readers dequantise (element x scale) into the compute dtype before attention; prefill attends to the
dequantised keys and values of its own chunk too, so a prompt gives the same attention whether it was
prefilled in one chunk, in several, or continued from a kept prefix.  e4m3 keeps 3 mantissa bits: each element
is within 2^-4 of its value relative to the element, or 2^-9 x scale absolutely near zero (the subnormals);
the logit error against the model's own KV is in docs/checkpoints.md, "FP8 KV cache".

``write`` and ``read`` take the cache tensor, its scale tensor (None for a cache in the model's dtype) and an
index over the leading dimensions, so one code path serves both storages, in eager code and under
``torch.compile``.
"""
from __future__ import annotations

from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
#: The oldest CUDA compute capability whose Triton kernels (the compiled decode glue) convert e4m3: 8.9 (Ada).
MIN_CUDA_CAPABILITY = (8, 9)
#: The largest finite e4m3 value (OCP 8-bit floating point specification, E4M3: 448).
FP8_MAX = 448.0
#: Smallest scale: an all-zero head stores zeros (and not 0 / 0).
MIN_SCALE = 1e-12


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache holds for ``--kv-cache-dtype`` ("auto": ``model_dtype``; "fp8": ``FP8``).  Raises
    ValueError for another choice."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8
    raise ValueError(f"--kv-cache-dtype must be auto or fp8, got {kv_cache_dtype!r}")


def check_device(kv_cache_dtype: str, device: torch.device) -> None:
    """Raise ValueError (one line, what to do) when ``--kv-cache-dtype`` cannot run on ``device``: FP8 on a CUDA
    GPU older than ``MIN_CUDA_CAPABILITY`` (Triton's e4m3 conversion needs it)."""
    if kv_cache_dtype != "fp8" or torch.device(device).type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CUDA_CAPABILITY:
        raise ValueError(f"--kv-cache-dtype fp8 needs a GPU of compute capability "
                         f"{'.'.join(map(str, MIN_CUDA_CAPABILITY))} or newer (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: leave the flag out")


def is_quantized(dtype: torch.dtype) -> bool:
    """True for a cache dtype that needs scales (FP8)."""
    return dtype == FP8


def token_bytes(nkv: int, hd: int, dtype: torch.dtype) -> int:
    """Bytes of one position's keys or values in one attention layer: ``nkv`` heads of ``hd`` elements, plus one
    fp32 scale per head when quantised."""
    return nkv * hd * dtype.itemsize + (nkv * 4 if is_quantized(dtype) else 0)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 elements, fp32 scales) of ``x`` [..., hd] (any float dtype): scales [...] = max |x| / 448 per row
    (at least ``MIN_SCALE``), elements = x / scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale[..., None]).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` [..., hd] (e4m3) times ``scale`` [...] (fp32), in ``dtype``: one tensor of ``dtype`` is made and
    scaled in place (e4m3 is exact in bf16 and fp32; the scale is rounded to ``dtype``), so reading n elements
    holds n bytes of e4m3 and n of ``dtype`` at most (``gather_bytes``)."""
    x = q.to(dtype)
    return x.mul_(scale.to(dtype)[..., None])


def gather_bytes(nkv: int, hd: int, dtype: torch.dtype, storage: torch.dtype) -> int:
    """Bytes a reader holds per position of one layer's keys and values while it gathers them into ``dtype``
    (``read``): the ``dtype`` copies, plus the gathered e4m3 elements and scales of one of them when
    ``storage`` is quantised."""
    return 2 * nkv * hd * dtype.itemsize + (token_bytes(nkv, hd, storage) if is_quantized(storage) else 0)


def write(cache: torch.Tensor, scales: Optional[torch.Tensor], index, x: torch.Tensor) -> None:
    """Store ``x`` [..., hd] at ``cache[index]`` (in place; ``index``: a tensor or a tuple of tensors over the
    leading dimensions): cast to the cache's dtype, or quantised with its scales into ``scales[index]``."""
    if scales is None:
        cache.index_put_(index if isinstance(index, tuple) else (index,), x.to(cache.dtype))
        return
    q, s = quantize(x)
    index = index if isinstance(index, tuple) else (index,)
    cache.index_put_(index, q)
    scales.index_put_(index, s)


def read(cache: torch.Tensor, scales: Optional[torch.Tensor], index, dtype: torch.dtype) -> torch.Tensor:
    """``cache[index]`` in ``dtype`` (dequantised with ``scales[index]`` when the cache is quantised)."""
    if scales is None:
        return cache[index].to(dtype)
    return dequantize(cache[index], scales[index], dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` would give it back (quantised and dequantised for FP8, else ``x``)."""
    if not is_quantized(dtype):
        return x
    q, s = quantize(x)
    return dequantize(q, s, x.dtype)
