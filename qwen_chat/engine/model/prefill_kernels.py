"""Fused element-wise kernels of the packed prefill: the RMSNorms, the SwiGLU, and the Gated DeltaNet's causal
conv with its SiLU and the q/k l2-norm, each one Triton kernel instead of a chain of PyTorch ops.

Why: a packed prefill step of 4,096 tokens on an H200 spent about 72 ms in its GEMMs and about 90 ms in
element-wise work, dtype copies and layout changes between them (torch profiler, ``bench/prefill_bench.py``,
measured: docs/performance.md).  Each op of those chains reads and writes the whole [T, width] activation, most
in fp32; fused, each chain reads its inputs once and writes its output once.

Every kernel rounds where the reference rounds, so outputs differ from it only by the order of fp32 sums:
- ``rms_norm``: transformers ``Qwen3_5RMSNorm`` (fp32 ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, then the
  input dtype).
- ``gated_rms_norm``: ``Qwen3_5RMSNormGated`` (the normed rows rounded to the input dtype, times the weight in
  the weight's dtype, times ``silu(z)`` in fp32).
- ``swiglu``: ``Qwen3_5MLP``'s ``act_fn(gate) * up`` with SiLU (each op rounded to the input dtype).
- ``conv_silu_l2``: ``Qwen3_5GatedDeltaNet``'s depthwise causal conv1d (no bias) over each chunk continuing
  from its slot's conv ring, SiLU, and ``l2norm`` (fp32, eps 1e-6) of each q and k head
  (``forward.ModelForward.gdn_inputs``); the ring itself is written by ``forward`` as before.
The references live where they always did (the modules, ``forward``); tests compare each kernel with them under
Triton's interpreter on CPU (tests/engine/test_prefill_kernels.py) and on CUDA (tests/gpu).
"""
from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU hosts run the references.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the host
    triton = None

#: fp32 eps of the Gated DeltaNet's q/k l2-norm (transformers ``qwen3_5.l2norm``; ``glue.l2norm``)
L2_EPS = 1e-6


if triton is not None:

    # Row and token counts change with every step: not specialised on (a new divisibility by 16 would compile
    # another variant of the kernel in the middle of serving; the start-up warm-up compiles the one there is).
    @triton.jit(do_not_specialize=["R"])
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, R, D, stride_x, stride_y, eps,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        m = (rows < R)[:, None] & (cols < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * (1.0 + w)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["R"])
    def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, R, D, stride_o, stride_z, eps,
                               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        m = (rows < R)[:, None] & (cols < D)[None, :]
        dt = y_ptr.dtype.element_ty
        o = tl.load(o_ptr + rows[:, None] * stride_o + cols[None, :], mask=m, other=0.0).to(dt).to(tl.float32)
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        o = (o * tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)[:, None]).to(dt).to(tl.float32)
        o = (w.to(tl.float32)[None, :] * o).to(w.dtype).to(tl.float32)
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], (o * (z * tl.sigmoid(z))).to(dt), mask=m)

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        dt = y_ptr.dtype.element_ty
        g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
        a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(y_ptr + row * N + cols, (a * u).to(dt), mask=m)

    @triton.jit(do_not_specialize=["T"])
    def _conv_silu_l2_kernel(x_ptr, ring_ptr, w_ptr, y_ptr, tok_chunk, tok_pos, chunk_slot, chunk_start,
                             chunk_past, T, C, stride_x, QK, eps, K: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tm = t < T
        j = tl.load(tok_chunk + t, mask=tm, other=0)
        p = tl.load(tok_pos + t, mask=tm, other=0)
        slot = tl.load(chunk_slot + j, mask=tm, other=0).to(tl.int64)
        start = tl.load(chunk_start + j, mask=tm, other=0)
        past = tl.load(chunk_past + j, mask=tm, other=0) != 0
        rdt = ring_ptr.dtype.element_ty
        wdt = w_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(K):
            back = K - 1 - k                      # this tap reads the input `back` positions earlier
            own = (p >= back) & tm                # ... inside the chunk
            xa = tl.load(x_ptr + (t - back).to(tl.int64)[:, None] * stride_x + c[None, :],
                         mask=own[:, None], other=0.0).to(rdt)
            col = (start + p - back + K) % K      # ... or before it: the slot's ring holds position q at q % K
            old = (p < back) & past & tm
            xr = tl.load(ring_ptr + slot[:, None] * C * K + c[None, :] * K + col[:, None],
                         mask=old[:, None], other=0.0)
            x = tl.where(own[:, None], xa, xr).to(wdt).to(tl.float32)
            w = tl.load(w_ptr + c * K + k).to(tl.float32)
            acc += x * w[None, :]
        y = acc.to(wdt).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(wdt).to(y_ptr.dtype.element_ty)
        # q and k heads (the first QK channels; one head per program): x / sqrt(sum(x^2) + eps) in fp32
        yf = y.to(tl.float32)
        scale = tl.rsqrt(tl.sum(yf * yf, axis=1) + eps)
        qk = tl.program_id(1) * BLOCK_C < QK
        y = tl.where(qk, (yf * scale[:, None]).to(y_ptr.dtype.element_ty), y)
        tl.store(y_ptr + t.to(tl.int64)[:, None] * C + c[None, :], y, mask=tm[:, None])


def available(device: torch.device) -> bool:
    """True when the kernels can run for tensors on ``device``: Triton importable and CUDA, or Triton's
    interpreter (``TRITON_INTERPRET=1``) on CPU."""
    on_device = device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return triton is not None and on_device


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as a 2-D [R, D] view with a contiguous last dim (a copy only when no such view exists)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1]).contiguous()


