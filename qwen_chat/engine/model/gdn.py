"""One Triton kernel for the whole Gated DeltaNet decode token: causal conv1d + SiLU, q/k l2-norm, gates, the
delta-rule state update, the readout and the gated RMSNorm.

Compiled by Inductor, the same maths (``glue.gdn_step``) becomes about eight kernels per layer, and at 16
rows its state update took about three times what the fp32 state it moves needs (measured:
docs/performance.md, "One kernel for the Gated DeltaNet decode token").  Here one program owns one
(row, value head): it computes the conv outputs of that head's value channels and of its key head's q and k
channels, updates the [dv, dk] fp32 state in registers in one read and one write, and writes the normed,
gated output.

The conv state is a ring of K entries per channel (``conv_buf[slot, c, p % K]`` holds the input at position p),
so no program overwrites an input another one still reads: the token at position t reads positions
t-K+1..t-1 and writes position t, whose ring entry held position t-K.  Several value heads share a key head
(``rep`` of them); the first one writes that key head's q/k entries.

Formulas: transformers ``models/qwen3_5/modeling_qwen3_5.py`` (Qwen3_5GatedDeltaNet,
torch_recurrent_gated_delta_rule, l2norm, Qwen3_5RMSNormGated); the reference in this package is
``glue.gdn_step``, which this kernel is compared with (tests/engine/test_triton_kernels.py under Triton's
interpreter on CPU, tests/gpu on CUDA).  Roundings to the model dtype are where the reference has them.
"""
from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU hosts use glue.gdn_step.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the host
    triton = None


if triton is not None:

    @triton.jit
    def _conv_silu(x_row, conv_row, w_ptr, ch, t, own, K: tl.constexpr):
        """SiLU(causal conv) of channels ``ch`` at position t, rounded to the input dtype and returned as fp32;
        stores this input into the ring when ``own``."""
        x = tl.load(x_row + ch)
        acc = tl.load(w_ptr + ch * K + (K - 1)).to(tl.float32) * x.to(tl.float32)
        for j in tl.static_range(K - 1):
            col = ((t - (K - 1) + j) % K + K) % K
            prev = tl.load(conv_row + ch * K + col)
            acc += tl.load(w_ptr + ch * K + j).to(tl.float32) * prev.to(tl.float32)
        tl.store(conv_row + ch * K + t % K, x.to(conv_row.dtype.element_ty), mask=own & (ch >= 0))
        y = acc * tl.sigmoid(acc)
        return y.to(x_row.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _gdn_decode_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, s_qkv, s_z, s_b, s_a,
                           conv_ptr, rec_ptr, slot_ptr, pos_ptr, convw_ptr, alog_ptr, dtb_ptr, normw_ptr, out_ptr,
                           C, KEY_DIM, HV, q_scale, norm_eps,
                           K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, REP: tl.constexpr):
        row = tl.program_id(0)
        hv = tl.program_id(1)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        t = tl.load(pos_ptr + row).to(tl.int64)
        offs_k = tl.arange(0, DK)
        offs_v = tl.arange(0, DV)
        # Every load that does not depend on the conv is issued first, the state's 64 KiB above all, so its
        # latency overlaps the conv and the q/k norms (the kernel is latency-bound at one row).
        s_ptrs = rec_ptr + (slot * HV + hv) * (DV * DK) + offs_v[:, None] * DK + offs_k[None, :]
        S = tl.load(s_ptrs)                                            # [DV, DK] fp32, value-major S^T
        zz = tl.load(z_ptr + row * s_z + hv * DV + offs_v).to(tl.float32)
        w = tl.load(normw_ptr + offs_v)
        bb = tl.load(b_ptr + row * s_b + hv).to(tl.float32)
        ga = tl.load(a_ptr + row * s_a + hv).to(tl.float32) + tl.load(dtb_ptr + hv).to(tl.float32)
        a_log = tl.load(alog_ptr + hv).to(tl.float32)
        hk = hv // REP
        own_qk = (hv % REP) == 0
        x_row = qkv_ptr + row * s_qkv
        conv_row = conv_ptr + slot * C * K
        q = _conv_silu(x_row, conv_row, convw_ptr, hk * DK + offs_k, t, own_qk, K)
        k = _conv_silu(x_row, conv_row, convw_ptr, KEY_DIM + hk * DK + offs_k, t, own_qk, K)
        v = _conv_silu(x_row, conv_row, convw_ptr, 2 * KEY_DIM + hv * DV + offs_v, t, hv >= 0, K)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        beta = tl.sigmoid(bb).to(b_ptr.dtype.element_ty).to(tl.float32)
        softplus = tl.where(ga > 20.0, ga, tl.log(1.0 + tl.exp(ga)))
        S = S * tl.exp(-tl.exp(a_log) * softplus)
        kv = tl.sum(S * k[None, :], axis=1)                            # [DV]
        delta = (v - kv) * beta
        S = S + delta[:, None] * k[None, :]
        o = tl.sum(S * q[None, :], axis=1)
        tl.store(s_ptrs, S)
        # Qwen3_5RMSNormGated: weight * (o / rms(o)) in the input dtype, times silu(z) in fp32.
        dt = out_ptr.dtype.element_ty
        o = o.to(dt).to(tl.float32)
        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + norm_eps)
        o = (w.to(tl.float32) * o.to(dt).to(tl.float32)).to(w.dtype).to(tl.float32)
        tl.store(out_ptr + row * (HV * DV) + hv * DV + offs_v, (o * (zz * tl.sigmoid(zz))).to(dt))


