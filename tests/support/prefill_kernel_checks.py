"""Checks of the prefill's fused kernels (qwen_chat.engine.model.prefill_kernels) on CPU under Triton's
interpreter, run by tests/engine/test_prefill_kernels.py in a subprocess with ``TRITON_INTERPRET=1`` (the
variable must be set before the kernels are defined).

``python -m tests.support.prefill_kernel_checks`` prints one JSON object: per check, the measured errors the test
asserts on.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from qwen_chat.engine.model import prefill_kernels as pk
from tests.support.small_model import rel_err


def check_ops(seed=0, device="cpu", dtype=torch.float32) -> dict:
    """Each kernel against its transformers module (fp32) on the layouts the forward gives it: hidden rows,
    per-head query rows that are a strided view (the query half of the gated q projection), gate and up as the
    two halves of one fused GEMM output, odd row counts and a feature count that is not a power of two.
    Inputs drawn on the CPU, then moved to ``device`` in ``dtype`` with the modules."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    on = lambda *ts: [t.to(device, dtype) for t in ts]  # noqa: E731
    norm = Qwen3_5RMSNorm(96, eps=1e-6)
    norm.weight.data = 0.3 * torch.randn(96, generator=gen)
    x, = on(torch.randn(3, 5, 96, generator=gen) * 4)
    norm.to(device, dtype)
    out["rms_norm_rows"] = rel_err(pk.rms_norm(x, norm.weight, norm.eps), norm(x))
    head = Qwen3_5RMSNorm(32, eps=1e-6)
    head.weight.data = 0.3 * torch.randn(32, generator=gen)
    qg, = on(torch.randn(1, 7, 4, 64, generator=gen))
    head.to(device, dtype)
    q = torch.chunk(qg, 2, dim=-1)[0]          # [1, T, heads, 32], rows 64 apart
    out["rms_norm_strided_heads"] = rel_err(pk.rms_norm(q, head.weight, head.eps), head(q))
    gated = Qwen3_5RMSNormGated(16, eps=1e-6)
    gated.weight.data = 1 + 0.3 * torch.randn(16, generator=gen)
    o, z = on(torch.randn(11, 16, generator=gen), torch.randn(11, 40, generator=gen))
    z = z[:, 3:19]   # a strided view
    gated.to(device, dtype)
    out["gated_rms_norm"] = rel_err(pk.gated_rms_norm(o, z, gated.weight, gated.variance_epsilon), gated(o, z))
    gu, = on(torch.randn(1, 9, 2 * 1300, generator=gen))
    gate, up = gu.split(1300, dim=-1)
    out["swiglu"] = rel_err(pk.swiglu(gate, up), F.silu(gate) * up)
    return out


def check_prefill_parity(seed=5, device="cpu", dtype=torch.float32) -> dict:
    """The small fp32 Qwen3.5 (tests/support/small_model.py) through two runners, fused kernels on and off, over
    the same packed steps: a 2-token prompt (shorter than the conv), a chunk that keeps its state at an inner
    position, a 1-token chunk continuing its slot, new prompts beside continuing ones.  Returns the worst
    relative error of the logits and of the conv and recurrent states between the two, and of the last
    chunk's logits against transformers' forward over the whole prompt, and whether its argmax agrees.  The
    model in ``dtype`` on ``device``."""
    from qwen_chat.engine.model.options import RunnerOptions
    from qwen_chat.engine.model.runner import ModelRunner
    from qwen_chat.engine.types import PrefillItem, PreparedPrompt
    from tests.support.small_model import small_model, text_ids

    model = small_model().to(device, dtype)
    gen = torch.Generator().manual_seed(seed)
    runners = [ModelRunner(model, num_slots=5, max_context=96, device=device,
                           options=RunnerOptions(prefill_kernels=on)) for on in (True, False)]
    p = [PreparedPrompt(input_ids=torch.tensor(text_ids(gen, n))) for n in (2, 19, 7, 3)]
    steps = [[PrefillItem(0, p[0]), PrefillItem(1, p[1], end=12, keeps=((10, 4),))],
             [PrefillItem(1, p[1], start=12, end=13), PrefillItem(2, p[2])],
             [PrefillItem(1, p[1], start=13), PrefillItem(3, p[3])]]
    out = dict(logits=0.0, conv_state=0.0, rec_state=0.0, steps=0, impl=runners[0].impl["prefill_fused_kernels"])
    last = None
    for step in steps:
        got = [r.prefill_batch(step) for r in runners]
        if got[0] is not None:
            out["logits"] = max(out["logits"], rel_err(got[0], got[1]))
            last = got[0]
        for name in ("conv_state", "rec_state"):
            for a, b in zip(getattr(runners[0], name).values(), getattr(runners[1], name).values()):
                out[name] = max(out[name], rel_err(a[:5], b[:5]))
        out["steps"] += 1
    with torch.no_grad():
        ref = model(input_ids=p[1].input_ids[None].to(device)).logits[0, -1]
    out["last_vs_transformers"] = rel_err(last[0], ref)
    out["argmax_agrees"] = int(last[0].argmax()) == int(ref.argmax())
    return out


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    with torch.no_grad():
        print(json.dumps(dict(ops=check_ops(), parity=check_prefill_parity())))


if __name__ == "__main__":
    main()
