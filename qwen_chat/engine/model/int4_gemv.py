"""Triton kernels for 4-bit weights (W4A16): the decode GEMV and the dequantisation.

A 4-bit weight (``int4.Int4Weight``) is ``packed`` int32 [N, K/8] (eight 4-bit values per word along K, lowest
bits first), ``scale`` fp32 and ``zero`` uint8 [N, K/128]: w[n, k] = (q[n, k] - zero[n, k // 128]) *
scale[n, k // 128].  Batch-1 decode reads every weight once per token, so half a byte per weight instead of two
cuts the traffic that bounds the step about fourfold (docs/facts.md, "Per-token cost (batch 1 decode, bf16)").
The weight is dequantised in registers: it never exists in a wider dtype in memory.

- ``_int4_row_kernel`` (one input row per program column): each program owns ``BLOCK_N`` output features and
  walks K ``R`` groups of 128 columns per iteration: it loads 16 R words per row, takes value j of every word
  (columns 8 w + j) in turn through the 2^23 bit trick (``MAGIC_F32``: no int-to-float conversion), subtracts
  the group's zero point the same way (exact), multiplies by the input on the CUDA cores and applies the group's
  scale once per iteration;
- ``_int4_split_kernel`` (2 to 32 rows; ``BLOCK_B`` 16 or 32): programs over (``BLOCK_N`` features, ``BLOCK_B``
  rows); per group the [BLOCK_B, 128] input is split (register shuffles) into the eight column sets 8 w + j and
  each is multiplied on the tensor cores with value j of the words: in bf16 as the exact 128 + q
  (``MAGIC_BF16_BITS``), the (128 + zero) x row sum taken away afterwards; for fp16/fp32 inputs (and under the
  interpreter) as q - zero in the input's dtype (exact; ``input_precision="ieee"``, no TF32); the group's scale
  multiplies the [BLOCK_B, BLOCK_N] partial result;
- ``_int4_dot_kernel`` (``BLOCK_B`` 64: 33 to ``MAX_ROWS`` rows, where it measured faster): each dequantised
  [BLOCK_N, 128] tile is rounded to the activation dtype (as ``Int4Weight.dequantize`` rounds it) and multiplied
  on the tensor cores;
- ``_dequant_kernel``: the weight dequantised into the activation dtype, a [BLOCK_N, 128] tile per program,
  computed in fp32 and rounded once (prefill and batches above ``MAX_ROWS`` multiply the dequantised weight).

K is a compile-time constant (one kernel per input width; it also lets the loops run under Triton's
interpreter, which cannot take a run-time loop bound with numpy 2).  ``supports`` says when they apply (CUDA,
or Triton's interpreter for the CPU tests); tile sizes are fixed per shape by ``pick_config`` (measured ones
read from ``int4_tiles.json`` when a probe wrote it; no run-time autotuning: the same weights give the same bits,
restart after restart).  Compared with the dequantised matmul
under Triton's interpreter (tests/engine/test_triton_kernels.py) and on CUDA (bench/int4_gemv_probe.py).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

import torch

from qwen_chat.engine.model import gemv
from qwen_chat.engine.model.gemv import batch_class, read_tiles

triton = gemv.triton
if triton is not None:
    import triton.language as tl

#: Rows of the largest batch the GEMV kernels serve; larger batches multiply the dequantised weight (cuBLAS).
MAX_ROWS = 64
#: Input columns per scale and zero point (the checkpoints' ``group_size``).
GROUP = 128
#: fp32 2^23 and its bit pattern: OR-ing a 4-bit q into the low mantissa bits gives the float 2^23 + q exactly
#: (an integer-to-float conversion without the conversion instruction, which runs at a quarter of the FMA rate).
MAGIC_F32, MAGIC_F32_BITS = 8388608.0, 0x4B000000
#: bf16 bit pattern of 128.0: OR-ing q (< 128) into its 7 mantissa bits gives the bf16 128 + q exactly.
MAGIC_BF16_BITS = 0x4300
# (The kernels spell these three as literals: a jitted function may read only tl.constexpr globals.)


if triton is not None:

    @triton.jit
    def _dequant_tile(p_ptr, s_ptr, z_ptr, offs_n, n_mask, g, KW: tl.constexpr, KG: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """Group ``g`` of rows ``offs_n`` dequantised in fp32: [BLOCK_N, 128]."""
        offs_w = tl.arange(0, 16)
        shifts = tl.arange(0, 8) * 4
        words = tl.load(p_ptr + offs_n[:, None].to(tl.int64) * KW + g * 16 + offs_w[None, :],
                        mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 15, (BLOCK_N, 128)).to(tl.float32)
        meta = offs_n.to(tl.int64) * KG + g
        z = tl.load(z_ptr + meta, mask=n_mask, other=0).to(tl.float32)
        s = tl.load(s_ptr + meta, mask=n_mask, other=0.0)
        return (q - z[:, None]) * s[:, None]

    @triton.jit
    def _int4_row_kernel(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                         R: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = tl.program_id(1).to(tl.int64)
        n_mask = offs_n < N
        rows = offs_n.to(tl.int64)
        KW: tl.constexpr = K // 8
        KG: tl.constexpr = K // 128
        BKW: tl.constexpr = 16 * R  # words per iteration: R groups
        offs_kw = tl.arange(0, BKW)
        acc = tl.zeros((BLOCK_N, BKW), dtype=tl.float32)
        for kw0 in range(0, KW, BKW):
            words = tl.load(p_ptr + rows[:, None] * KW + kw0 + offs_kw[None, :], mask=n_mask[:, None], other=0,
                            eviction_policy="evict_first")  # [BLOCK_N, BKW]
            meta = rows[:, None] * KG + (kw0 + offs_kw[None, :]) // 16
            z = tl.load(z_ptr + meta, mask=n_mask[:, None], other=0).to(tl.float32) + 8388608.0  # MAGIC_F32
            s = tl.load(s_ptr + meta, mask=n_mask[:, None], other=0.0)
            part = tl.zeros((BLOCK_N, BKW), dtype=tl.float32)
            for j in tl.static_range(8):  # value j of every word: column 8 * word + j
                qf = (((words >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True)  # MAGIC_F32_BITS: 2^23 + q
                xj = tl.load(x_ptr + row * K + (kw0 + offs_kw) * 8 + j).to(tl.float32)
                part += (qf - z) * xj[None, :]  # (2^23 + q) - (2^23 + zero): exact
            acc += part * s
        tl.store(y_ptr + row * N + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _weight_slice(words, j: tl.constexpr, zb, dtype: tl.constexpr, BITCAST: tl.constexpr):
        """Value j of every word of ``words`` [BLOCK_N, 16] as a tl.dot operand in ``dtype``: 128 + q through the
        bf16 bit pattern (``BITCAST``), else q - zero (``zb`` [BLOCK_N]) converted; both exact."""
        if BITCAST:
            return (((words >> (4 * j)) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return (((words >> (4 * j)) & 15).to(tl.float32) - zb[:, None]).to(dtype)

    @triton.jit
    def _int4_split_kernel(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, B, N, K: tl.constexpr, BLOCK_B: tl.constexpr,
                           BLOCK_N: tl.constexpr, BITCAST: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        n_mask = offs_n < N
        b_mask = offs_b[:, None] < B
        rows = offs_n.to(tl.int64)
        KW: tl.constexpr = K // 8
        KG: tl.constexpr = K // 128
        offs_w = tl.arange(0, 16)
        x_ptrs = x_ptr + offs_b[:, None].to(tl.int64) * K + tl.arange(0, 128)[None, :]
        acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
        for g in range(0, KG):
            words = tl.load(p_ptr + rows[:, None] * KW + g * 16 + offs_w[None, :], mask=n_mask[:, None], other=0,
                            eviction_policy="evict_first")  # [BLOCK_N, 16]
            meta = rows * KG + g
            zb = tl.load(z_ptr + meta, mask=n_mask, other=0).to(tl.float32)
            sc = tl.load(s_ptr + meta, mask=n_mask, other=0.0)
            x = tl.load(x_ptrs + g * 128, mask=b_mask, other=0.0)  # [BLOCK_B, 128]
            # Columns 8w + j of the group, j = 4 * j2 + 2 * j1 + j0: three halvings of the last axis.
            e, o = tl.split(tl.reshape(x, (BLOCK_B, 16, 2, 2, 2)))
            e0, e1 = tl.split(e)
            o0, o1 = tl.split(o)
            x0, x4 = tl.split(e0)
            x2, x6 = tl.split(e1)
            x1, x5 = tl.split(o0)
            x3, x7 = tl.split(o1)
            dt = x_ptr.dtype.element_ty
            part = tl.dot(x0, tl.trans(_weight_slice(words, 0, zb, dt, BITCAST)), input_precision="ieee")
            part += tl.dot(x1, tl.trans(_weight_slice(words, 1, zb, dt, BITCAST)), input_precision="ieee")
            part += tl.dot(x2, tl.trans(_weight_slice(words, 2, zb, dt, BITCAST)), input_precision="ieee")
            part += tl.dot(x3, tl.trans(_weight_slice(words, 3, zb, dt, BITCAST)), input_precision="ieee")
            part += tl.dot(x4, tl.trans(_weight_slice(words, 4, zb, dt, BITCAST)), input_precision="ieee")
            part += tl.dot(x5, tl.trans(_weight_slice(words, 5, zb, dt, BITCAST)), input_precision="ieee")
            part += tl.dot(x6, tl.trans(_weight_slice(words, 6, zb, dt, BITCAST)), input_precision="ieee")
            part += tl.dot(x7, tl.trans(_weight_slice(words, 7, zb, dt, BITCAST)), input_precision="ieee")
            if BITCAST:  # part = sum x (128 + q): take away (128 + zero) * sum x
                xs = tl.sum(x.to(tl.float32), axis=1)
                part = part - xs[:, None] * (zb + 128.0)[None, :]
            acc += part * sc[None, :]
        out = y_ptr + offs_b[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=b_mask & n_mask[None, :])

    @triton.jit
    def _int4_dot_kernel(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, B, N, K: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_N: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        n_mask = offs_n < N
        b_mask = offs_b[:, None] < B
        x_ptrs = x_ptr + offs_b[:, None].to(tl.int64) * K + tl.arange(0, 128)[None, :]
        KG: tl.constexpr = K // 128
        acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
        for g in range(0, KG):
            w = _dequant_tile(p_ptr, s_ptr, z_ptr, offs_n, n_mask, g, K // 8, KG, BLOCK_N)
            x = tl.load(x_ptrs + g * 128, mask=b_mask, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), input_precision="ieee")
        out = y_ptr + offs_b[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=b_mask & n_mask[None, :])

    @triton.jit
    def _dequant_kernel(p_ptr, s_ptr, z_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.program_id(1)
        n_mask = offs_n < N
        w = _dequant_tile(p_ptr, s_ptr, z_ptr, offs_n, n_mask, g, K // 8, K // 128, BLOCK_N)
        offs = offs_n[:, None].to(tl.int64) * K + g * 128 + tl.arange(0, 128)[None, :]
        tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def _on_device(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _weight_ok(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> bool:
    if packed.dim() != 2 or scale.dim() != 2 or zero.dim() != 2:
        return False
    n, k = packed.shape[0], packed.shape[1] * 8
    return (k % GROUP == 0 and packed.dtype == torch.int32 and scale.dtype == torch.float32
            and zero.dtype == torch.uint8 and tuple(scale.shape) == tuple(zero.shape) == (n, k // GROUP)
            and packed.device == scale.device == zero.device
            and packed.is_contiguous() and scale.is_contiguous() and zero.is_contiguous())


def supports(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """True when ``gemv_int4(x, packed, scale, zero)`` runs: Triton importable, CUDA tensors (or Triton's
    interpreter, ``TRITON_INTERPRET=1``, on CPU tensors), x [B, K] contiguous in bf16, fp16 or fp32 with
    1 <= B <= MAX_ROWS, packed int32 [N, K/8] with K a multiple of 128, scale fp32 and zero uint8 [N, K/128],
    all contiguous on x's device."""
    if triton is None or x.dim() != 2 or not _weight_ok(packed, scale, zero):
        return False
    return (_on_device(x) and x.device == packed.device and 1 <= x.shape[0] <= MAX_ROWS
            and x.shape[1] == packed.shape[1] * 8 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.is_contiguous())


