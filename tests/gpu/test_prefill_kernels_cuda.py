"""The prefill's fused kernels (qwen_chat.engine.model.prefill_kernels) on CUDA: each kernel against its
transformers module in fp32 and in bf16 (where the interpreter on CPU cannot check the roundings), and a runner
with the kernels against one without them and against transformers.  Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.support.prefill_kernel_checks import check_ops, check_prefill_parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def no_tf32():
    held = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = held


def test_kernels_equal_their_modules_in_fp32_on_cuda():
    got = check_ops(device="cuda", dtype=torch.float32)
    assert max(got.values()) <= 1e-6, got


def test_kernels_round_as_their_modules_in_bf16():
    """The same roundings as the modules: only the order of fp32 sums differs, so at most one bf16 step
    (2^-8 of the largest value) apart."""
    got = check_ops(device="cuda", dtype=torch.bfloat16)
    assert max(got.values()) <= 2 ** -8, got


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_runner_with_fused_kernels_matches_the_unfused_runner_on_cuda(dtype, bound):
    r = check_prefill_parity(device="cuda", dtype=dtype)
    assert r["impl"] is True and r["steps"] == 3
    assert r["logits"] <= bound and r["conv_state"] <= bound and r["rec_state"] <= bound, r
    assert r["last_vs_transformers"] <= (1e-3 if dtype == torch.float32 else 6e-2), r
    if dtype == torch.float32:  # (bf16 logits of a random model have near ties)
        assert r["argmax_agrees"], r
