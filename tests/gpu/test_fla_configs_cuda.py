"""fla's chunked delta rule on an H200 takes the tile configurations measured there (``model.fla_tuning``,
``fla_configs/NVIDIA_H200``) for the packed prefill's call, instead of autotuning.  Skipped without CUDA, without
fla, on other GPUs and on other fla / Triton versions (those autotune)."""
from __future__ import annotations

import importlib
import json

import pytest
import torch

from qwen_chat.engine.model.fla_tuning import CONFIG_ROOT, use_measured_configs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: Where fla 0.6.0 defines each kernel of its chunked gated delta rule.
KERNELS = {
    "chunk_local_cumsum_scalar_kernel": "fla.ops.utils.cumsum",
    "chunk_gated_delta_rule_fwd_kkt_solve_kernel": "fla.ops.gated_delta_rule.chunk_fwd",
    "recompute_w_u_fwd_kernel": "fla.ops.gated_delta_rule.wy_fast",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "fla.ops.common.chunk_delta_h",
    "chunk_fwd_kernel_o": "fla.ops.common.chunk_o",
}


def autotuner(kernel):
    """The ``triton.runtime.Autotuner`` inside ``kernel`` (fla wraps some in ``triton.heuristics`` too)."""
    while not hasattr(kernel, "cache") or not hasattr(kernel, "configs"):
        kernel = kernel.fn
    return kernel


def test_packed_prefill_call_takes_the_measured_configs():
    pytest.importorskip("fla")
    said = use_measured_configs(torch.device("cuda"))
    if "measured on" not in (said or ""):
        pytest.skip(said or "no fla")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    kernels = {name: autotuner(getattr(importlib.import_module(mod), name)) for name, mod in KERNELS.items()}
    for kernel in kernels.values():
        kernel.cache.clear()  # (earlier tests in this process may have autotuned them)
    gen = torch.Generator(device="cuda").manual_seed(0)
    T, H, D = 700, 32, 128  # the 9B's value heads and head size; two packed sequences of 300 and 400 tokens
    r = lambda *s, dtype=torch.bfloat16: torch.randn(*s, device="cuda", generator=gen).to(dtype)  # noqa: E731
    q, k = (torch.nn.functional.normalize(r(1, T, H, D).float(), dim=-1).bfloat16() for _ in range(2))
    g = -torch.rand(1, T, H, device="cuda", generator=gen)
    beta = torch.rand(1, T, H, device="cuda", generator=gen).bfloat16()
    cu = torch.tensor([0, 300, 700], device="cuda")
    out, final = chunk_gated_delta_rule(q, k, r(1, T, H, D), g=g, beta=beta,
                                        initial_state=torch.zeros(2, H, D, D, device="cuda"),
                                        output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu,
                                        cu_seqlens_cpu=cu.cpu())
    assert torch.isfinite(out).all() and final.shape == (2, H, D, D)
    for name, kernel in kernels.items():
        doc = json.loads((CONFIG_ROOT / "NVIDIA_H200" / f"{name}.json").read_text())
        measured = {json.dumps(e["autotune_key"]): e["config"] for e in doc["autotune_entries"].values()}
        assert kernel.cache, f"{name} was not called"
        for key, cfg in kernel.cache.items():
            want = next(c for k, c in measured.items() if len(json.loads(k)) == len(key))
            assert (cfg.kwargs, cfg.num_warps, cfg.num_stages) == (want["kwargs"], want["num_warps"],
                                                                    want["num_stages"]), name