def valid_config(cfg: dict, B: int, K: int) -> bool:
    """Whether ``cfg`` can launch for B rows and input width K: the row kernel (``R`` groups per iteration, a
    power of two dividing K / 128) or the dot kernel (``BLOCK_B`` of 16, 32 or 64 rows, ``BLOCK_N`` >= 16, tl.dot's
    smallest tile); ``BLOCK_N`` a power of two from 1 (row kernel) to 256."""
    bn = cfg.get("BLOCK_N", 0)
    if not (0 < bn <= 256 and bn & (bn - 1) == 0):
        return False
    if "BLOCK_B" in cfg:
        return cfg["BLOCK_B"] in (16, 32, 64) and bn >= 16
    r = cfg.get("R", 0)
    return r > 0 and r & (r - 1) == 0 and (K // GROUP) % r == 0


#: Tiles measured fastest per (batch class, N, K) (``bench/int4_gemv_probe.py --save-tiles``; the file also
#: records the date, GPU, versions and command).  Batch classes: "1", "16" (2-16 rows), "32", "64".
TILES_FILE = Path(__file__).with_name("int4_tiles.json")


@functools.lru_cache(maxsize=1)
def tuned() -> dict:
    """{(batch class, N, K): launch config} from ``TILES_FILE`` (``gemv.read_tiles``: {} when absent)."""
    return read_tiles(TILES_FILE)


def pick_config(B: int, N: int, K: int) -> dict:
    """Launch parameters for one shape: the measured tiles (``tuned``) when valid, else the row kernel (BLOCK_N,
    R) for one row and the dot kernel (BLOCK_B, BLOCK_N) above; plus num_warps and num_stages.  Fixed per shape
    (no run-time autotuning: the same weights give the same bits, restart after restart)."""
    cfg = tuned().get((batch_class(B), N, K))
    if cfg is not None and valid_config(cfg, B, K):
        return dict(cfg)
    # Defaults from the tile sweep on one H200 (bench/results/2026-12-02-NVIDIA-H200-int4-tiles.json): one row,
    # 4 features x 8 groups per program and 8 warps for every shape of the 9B; 2-32 rows, the split kernel with
    # 64-128 features (N >= 10,000) or 32-64; 33-64 rows, the dequantised-tile kernel with 128 features.
    if B == 1:
        r = next(r for r in (8, 4, 2, 1) if (K // GROUP) % r == 0)
        return dict(BLOCK_N=4, R=r, num_warps=8, num_stages=3)
    if B <= 16:
        return dict(BLOCK_B=16, BLOCK_N=64 if N >= 10_000 else 32, num_warps=4, num_stages=3 if N >= 10_000 else 4)
    if B <= 32:
        return dict(BLOCK_B=32, BLOCK_N=128 if N >= 10_000 else 64, num_warps=4, num_stages=3)
    return dict(BLOCK_B=64, BLOCK_N=128, num_warps=4, num_stages=4)


def gemv_int4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              out: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """y = x @ w^T for the 4-bit weight (packed, scale, zero) with the Triton kernels: x [B, K]; returns [B, N]
    in x's dtype (fp32 accumulation), into ``out`` [B, N] when given.  ``config`` overrides ``pick_config``
    (benchmarks).  Raises ValueError when ``supports`` is false or ``config`` cannot launch."""
    if not supports(x, packed, scale, zero):
        raise ValueError(f"gemv_int4: unsupported operands x{tuple(x.shape)} {x.dtype} {x.device}, "
                         f"packed{tuple(packed.shape)} {packed.dtype}, scale{tuple(scale.shape)} {scale.dtype}, "
                         f"zero{tuple(zero.shape)} {zero.dtype}")
    B, K = x.shape
    N = packed.shape[0]
    cfg = dict(config or pick_config(B, N, K))
    if not valid_config(cfg, B, K):
        raise ValueError(f"gemv_int4: config {cfg} cannot launch for {B} rows and K={K}")
    if out is None:
        out = torch.empty(B, N, device=x.device, dtype=x.dtype)
    if "BLOCK_B" in cfg:
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(B, cfg["BLOCK_B"]))
        if cfg["BLOCK_B"] == 64:
            _int4_dot_kernel[grid](x, packed, scale, zero, out, B, N, K, **cfg)
        else:  # the bf16 bit trick on a GPU; Triton's interpreter multiplies bit-cast bf16 wrongly
            bitcast = x.dtype == torch.bfloat16 and x.is_cuda
            _int4_split_kernel[grid](x, packed, scale, zero, out, B, N, K, BITCAST=bitcast, **cfg)
    else:
        _int4_row_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), B)](x, packed, scale, zero, out, N, K, **cfg)
    return out


def dequantize_supported(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """True when ``dequantize`` runs: Triton, CUDA (or the interpreter) and the operands of ``supports``
    (elsewhere ``int4.Int4Weight.dequantize`` uses PyTorch)."""
    return triton is not None and _on_device(packed) and _weight_ok(packed, scale, zero)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q - zero) * scale as a new [N, K] tensor in ``dtype``, computed in fp32 and rounded once.  Raises
    ValueError when ``dequantize_supported`` is false."""
    if not dequantize_supported(packed, scale, zero):
        raise ValueError(f"dequantize: unsupported operands packed{tuple(packed.shape)} {packed.dtype} "
                         f"{packed.device}, scale{tuple(scale.shape)} {scale.dtype}, zero{tuple(zero.shape)}")
    N, K = packed.shape[0], packed.shape[1] * 8
    out = torch.empty(N, K, device=packed.device, dtype=dtype)
    _dequant_kernel[(triton.cdiv(N, 32), K // GROUP)](packed, scale, zero, out, N, K, BLOCK_N=32)
    return out
