"""GPU checks of ``--kv-cache-dtype fp8``: the production decode (CUDA graphs, the compiled glue reading e4m3
through Inductor's Triton kernels) equals the eager one on the same FP8 cache, the prefill graphs write it as
the eager prefill does, and the logits stay near a bf16 cache's.  Skipped without CUDA, or on a GPU older than
``kv_quant.MIN_CUDA_CAPABILITY``.  Run on a GPU host: ``python -m pytest -q tests/gpu/test_kv_fp8_cuda.py``.
"""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.model import kv_quant
from qwen_chat.engine.model.options import RunnerOptions
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PrefillItem
from tests.support.small_model import Seq, rel_err, small_model, text_ids

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < kv_quant.MIN_CUDA_CAPABILITY,
    reason="needs a CUDA GPU of compute capability 8.9 or newer")


@pytest.fixture(scope="module")
def m16():
    return small_model().to("cuda", torch.bfloat16)


def run(model, options, kv_dtype, prompts, steps, gen_seed=5):
    """Logits of ``prompts`` (slots 0..) prefilled, then ``steps`` decode steps feeding seeded tokens."""
    gen = torch.Generator().manual_seed(gen_seed)
    r = ModelRunner(model, num_slots=len(prompts), max_context=512, device="cuda", options=options,
                    kv_dtype=kv_dtype)
    if r.options.prefill_graphs:
        r.capture_prefill()
    rows = [torch.stack([r.prefill(s, p) for s, p in enumerate(prompts)])]
    for _ in range(steps):
        toks = torch.randint(0, 290, (len(prompts),), generator=gen).cuda()
        rows.append(r.decode(list(range(len(prompts))), toks))
    return torch.cat(rows), r


def test_graphs_and_compiled_glue_on_an_fp8_cache_equal_the_eager_path(m16):
    gen = torch.Generator().manual_seed(3)
    prompts = [Seq(text_ids(gen, 40)).prompt(), Seq(text_ids(gen, 200)).prompt()]
    fast, r = run(m16, RunnerOptions(), kv_quant.FP8, prompts, 12)
    eager, _ = run(m16, RunnerOptions(cuda_graphs=False, compile_glue=False, fast_gemv=False, gdn_kernel=False,
                                      prefill_graphs=False), kv_quant.FP8, prompts, 12)
    assert next(iter(r.k_cache.values())).dtype == kv_quant.FP8
    assert rel_err(fast, eager) < 2e-2


def test_an_fp8_cache_stays_near_a_bf16_cache_and_chunks_agree(m16):
    gen = torch.Generator().manual_seed(4)
    prompts = [Seq(text_ids(gen, 300)).prompt()]
    fp8, _ = run(m16, RunnerOptions(), kv_quant.FP8, prompts, 8)
    bf16, _ = run(m16, RunnerOptions(), None, prompts, 8)
    assert rel_err(fp8, bf16) < 6e-2
    parts = ModelRunner(m16, num_slots=1, max_context=512, device="cuda", kv_dtype=kv_quant.FP8)
    assert parts.prefill_batch([PrefillItem(0, prompts[0], start=0, end=130)]) is None
    last = parts.prefill_batch([PrefillItem(0, prompts[0], start=130)])[0]
    assert rel_err(last, fp8[0]) < 2e-2
