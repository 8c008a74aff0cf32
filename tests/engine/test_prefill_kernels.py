"""The prefill's fused kernels (qwen_chat.engine.model.prefill_kernels) on CPU under Triton's interpreter: each
kernel equals its transformers module in fp32, and a runner with the kernels gives the same logits and the same
conv and recurrent states as one without them over packed steps with short, continuing and kept chunks.

The checks run in one subprocess with ``TRITON_INTERPRET=1`` (tests/support/prefill_kernel_checks.py), since the
variable must be set before the kernels are defined.  bf16 roundings are compared on CUDA (tests/gpu), since
the interpreter truncates fp32 to bf16 instead of rounding.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is installed by deploy/install.sh --test")

from tests.support.interpreted import run_interpreted  # noqa: E402


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted("tests.support.prefill_kernel_checks")


@pytest.mark.parametrize("case", ["rms_norm_rows", "rms_norm_strided_heads", "gated_rms_norm", "swiglu"])
def test_kernel_equals_its_module_in_fp32(results, case):
    assert results["ops"][case] <= 1e-6, results["ops"]


def test_runner_with_fused_kernels_matches_the_unfused_runner(results):
    r = results["parity"]
    assert r["impl"] is True and r["steps"] == 3
    assert r["logits"] <= 1e-5 and r["conv_state"] <= 1e-5 and r["rec_state"] <= 1e-5, r
    assert r["last_vs_transformers"] <= 1e-4, r

