"""The Triton decode kernels on CPU under Triton's interpreter: the Gated DeltaNet decode kernel
(qwen_chat.engine.model.gdn), the FP8 GEMV and dequantisation kernels (qwen_chat.engine.model.fp8_gemv) and the
W4A16 ones (qwen_chat.engine.model.int4_gemv).

The checks run in one subprocess with ``TRITON_INTERPRET=1`` (tests/support/triton_checks.py), since the
variable must be set before the kernels are defined.  fp32 results must equal the reference ``glue.gdn_step``
to 1e-5 and the whole runner must match transformers to the CPU parity bound, 1e-4 (tests/engine/test_runner.py).
In bf16 the interpreter converts fp32 to bf16 by truncation rather than round-to-nearest (checked with a
one-line kernel, triton 3.6), so there the kernel's error against an fp32 reference is only bounded by 3x the
error of the bf16 reference; the exact bf16 comparison runs on CUDA (tests/gpu/test_runner_cuda.py).
"""
from __future__ import annotations


import pytest

pytest.importorskip("triton", reason="Triton is installed by deploy/install.sh --test")

from tests.support.interpreted import run_interpreted  # noqa: E402


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted("tests.support.triton_checks")


@pytest.mark.parametrize("case", ["fp32", "fp32_one_key_head"])
def test_kernel_equals_reference_step_in_fp32(results, case):
    r = results[case]
    assert r["conv_equal"], "conv rings differ"
    assert r["kernel_out"] <= 1e-5 and r["kernel_state"] <= 1e-5, r


def test_kernel_in_bf16_is_as_close_to_fp32_as_the_reference(results):
    r = results["bf16"]
    assert r["conv_equal"]
    assert 0 < r["ref_out"] and r["kernel_out"] <= 3 * r["ref_out"], r
    assert r["kernel_state"] <= 3 * r["ref_state"], r


def test_padding_rows_on_a_shared_slot_do_not_touch_live_rows(results):
    assert results["padding"] == dict(rows_equal=True, state_equal=True)


def test_runner_with_the_kernel_matches_transformers(results):
    r = results["runner"]
    assert r["impl"] == "triton (one kernel)"
    assert r["rows"] == 28
    assert r["max_rel_err"] <= 1e-4, r


def test_fp8_gemv_equals_the_dequantised_matmul(results):
    """The FP8 GEMV kernels (qwen_chat.engine.model.fp8_gemv) on 1 (both kernels), 3 and 20 rows, plain and
    SwiGLU input, a partial 128-row block: fp32 activations agree with x @ dequantised(w)^T to fp32 rounding; fp16 activations
    to the fp16 rounding of the output (2^-11 relative); the dequantisation kernel equals PyTorch's bit for bit."""
    r = dict(results["fp8_gemv"])
    assert r.pop("dequant_equal") is True
    assert len(r) == 20
    for case, err in r.items():
        assert err <= (1e-6 if case.startswith("float32") else 1e-3), (case, err)


def test_int4_gemv_equals_the_dequantised_matmul(results):
    """The W4A16 kernels (qwen_chat.engine.model.int4_gemv) on 1 (one and four groups per iteration), 3, 20 and 64
    rows and through ``fp8.linear`` on a strided input: fp32 activations agree with x @ dequantised(w)^T to fp32
    rounding; fp16 ones to the fp16 rounding of the dequantised tile and the output (2^-11 relative); the
    dequantisation kernel equals PyTorch's bit for bit."""
    r = dict(results["int4_gemv"])
    assert r.pop("dequant_equal") is True
    assert len(r) == 12
    for case, err in r.items():
        assert err <= (1e-6 if case.startswith("float32") else 1e-3), (case, err)
