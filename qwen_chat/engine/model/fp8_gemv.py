"""Triton kernels for FP8 weights in the 128 x 128 block format: the decode GEMV and the dequantisation.

An FP8 weight (``fp8.Fp8Weight``) is ``data`` float8_e4m3fn [N, K] plus ``scale`` fp32 [ceil(N/128), ceil(K/128)],
w[n, k] = data[n, k] * scale[n // 128, k // 128] (DeepSeek-V3's block format, docs/checkpoints.md, "FP8").
Batch-1 decode reads every weight once per token, so reading one byte per weight instead of two halves the
traffic that bounds the step (docs/facts.md, "Per-token cost (batch 1 decode, bf16)").

- ``_fp8_row_kernel`` (one row): each program owns ``BLOCK_N`` output features inside one 128-row block and walks
  K in ``BLOCK_K`` tiles (multiples of 128); the input tile is multiplied by its scales (one per 128 columns)
  in fp32, then by the weight tile converted to fp32, and reduced across K on the CUDA cores, as the bf16
  ``gemv._gemv_row_kernel`` does;
- ``_fp8_dot_kernel`` (up to ``MAX_ROWS`` rows; one row too where the measured tiles pick it): programs over
  (``BLOCK_N`` features, ``BLOCK_B`` rows), ``BLOCK_K`` columns (R scale blocks) per iteration; each
  [BLOCK_N, 128] tile of the weight is converted to the activation dtype (exact: every e4m3 value is a bf16
  value) and multiplied on the tensor cores (``tl.dot``, ``input_precision="ieee"`` so fp32 activations are not
  rounded to TF32), and the tile's fp32 product is scaled by the block's scale before it is accumulated;
- ``_dequant_kernel``: data * scale into the activation dtype, one 128 x 128 block per program, computed in
  fp32 and rounded once (prefill, and batches above ``MAX_ROWS``, multiply the dequantised weight).

Both GEMV kernels take the MLP's fused [gate | up] rows with ``swiglu`` (``gemv.load_input``).  K is a
compile-time constant (one kernel per input width: the model has three), which also lets the loops run under
Triton's interpreter (triton 3.6 with numpy 2 cannot take a run-time loop bound there).  ``supports``
says when they apply (CUDA, or Triton's interpreter for the CPU tests); tile sizes come from ``pick_config``
(fixed per shape, measured ones read from ``fp8_tiles.json``: the same weights give the same bits, restart after
restart).  Compared with the dequantised matmul under Triton's interpreter (tests/engine/test_triton_kernels.py)
and on CUDA (tests/gpu).
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

    from qwen_chat.engine.model.gemv import load_input, load_weight_tile, row_tile, store_row

#: Rows (activations) of the largest batch the GEMV kernels serve; larger batches multiply the dequantised
#: weight (cuBLAS), whose extra traffic is then shared by many rows.
MAX_ROWS = 64
#: Rows and columns of one scale block (the format's ``weight_block_size``).
BLOCK = 128


if triton is not None:

    @triton.jit
    def _fp8_row_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K: tl.constexpr, KB: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                        SWIGLU: tl.constexpr):
        offs_n, offs_k, w_ptrs, x_ptrs = row_tile(w_ptr, x_ptr, K, BLOCK_N, BLOCK_K)
        # BLOCK_N divides 128, so the program's rows share one row of scale blocks
        s_ptrs = s_ptr + ((tl.program_id(0) * BLOCK_N) // 128) * KB + offs_k // 128
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            w = load_weight_tile(w_ptrs, offs_n, N, EVEN_N)
            x = load_input(x_ptrs, K, offs_k < BLOCK_K, SWIGLU) * tl.load(s_ptrs)
            acc += w.to(tl.float32) * x[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            s_ptrs += BLOCK_K // 128
        store_row(y_ptr, offs_n, tl.sum(acc, axis=1), N, EVEN_N)

    @triton.jit
    def _fp8_dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, B, N, K: tl.constexpr, KB: tl.constexpr,
                        BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_N: tl.constexpr, SWIGLU: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_b = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        offs_k = tl.arange(0, 128)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        x_stride = 2 * K if SWIGLU else K
        x_ptrs = x_ptr + offs_b[:, None].to(tl.int64) * x_stride + offs_k[None, :]
        b_mask = offs_b[:, None] < B
        s_row = s_ptr + ((pid_n * BLOCK_N) // 128) * KB
        acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
        R: tl.constexpr = BLOCK_K // 128
        for kb in range(0, KB, R):  # BLOCK_K columns per iteration, as R scale blocks of 128
            for r in tl.static_range(R):
                w = load_weight_tile(w_ptrs + r * 128, offs_n, N, EVEN_N)
                x = load_input(x_ptrs + r * 128, K, b_mask, SWIGLU).to(x_ptr.dtype.element_ty)
                part = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), input_precision="ieee")
                acc += part * tl.load(s_row + kb + r)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = y_ptr + offs_b[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=b_mask & (offs_n[None, :] < N))

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, KB):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * 128 + tl.arange(0, 128)
        offs_k = pid_k * 128 + tl.arange(0, 128)
        offs = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + pid_n * KB + pid_k)
        tl.store(out_ptr + offs, (w * s).to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _fp8_capable(index: int) -> bool:
    """Triton converts float8_e4m3fn (``fp8e4nv``) on compute capability 8.9 and newer (Ada, Hopper)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def _on_device(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return _fp8_capable(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return os.environ.get("TRITON_INTERPRET") == "1"


def supports(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, swiglu: bool = False) -> bool:
    """True when ``gemv_fp8(x, data, scale, swiglu=swiglu)`` runs: Triton importable, CUDA tensors on a GPU of
    compute capability >= 8.9 (or Triton's interpreter, ``TRITON_INTERPRET=1``), x [B, K] (with ``swiglu`` [B, 2K]) contiguous in bf16, fp16 or fp32
    with 1 <= B <= MAX_ROWS, data float8_e4m3fn [N, K] contiguous with K a multiple of 128, scale fp32
    [ceil(N/128), K/128] contiguous."""
    if triton is None or x.dim() != 2 or data.dim() != 2 or scale.dim() != 2:
        return False
    n, k = data.shape
    return (_on_device(x) and x.device == data.device == scale.device and 1 <= x.shape[0] <= MAX_ROWS
            and x.shape[1] == k * (2 if swiglu else 1) and k % BLOCK == 0 and data.dtype == torch.float8_e4m3fn
            and scale.dtype == torch.float32 and tuple(scale.shape) == (-(-n // BLOCK), k // BLOCK)
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.is_contiguous() and data.is_contiguous() and scale.is_contiguous())


#: Tiles measured fastest on an H200 per (batch class, N, K) (``bench/fp8_gemv_probe.py --save-tiles``; the
#: file also records the date, GPU, versions and command).  Batch classes: "1", "16" (2-16 rows), "32", "64".
TILES_FILE = Path(__file__).with_name("fp8_tiles.json")


@functools.lru_cache(maxsize=1)
def tuned() -> dict:
    """{(batch class, N, K): launch config} from ``TILES_FILE`` (``gemv.read_tiles``: {} when absent)."""
    return read_tiles(TILES_FILE)


def valid_config(cfg: dict, B: int, K: int) -> bool:
    """Whether ``cfg`` can launch for B rows and input width K.  Both kernels read one scale row per program,
    so BLOCK_N must divide 128, and BLOCK_K (columns per iteration, default 128 for the dot kernel) must be a
    multiple of 128 that divides K; the row kernel serves one row only; the dot kernel takes BLOCK_B of 16, 32
    or 64 rows (programs over the batch cover any B) and BLOCK_N >= 16 (``tl.dot``'s smallest tile)."""
    bn, bk = cfg.get("BLOCK_N", 0), cfg.get("BLOCK_K", BLOCK)
    if not (0 < bn <= 128 and 128 % bn == 0 and bk >= BLOCK and bk % BLOCK == 0 and K % bk == 0):
        return False
    if "BLOCK_B" in cfg:
        return cfg["BLOCK_B"] in (16, 32, 64) and bn >= 16
    return B == 1 and "BLOCK_K" in cfg


def pick_config(B: int, N: int, K: int) -> dict:
    """Launch parameters for one shape: the measured tiles (``tuned``) when valid, else the pattern of the bf16
    kernels with the tile's bytes kept (``gemv.pick_config``).  At one row either the row kernel (BLOCK_N,
    BLOCK_K) or the dot kernel (BLOCK_B, BLOCK_N); above, the dot kernel; plus num_warps and num_stages.
    Fixed per shape (no run-time autotuning: the same weights give the same bits, restart after restart)."""
    cfg = tuned().get((batch_class(B), N, K))
    if cfg is not None and valid_config(cfg, B, K):
        return dict(cfg)
    if B == 1:
        bn, bk = (4, 2048) if N <= 4096 else (16, 512) if N >= 100_000 else (8, 512)
        while K % bk:
            bk //= 2
        return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3)
    bb = 16 if B <= 16 else 32 if B <= 32 else 64
    bn = 64 if N >= 20_000 and bb == 16 else 32
    return dict(BLOCK_B=bb, BLOCK_N=bn, num_warps=4, num_stages=3)


def gemv_fp8(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, out: Optional[torch.Tensor] = None,
             config: Optional[dict] = None, swiglu: bool = False) -> torch.Tensor:
    """y = x @ (data * scale)^T with the Triton kernels: x [B, K] (``swiglu``: [B, 2K] = [gate | up], y =
    (silu(gate) * up) @ w^T), data float8_e4m3fn [N, K], scale fp32 [ceil(N/128), K/128]; returns [B, N] in x's
    dtype, fp32 accumulation, into ``out`` when given.  ``config`` overrides ``pick_config`` (benchmarks).
    Raises ValueError when ``supports`` is false or ``config`` cannot launch (``valid_config``)."""
    if not supports(x, data, scale, swiglu):
        raise ValueError(f"gemv_fp8: unsupported operands x{tuple(x.shape)} {x.dtype} {x.device}, "
                         f"data{tuple(data.shape)} {data.dtype}, scale{tuple(scale.shape)} {scale.dtype} "
                         f"(swiglu={swiglu})")
    B = x.shape[0]
    N, K = data.shape
    if config is not None and not valid_config(config, B, K):
        raise ValueError(f"gemv_fp8: config {config} cannot launch for {B} rows and K={K}")
    cfg, out, even = gemv.launch_setup(x, N, config or pick_config(B, N, K), out)
    if "BLOCK_B" not in cfg:  # the row kernel (one row)
        grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
        _fp8_row_kernel[grid](x, data, scale, out, N, K, K // BLOCK, EVEN_N=even, SWIGLU=swiglu, **cfg)
    else:
        cfg.setdefault("BLOCK_K", BLOCK)
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(B, cfg["BLOCK_B"]))
        _fp8_dot_kernel[grid](x, data, scale, out, B, N, K, K // BLOCK, EVEN_N=even, SWIGLU=swiglu, **cfg)
    return out


def dequantize_supported(data: torch.Tensor, scale: torch.Tensor) -> bool:
    """True when ``dequantize`` runs: Triton, CUDA with compute capability >= 8.9 (or the interpreter), contiguous
    fp8 data and fp32 scales (elsewhere ``fp8.Fp8Weight.dequantize`` uses PyTorch)."""
    return (triton is not None and _on_device(data) and data.dim() == 2 and data.is_contiguous()
            and scale.is_contiguous() and data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32)


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data * scale (blocks of 128 x 128) as a new [N, K] tensor in ``dtype``, computed in fp32 and rounded once.
    Raises ValueError when ``dequantize_supported`` is false."""
    if not dequantize_supported(data, scale):
        raise ValueError(f"dequantize: unsupported operands data{tuple(data.shape)} {data.dtype} {data.device}, "
                         f"scale{tuple(scale.shape)} {scale.dtype}")
    N, K = data.shape
    out = torch.empty(N, K, device=data.device, dtype=dtype)
    kb = -(-K // BLOCK)
    _dequant_kernel[(-(-N // BLOCK), kb)](data, scale, out, N, K, kb)
    return out
