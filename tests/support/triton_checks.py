"""Checks of the Triton decode kernels on CPU under Triton's interpreter, run by tests/engine/test_triton_kernels.py in a
subprocess with ``TRITON_INTERPRET=1`` (the variable must be set before the kernels are defined): the Gated
DeltaNet decode kernel (``gdn``), the FP8 GEMV and dequantisation kernels (``fp8_gemv``) and the 4-bit ones
(``int4_gemv``).

``python -m tests.support.triton_checks`` prints one JSON object: for each check, the measured errors that the test
asserts on.
"""
from __future__ import annotations

import json
import os

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

from qwen_chat.engine.model import fp8, fp8_gemv, gdn, glue, int4, int4_gemv
from tests.support.small_model import rel_err


def _layer(gen, dtype, nk, rep, dk, dv, K=4):
    """Random Gated DeltaNet layer parameters: (conv_w [C, K], A_log, dt_bias [HV], gated norm)."""
    HV, key_dim = nk * rep, nk * dk
    C = 2 * key_dim + HV * dv
    conv_w = (torch.randn(C, K, generator=gen) * 0.5).to(dtype)
    A_log = torch.randn(HV, generator=gen).to(dtype)
    dt_bias = torch.randn(HV, generator=gen).to(dtype)
    norm = Qwen3_5RMSNormGated(dv, eps=1e-6).to(dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(dv, generator=gen)).to(dtype)
    return conv_w, A_log, dt_bias, norm


def _projections(gen, dtype, B, C, HV, dv, device="cpu"):
    """qkv, z, b, a as strided views into one fused projection output (as the runner's fused GEMV gives)."""
    proj = torch.randn(B, C + HV * dv + 2 * HV + 5, generator=gen).to(device, dtype)
    return proj.split([C, HV * dv, HV, HV, 5], dim=-1)[:4]