def _row_blocks(D: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a row-wise norm over D features: about 2,048 elements per program."""
    block_d = triton.next_power_of_2(D)
    block_r = max(1, 2048 // block_d)
    return block_r, block_d, 8 if block_d >= 4096 else 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3_5RMSNorm`` of x [..., D] (any float dtype; rows may be a strided view) with its weight [D] (the
    offset from 1, as the checkpoint stores it).  Returns a new contiguous tensor of x's shape and dtype.
    Raises ValueError when the weight does not have D elements."""
    D = x.shape[-1]
    if weight.numel() != D:
        raise ValueError(f"rms_norm: weight has {weight.numel()} elements for rows of {D}")
    x2 = _rows(x)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    R = x2.shape[0]
    br, bd, warps = _row_blocks(D)
    _rms_norm_kernel[(triton.cdiv(R, br),)](x2, weight, y, R, D, x2.stride(0), D, float(eps),
                                            BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
    return y


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3_5RMSNormGated`` of o [R, D] gated by z [R, D] (SiLU), weight [D].  Returns [R, D] in o's dtype.
    Raises ValueError when the shapes disagree."""
    if o.dim() != 2 or z.shape != o.shape or weight.numel() != o.shape[1]:
        raise ValueError(f"gated_rms_norm: o{tuple(o.shape)} z{tuple(z.shape)} weight{tuple(weight.shape)}")
    o2, z2 = _rows(o), _rows(z)
    R, D = o2.shape
    y = torch.empty(R, D, device=o.device, dtype=o.dtype)
    br, bd, warps = _row_blocks(D)
    _gated_rms_norm_kernel[(triton.cdiv(R, br),)](o2, z2, weight, y, R, D, o2.stride(0), z2.stride(0), float(eps),
                                                  BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
    return y


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., N] (rows may be strided views, as the halves of one fused gate/up
    GEMM).  Returns a new contiguous tensor of gate's shape and dtype.  Raises ValueError on a shape mismatch."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate{tuple(gate.shape)} and up{tuple(up.shape)} differ")
    g2, u2 = _rows(gate), _rows(up)
    R, N = g2.shape
    y = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    BLOCK = 1024
    _swiglu_kernel[(R, triton.cdiv(N, BLOCK))](g2, u2, y, N, g2.stride(0), u2.stride(0), BLOCK=BLOCK, num_warps=4)
    return y


def conv_fits(C: int, key_dim: int, dk: int, conv: torch.nn.Conv1d, activation: str) -> bool:
    """Whether ``conv_silu_l2`` computes this Gated DeltaNet layer: SiLU, a depthwise conv without bias, dk a
    power of two dividing the key dim and the C channels (each program owns one head of channels)."""
    return (activation == "silu" and conv.bias is None and dk > 0 and dk & (dk - 1) == 0
            and key_dim % dk == 0 and C % dk == 0 and conv.weight.dim() == 3 and conv.weight.shape[:2] == (C, 1)
            and conv.weight.numel() == C * conv.weight.shape[2])


def conv_silu_l2(qkv: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor, meta: dict, key_dim: int,
                 dk: int) -> torch.Tensor:
    """The Gated DeltaNet's mixed q/k/v of packed prompt chunks: causal depthwise conv (each chunk after its
    slot's last K - 1 inputs from the ring, zeros for a new prompt), SiLU, and the l2-norm of each of the first
    2 * key_dim channels' heads of dk (q and k).

    qkv: [T, C] in_proj_qkv output (rows may be strided); ring: [slots, C, K] (``ring[s, c, p % K]`` is the
    input at position p; read only); weight: [C, 1, K] depthwise taps; meta (``prefill_meta.pack``):
    ``tok_chunk``, ``tok_pos`` int64 [T] (each token's chunk and its index in it), ``slots``, ``chunk_start``
    int64 [N], ``past`` bool [N].  Returns [T, C] contiguous in qkv's dtype.  Needs ``conv_fits``."""
    T, C = qkv.shape
    K = ring.shape[-1]
    x = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    y = torch.empty(T, C, device=qkv.device, dtype=qkv.dtype)
    BLOCK_T = 16
    _conv_silu_l2_kernel[(triton.cdiv(T, BLOCK_T), C // dk)](
        x, ring, weight.view(C, K), y, meta["tok_chunk"], meta["tok_pos"], meta["slots"], meta["chunk_start"],
        meta["past"], T, C, x.stride(0), 2 * key_dim, L2_EPS, K=K, BLOCK_T=BLOCK_T, BLOCK_C=dk, num_warps=4)
    return y


def write_rings(ring: torch.Tensor, qkv: torch.Tensor, meta: dict) -> None:
    """After ``conv_silu_l2``: store each chunk's last K inputs into its slot's ring and the K inputs before each
    keep point into that keep's row, as ``forward.ModelForward._conv_prefill`` does from its laid-out input
    (the same values).  ring: [slots, C, K], written in place; qkv: [T, C]; meta: ``prefill_meta.pack``'s
    ``slots``, ``past``, ``prev_cols``, ``ring_cols``, ``ring_idx``, ``keep_rows``, ``keep_cols``, ``keep_idx``."""
    T, C = qkv.shape
    K = ring.shape[-1]
    slots = meta["slots"]
    N = slots.shape[0]
    prev = ring[slots[:, None], :, meta["prev_cols"]]                             # [N, K - 1, C]
    prev = torch.where(meta["past"][:, None, None], prev, 0.0).reshape(-1, C)

    def inputs(idx: torch.Tensor) -> torch.Tensor:  # rows of [T packed tokens, then N (K - 1) earlier inputs]
        own = qkv.index_select(0, idx.clamp(max=T - 1)).to(ring.dtype)
        return torch.where((idx < T)[:, None], own, prev.index_select(0, (idx - T).clamp(min=0)))

    ring[slots[:, None], :, meta["ring_cols"]] = inputs(meta["ring_idx"]).view(N, K, C)
    if meta["keep_rows"].numel():
        ring[meta["keep_rows"][:, None], :, meta["keep_cols"]] = inputs(meta["keep_idx"]).view(-1, K, C)


class PrefillOps:
    """The prefill's norms and SwiGLU: through the fused kernels when ``enabled`` and the module is one they
    compute (transformers' ``Qwen3_5RMSNorm`` / ``Qwen3_5RMSNormGated`` / SiLU, with no hooks, whose weight is
    whole: not a ZeRO-3 partition), else the module itself.  Same arguments and results as the modules.

    enabled: ``RunnerOptions.prefill_kernels`` (resolved); silu_mlp: the MLP's activation is SiLU."""

    def __init__(self, enabled: bool, silu_mlp: bool) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

        self.enabled, self._silu_mlp = enabled, silu_mlp
        self._norm_type, self._gated_type = Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    @staticmethod
    def _plain(module, features: int) -> bool:
        w = getattr(module, "weight", None)
        return (w is not None and w.numel() == features and not module._forward_hooks
                and not module._forward_pre_hooks)

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` for a ``Qwen3_5RMSNorm`` over x [..., D]."""
        if self.enabled and type(module) is self._norm_type and self._plain(module, x.shape[-1]):
            return rms_norm(x, module.weight, module.eps)
        return module(x)

    def gated_norm(self, module, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``module(o, z)`` for a ``Qwen3_5RMSNormGated`` over o, z [R, D]."""
        if (self.enabled and type(module) is self._gated_type and module.activation == "silu"
                and self._plain(module, o.shape[-1])):
            return gated_rms_norm(o, z, module.weight, module.variance_epsilon)
        return module(o, z)

    def swiglu(self, act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` (the MLP's middle; ``act`` its ``act_fn``)."""
        if self.enabled and self._silu_mlp and gate.shape == up.shape:
            return swiglu(gate, up)
        return act(gate) * up
