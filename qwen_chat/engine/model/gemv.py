"""Decode-time projections (skinny GEMMs) as Triton kernels: y[B, N] = x[B, K] @ W[N, K]^T for B <= 16.

A batch-1 decode step is bound by reading the weights once (~15.9 GB per step for the 9B text model and LM
head: docs/facts.md, "Per-token cost (batch 1 decode, bf16)").  cuBLAS picks split-K kernels plus a separate
reduction kernel for several of the decode shapes and reads some of them well below the copy bandwidth
(measured: docs/performance.md).  These kernels stream each weight row block once, without split-K, with fp32
accumulation:

- ``B == 1``: each program owns ``BLOCK_N`` output features and walks K in ``BLOCK_K`` tiles, multiplying the
  tile by the broadcast input row and reducing across K on the CUDA cores;
- ``2 <= B <= 16``: the input rows are padded to 16 in registers and each tile goes through ``tl.dot``
  (tensor cores), so the weight traffic is the same as for one row.

``linear(x, w)`` dispatches: the Triton kernel on CUDA when it applies (``supports``), else ``F.linear``.
Tile sizes are fixed per shape by ``pick_config`` (no run-time autotuning, so the same weights always give the
same bits, restart after restart).  Compared against ``F.linear`` on the GPU in ``tests/gpu``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of PyTorch; CPU hosts (CI) use F.linear.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the host
    triton = None

#: Largest batch served by the Triton kernels (tl.dot pads the rows to 16).
MAX_ROWS = 16


if triton is not None:

    @triton.jit
    def load_input(x_ptrs, K, mask, SWIGLU: tl.constexpr):
        """Input tile as fp32: x, or with SWIGLU silu(gate) * up from [gate | up] rows of width 2K, rounded to
        the input dtype once (as the compiled glue's ``act(gate) * up`` is).  Shared with the FP8 kernels
        (``fp8_gemv``)."""
        if SWIGLU:
            g = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(x_ptrs + K, mask=mask, other=0.0).to(tl.float32)
            v = g * tl.sigmoid(g) * u
            return v.to(x_ptrs.dtype.element_ty).to(tl.float32)
        return tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def load_weight_tile(w_ptrs, offs_n, N, EVEN_N: tl.constexpr):
        """A weight tile [BLOCK_N, BLOCK_K] streamed once (evict first); rows >= N read as zeros unless EVEN_N.
        Shared with the FP8 kernels."""
        if EVEN_N:
            return tl.load(w_ptrs, eviction_policy="evict_first")
        return tl.load(w_ptrs, mask=offs_n[:, None] < N, other=0.0, eviction_policy="evict_first")

    @triton.jit
    def row_tile(w_ptr, x_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The one-row kernels' first tile of program ``program_id(0)``: (offs_n, offs_k, weight pointers
        [BLOCK_N, BLOCK_K], input pointers [BLOCK_K]).  Shared with the FP8 kernels."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        return offs_n, offs_k, w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], x_ptr + offs_k

    @triton.jit
    def store_row(y_ptr, offs_n, y, N, EVEN_N: tl.constexpr):
        """Store one output row's features ``offs_n`` (masked at N unless EVEN_N).  Shared with the FP8 kernels."""
        if EVEN_N:
            tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)

    @triton.jit
    def _gemv_row_kernel(x_ptr, w_ptr, y_ptr, N, K,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                         SWIGLU: tl.constexpr):
        offs_n, offs_k, w_ptrs, x_ptrs = row_tile(w_ptr, x_ptr, K, BLOCK_N, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            w = load_weight_tile(w_ptrs, offs_n, N, EVEN_N)
            x = load_input(x_ptrs, K, offs_k < BLOCK_K, SWIGLU)
            acc += w.to(tl.float32) * x[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        store_row(y_ptr, offs_n, tl.sum(acc, axis=1), N, EVEN_N)

    @triton.jit
    def _gemv_dot_kernel(x_ptr, w_ptr, y_ptr, B, N, K,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                         SWIGLU: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_b = tl.arange(0, 16)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        x_stride = 2 * K if SWIGLU else K
        x_ptrs = x_ptr + offs_b[:, None] * x_stride + offs_k[None, :]
        b_mask = offs_b[:, None] < B
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            w = load_weight_tile(w_ptrs, offs_n, N, EVEN_N)
            x = load_input(x_ptrs, K, b_mask, SWIGLU).to(w.dtype)
            acc = tl.dot(x, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = y_ptr + offs_b[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=b_mask & (offs_n[None, :] < N))


def supports(x: torch.Tensor, w: torch.Tensor, swiglu: bool = False) -> bool:
    """True when ``gemv(x, w, swiglu=swiglu)`` runs: CUDA, Triton importable, x [B, K] (with ``swiglu``
    [B, 2K]) with 1 <= B <= MAX_ROWS, both contiguous, same dtype (bf16 or fp16), K a multiple of 128."""
    k = w.shape[1] * (2 if swiglu else 1) if w.dim() == 2 else -1
    return (triton is not None and x.is_cuda and w.is_cuda and x.dim() == 2 and w.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == k and w.shape[1] % 128 == 0
            and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.is_contiguous() and w.is_contiguous())


#: Tile sizes measured fastest on an H200 for the decode shapes of the full config: (kernel, N, K) ->
#: (BLOCK_N, BLOCK_K, num_warps, num_stages).  Swept by bench/gemv_probe.py ("dot" entries: the best at B = 4
#: and 8; measured: docs/performance.md, raw: bench/results/*-NVIDIA-H200-gemv-probe-run1.json).
TUNED = {
    ("row", 12352, 4096): (16, 256, 4, 3), ("row", 10240, 4096): (8, 256, 4, 3),
    ("row", 4096, 4096): (4, 1024, 8, 3), ("row", 24576, 4096): (4, 1024, 4, 3),
    ("row", 4096, 12288): (8, 512, 8, 3), ("row", 248320, 4096): (16, 256, 4, 3),
    ("dot", 12352, 4096): (32, 256, 4, 3), ("dot", 10240, 4096): (32, 256, 4, 3),
    ("dot", 4096, 4096): (32, 256, 4, 5), ("dot", 24576, 4096): (64, 128, 4, 3),
    ("dot", 4096, 12288): (32, 256, 4, 5), ("dot", 248320, 4096): (128, 128, 4, 3),
    # tensor parallel over 2 GPUs, per rank (swept by bench/tp_probe.py: rows at B = 1, "dot" at B = 4;
    # raw: bench/results/*-NVIDIA-H200x2-tp-probe-run1.json)
    ("row", 6176, 4096): (4, 1024, 4, 3), ("row", 5120, 4096): (4, 512, 4, 3),
    ("row", 4096, 2048): (4, 512, 4, 3), ("row", 12288, 4096): (16, 256, 4, 3),
    ("row", 4096, 6144): (4, 512, 4, 3), ("row", 124160, 4096): (8, 256, 4, 3),
    ("dot", 6176, 4096): (32, 128, 4, 5), ("dot", 5120, 4096): (64, 256, 4, 5),
    ("dot", 4096, 2048): (32, 128, 4, 5), ("dot", 12288, 4096): (32, 256, 4, 3),
    ("dot", 4096, 6144): (32, 256, 4, 5), ("dot", 124160, 4096): (64, 128, 4, 3),
}


def pick_config(B: int, N: int, K: int) -> dict:
    """Tile sizes and launch parameters for one shape: BLOCK_N, BLOCK_K, num_warps, num_stages (``TUNED``
    where measured, else the pattern those measurements show); they only affect speed, never the result's
    shape.  BLOCK_K always divides K (K is a multiple of 128, ``supports``)."""
    kind = "row" if B == 1 else "dot"
    if (kind, N, K) in TUNED:
        bn, bk, nw, ns = TUNED[(kind, N, K)]
    elif kind == "row":
        bn, bk, nw, ns = (16, 256, 4, 3) if N >= 100_000 else (4, 1024, 8, 3) if N <= 4096 else (8, 256, 4, 3)
    else:
        bn, bk, nw, ns = ((128, 128, 4, 3) if N >= 100_000 else (64, 128, 4, 3) if N >= 20_000
                          else (32, 256, 4, 5))
    while K % bk:
        bk //= 2
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)


def launch_setup(x: torch.Tensor, n: int, config: dict,
                 out: Optional[torch.Tensor]) -> tuple[dict, torch.Tensor, bool]:
    """(launch config, output [B, n] in x's dtype (``out`` or a new one), whether BLOCK_N divides n) for a
    GEMV launch; shared with ``fp8_gemv``."""
    if out is None:
        out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    return dict(config), out, n % config["BLOCK_N"] == 0


def gemv(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None,
         config: Optional[dict] = None, swiglu: bool = False) -> torch.Tensor:
    """y = x @ w.T with the Triton kernel.  x: [B, K], w: [N, K] (same dtype, contiguous, ``supports``);
    returns [B, N] in x's dtype (fp32 accumulation).  With ``swiglu``, x is [B, 2K] = [gate | up] (the MLP's
    fused gate/up output) and y = (silu(gate) * up) @ w.T, the SwiGLU computed as the kernel loads its input
    (Qwen3_5MLP with ``hidden_act`` silu; saves the separate element-wise kernel).  ``config`` overrides
    ``pick_config`` (benchmarks).  Raises ValueError when ``supports(x, w, swiglu)`` is false."""
    if not supports(x, w, swiglu):
        raise ValueError(f"gemv: unsupported operands x{tuple(x.shape)} {x.dtype} {x.device}, "
                         f"w{tuple(w.shape)} {w.dtype} (swiglu={swiglu})")
    B = x.shape[0]
    N, K = w.shape
    cfg, out, even = launch_setup(x, N, config or pick_config(B, N, K), out)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
    if B == 1:
        _gemv_row_kernel[grid](x, w, out, N, K, EVEN_N=even, SWIGLU=swiglu, **cfg)
    else:
        _gemv_dot_kernel[grid](x, w, out, B, N, K, EVEN_N=even, SWIGLU=swiglu, **cfg)
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias) for x [..., K], through ``gemv`` when it applies to the flattened rows."""
    x2 = x.reshape(-1, x.shape[-1])
    if supports(x2, w):
        return gemv(x2, w).reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


def read_tiles(path: Path) -> dict:
    """{(batch class, N, K): launch config} from a tiles file written by a probe (``bench/fp8_gemv_probe.py``,
    ``bench/int4_gemv_probe.py`` with ``--save-tiles``: ``{"tiles": {"<class>:<N>:<K>": {...}}}``); {} when it
    is absent or unreadable (tiles only affect speed: the kernels' default pattern applies then)."""
    try:
        tiles = {}
        for key, cfg in json.loads(Path(path).read_text())["tiles"].items():
            c, n, k = key.split(":")
            tiles[(c, int(n), int(k))] = dict(cfg)
        return tiles
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def batch_class(B: int) -> str:
    """The tiles files' batch class of B rows: "1", "16" (2-16), "32" (17-32) or "64" (33-64)."""
    return "1" if B == 1 else "16" if B <= 16 else "32" if B <= 32 else "64"