def check_against_reference(dtype, B=3, nk=2, rep=2, dk=16, dv=16, slots=6, steps=6, seed=0,
                            device="cpu") -> dict:
    """Run ``gdn.gdn_decode`` and ``glue.gdn_step`` side by side for ``steps`` tokens on the same slots
    (random states, positions starting below and above K), and the reference once more in fp32 from the
    upcast inputs.  Returns the worst relative errors of output and state of the kernel and of the reference
    in ``dtype`` against fp32, and whether the conv rings stayed equal.  ``device``: where the three run
    (inputs are drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    HV, key_dim = nk * rep, nk * dk
    C = 2 * key_dim + HV * dv
    conv_w, A_log, dt_bias, norm = (t.to(device) for t in _layer(gen, dtype, nk, rep, dk, dv))
    norm32 = Qwen3_5RMSNormGated(dv, eps=1e-6).to(device)
    norm32.weight.data = norm.weight.data.float()
    conv0 = torch.randn(slots, C, 4, generator=gen).to(device, dtype)
    rec0 = (torch.randn(slots, HV, dv, dk, generator=gen) * 0.1).to(device)
    ck, rk, cr, rr = conv0.clone(), rec0.clone(), conv0.clone(), rec0.clone()
    c32, r32 = conv0.float(), rec0.clone()
    slot_idx = torch.randperm(slots, generator=gen)[:B].to(device)
    pos = (torch.arange(B) * 7 % 11).to(device)
    out = dict(kernel_out=0.0, kernel_state=0.0, ref_out=0.0, ref_state=0.0, conv_equal=True)
    for _ in range(steps):
        qkv, z, b, a = _projections(gen, dtype, B, C, HV, dv, device)
        ours = gdn.gdn_decode(qkv, z, b, a, ck, rk, slot_idx, pos, conv_w, A_log, dt_bias, norm.weight,
                              norm.variance_epsilon, key_dim, dk, dv)
        ref = glue.gdn_step(qkv, z, b, a, cr, rr, slot_idx, pos, conv_w, A_log, dt_bias, norm, "silu",
                               key_dim, dk, dv)
        f32 = glue.gdn_step(qkv.float(), z.float(), b.float(), a.float(), c32, r32, slot_idx, pos,
                               conv_w.float(), A_log.float(), dt_bias.float(), norm32, "silu", key_dim, dk, dv)
        assert ours.shape == (B, HV * dv) and ours.dtype == dtype
        out["kernel_out"] = max(out["kernel_out"], rel_err(ours, f32))
        out["ref_out"] = max(out["ref_out"], rel_err(ref, f32))
        out["kernel_state"] = max(out["kernel_state"], rel_err(rk, r32))
        out["ref_state"] = max(out["ref_state"], rel_err(rr, r32))
        out["conv_equal"] = out["conv_equal"] and torch.equal(ck, cr)
        pos = pos + 1
    return out


def check_padding_rows(seed=1) -> dict:
    """Two live rows plus two padding rows on one shared scratch slot (as graph padding does) against the two
    live rows alone: the live rows' outputs and their slots' state must be equal."""
    gen = torch.Generator().manual_seed(seed)
    nk, rep, dk, dv = 2, 2, 16, 16
    HV, key_dim = nk * rep, nk * dk
    C = 2 * key_dim + HV * dv
    conv_w, A_log, dt_bias, norm = _layer(gen, torch.float32, nk, rep, dk, dv)
    conv0, rec0 = torch.randn(5, C, 4, generator=gen), torch.randn(5, HV, dv, dk, generator=gen) * 0.1
    qkv, z, b, a = _projections(gen, torch.float32, 4, C, HV, dv)
    args = (conv_w, A_log, dt_bias, norm.weight, 1e-6, key_dim, dk, dv)
    c1, r1 = conv0.clone(), rec0.clone()
    padded = gdn.gdn_decode(qkv, z, b, a, c1, r1, torch.tensor([1, 3, 4, 4]), torch.tensor([6, 2, 0, 0]),
                            *args)
    c2, r2 = conv0.clone(), rec0.clone()
    alone = gdn.gdn_decode(qkv[:2], z[:2], b[:2], a[:2], c2, r2, torch.tensor([1, 3]), torch.tensor([6, 2]),
                           *args)
    live = [0, 1, 2, 3]
    return dict(rows_equal=torch.equal(padded[:2], alone),
                state_equal=torch.equal(r1[live], r2[live]) and torch.equal(c1[live], c2[live]))


def check_runner_parity(seed=7) -> dict:
    """The small fp32 Qwen3.5 of tests/support/small_model.py through the runner with
    ``RunnerOptions(gdn_kernel=True)``: sequences of different lengths (one with an image) join, decode together
    and leave; every logits row is compared with the reference transformers forward.  Returns the worst relative
    error and the runner's impl entry."""
    from qwen_chat.engine.model.options import RunnerOptions
    from qwen_chat.engine.model.runner import ModelRunner
    from tests.support.small_model import LiveBatch, Seq, image_seq, small_model, text_ids

    model = small_model()
    gen = torch.Generator().manual_seed(seed)
    runner = ModelRunner(model, num_slots=3, max_context=96, device="cpu", options=RunnerOptions(gdn_kernel=True))
    batch = LiveBatch(runner, model, gen)
    batch.join(0, Seq(text_ids(gen, 2)))   # shorter than the conv kernel
    batch.step(3)
    batch.join(2, Seq(text_ids(gen, 19)))
    batch.step(3)
    batch.join(1, image_seq(gen))
    batch.step(2)
    batch.leave(0)
    batch.join(0, Seq(text_ids(gen, 5)))   # a reused slot
    batch.step(3)
    return dict(max_rel_err=max(batch.errs), rows=len(batch.errs), impl=runner.impl["gdn_decode"])


#: The other launches of one row: the dot kernel (16 padded rows, 32 features per program: a partial tile at
#: N = 200) with one and two scale blocks per iteration.
ONE_ROW_VARIANTS = {"dot": dict(BLOCK_B=16, BLOCK_N=32, num_warps=4, num_stages=3),
                    "dot_k256": dict(BLOCK_B=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)}