def supports(conv_buf: torch.Tensor, rec_buf: torch.Tensor, dk: int, dv: int, activation: str) -> bool:
    """True when ``gdn_decode`` runs on this layer's state: Triton importable, CUDA tensors (or Triton's
    interpreter, ``TRITON_INTERPRET=1``), SiLU activation, dk and dv powers of two, a ring conv state
    [slots, C, K] and value-major fp32 recurrent state [slots, HV, dv, dk], both contiguous."""
    on_device = conv_buf.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (triton is not None and on_device and activation == "silu"
            and dk > 0 and dv > 0 and dk & (dk - 1) == 0 and dv & (dv - 1) == 0
            and conv_buf.dim() == 3 and conv_buf.is_contiguous() and rec_buf.dim() == 4
            and rec_buf.is_contiguous() and rec_buf.dtype == torch.float32 and tuple(rec_buf.shape[2:]) == (dv, dk))


def gdn_decode(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_buf: torch.Tensor,
               rec_buf: torch.Tensor, slot_idx: torch.Tensor, pos: torch.Tensor, conv_w: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
               key_dim: int, dk: int, dv: int, num_warps: int | None = None) -> torch.Tensor:
    """One Gated DeltaNet decode token per row in one kernel; same arguments and result as
    ``glue.gdn_step`` (which documents the maths), with the gated norm given as ``norm_weight`` [dv] and
    ``norm_eps`` and the activation fixed to SiLU.

    qkv [B, C], z [B, value_dim], b/a [B, HV]: rows may be strided views (last dim contiguous); conv_buf
    [slots, C, K] ring (model dtype); rec_buf [slots, HV, dv, dk] fp32; slot_idx, pos int64 [B] (position of
    this token in its sequence); conv_w [C, K]; A_log, dt_bias [HV].  Returns [B, value_dim] in qkv's dtype
    (``num_warps`` overrides the launch's warp count, for benchmarks).  Updates
    conv_buf and rec_buf of the rows' slots in place; rows that share a slot (graph padding rows on the scratch
    slot) leave that slot's state undefined.
    Raises ValueError when ``supports`` is false or the shapes disagree.
    """
    if not supports(conv_buf, rec_buf, dk, dv, "silu") or qkv.dim() != 2 or qkv.stride(-1) != 1:
        raise ValueError(f"gdn_decode: unsupported operands qkv{tuple(qkv.shape)} {qkv.device}, conv "
                         f"{tuple(conv_buf.shape)}, state {tuple(rec_buf.shape)} {rec_buf.dtype}, dk={dk}, dv={dv}")
    B, C = qkv.shape
    HV = b.shape[-1]
    K = conv_buf.shape[-1]
    nk = key_dim // dk
    if (conv_buf.shape[1] != C or C != 2 * key_dim + HV * dv or rec_buf.shape[1] != HV or HV % nk
            or tuple(conv_w.shape) != (C, K) or z.shape != (B, HV * dv) or a.shape != (B, HV)
            or slot_idx.numel() != B or pos.numel() != B or norm_weight.numel() != dv):
        raise ValueError(f"gdn_decode: shapes disagree: qkv{tuple(qkv.shape)} z{tuple(z.shape)} "
                         f"b{tuple(b.shape)} a{tuple(a.shape)} conv{tuple(conv_buf.shape)} "
                         f"w{tuple(conv_w.shape)} state{tuple(rec_buf.shape)} key_dim={key_dim}")
    if any(t.stride(-1) != 1 for t in (z, b, a)):
        raise ValueError("gdn_decode: z, b and a need a contiguous last dimension")
    conv_w = conv_w.contiguous()  # a view of conv1d.weight [C, 1, K]: already contiguous, no copy
    out = torch.empty(B, HV * dv, device=qkv.device, dtype=qkv.dtype)
    # 4 warps: fastest at 1, 4 and 16 rows on an H200 (bench/gdn_probe.py; measured: docs/performance.md)
    warps = num_warps or (4 if dk * dv >= 2048 else 1)
    _gdn_decode_kernel[(B, HV)](
        qkv, z, b, a, qkv.stride(0), z.stride(0), b.stride(0), a.stride(0),
        conv_buf, rec_buf, slot_idx, pos, conv_w, A_log, dt_bias, norm_weight, out,
        C, key_dim, HV, dk ** -0.5, float(norm_eps),
        K=K, DK=dk, DV=dv, REP=HV // nk, num_warps=warps)
    return out