def check_fp8_gemv(seed=11) -> dict:
    """The FP8 GEMV kernels (one row: ``_fp8_row_kernel`` and ``_fp8_dot_kernel`` with 128 and 256 columns per iteration; 3 and 20 rows: ``_fp8_dot_kernel`` with 16- and 32-row
    tiles) against x @ dequantised(w)^T in fp64, for fp32 and fp16 activations, a plain and a SwiGLU input, N = 200
    (a partial tile and a partial 128-row block) and K = 256, with blocks of very different scales; and the
    dequantisation kernel against ``Fp8Weight.dequantize`` on PyTorch (N = 200, K = 200: partial blocks both ways).
    Returns {case: worst relative error} plus ``dequant_equal``; every case must have run through a kernel."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(200, 256, generator=gen) * torch.logspace(-3, 1, 4).repeat_interleave(64)[None, :]
    q = fp8.quantize_blocks(w)
    ref_w = q.dequantize(torch.float64)
    out = {}
    for dtype in (torch.float32, torch.float16):
        for rows in (1, 3, 20):
            for swiglu in (False, True):
                x = torch.randn(rows, 512 if swiglu else 256, generator=gen).to(dtype)
                assert fp8_gemv.supports(x, q.data, q.scale, swiglu)
                y = fp8_gemv.gemv_fp8(x, q.data, q.scale, swiglu=swiglu)
                xin = x.double()
                if swiglu:
                    g, u = x.float().chunk(2, dim=-1)
                    xin = (torch.nn.functional.silu(g) * u).to(dtype).double()
                out[f"{str(dtype)[6:]}_rows{rows}{'_swiglu' if swiglu else ''}"] = rel_err(y, xin @ ref_w.t())
                for name, cfg in (ONE_ROW_VARIANTS.items() if rows == 1 else ()):  # the measured tiles may pick them
                    y = fp8_gemv.gemv_fp8(x, q.data, q.scale, swiglu=swiglu, config=cfg)
                    out[f"{str(dtype)[6:]}_rows1_{name}{'_swiglu' if swiglu else ''}"] = rel_err(y, xin @ ref_w.t())
    d = fp8.quantize_blocks(torch.randn(200, 200, generator=gen))
    out["dequant_equal"] = torch.equal(fp8_gemv.dequantize(d.data, d.scale, torch.float32),
                                       fp8.Fp8Weight(d.data, d.scale).dequantize(torch.float32))
    return out


def check_int4_gemv(seed=12) -> dict:
    """The W4A16 kernels (one row: ``_int4_row_kernel`` with 1 and 4 groups per iteration; 3 and 20 rows:
    ``_int4_split_kernel``; 64 rows: ``_int4_dot_kernel``) against x @ dequantised(w)^T in fp64 for fp32 and fp16 activations, N = 200 (a partial
    tile) and K = 384 (three groups), with groups of very different ranges and asymmetric zero points; through
    ``fp8.linear`` too (the dispatch the model uses), on a strided input; and the dequantisation kernel against
    PyTorch's, bit for bit.  Returns {case: relative error} plus ``dequant_equal``."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(200, 384, generator=gen) * torch.logspace(-2, 1, 3).repeat_interleave(128)[None, :]
    q = int4.quantize_groups(w)
    q4 = int4.quantize_groups(torch.randn(40, 512, generator=gen))  # four groups in one row-kernel iteration
    out = {}
    for dtype in (torch.float32, torch.float16):
        ref_w = q.dequantize(dtype).double()
        for B in (1, 3, 20, 64):
            x = torch.randn(B, 384, generator=gen).to(dtype)
            assert int4_gemv.supports(x, q.packed, q.scale, q.zero)
            out[f"{str(dtype)[6:]}_rows{B}"] = rel_err(int4_gemv.gemv_int4(x, q.packed, q.scale, q.zero),
                                                       x.double() @ ref_w.t())
        x = torch.randn(1, 512, generator=gen).to(dtype)
        y = int4_gemv.gemv_int4(x, q4.packed, q4.scale, q4.zero, config=dict(BLOCK_N=32, R=4))
        out[f"{str(dtype)[6:]}_rows1_four_groups"] = rel_err(y, x.double() @ q4.dequantize(dtype).double().t())
        wide = torch.randn(4, 2 * 384, generator=gen).to(dtype)[:, ::2]  # a strided view, as a split output is
        out[f"{str(dtype)[6:]}_linear"] = rel_err(fp8.linear(wide, q, fast=True), wide.double() @ ref_w.t())
    out["dequant_equal"] = torch.equal(int4_gemv.dequantize(q.packed, q.scale, q.zero, torch.float32),
                                       q.dequantize(torch.float32))
    return out


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(json.dumps(dict(
        fp32=check_against_reference(torch.float32),
        fp32_one_key_head=check_against_reference(torch.float32, B=2, nk=1, rep=1, dk=32, dv=16, seed=3),
        bf16=check_against_reference(torch.bfloat16, B=4, dk=16, dv=32, seed=2),
        padding=check_padding_rows(),
        runner=check_runner_parity(),
        fp8_gemv=check_fp8_gemv(), int4_gemv=check_int4_gemv())))


if __name__ == "__main__":
    main()
