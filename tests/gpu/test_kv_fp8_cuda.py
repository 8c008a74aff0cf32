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


def test_copied_blocks_and_a_verify_step_on_an_fp8_cache(m16):
    """The conversation cache's block copies index e4m3 tensors and their scales on the device, and the verify
    step writes its k + 1 positions through the FP8 cache (its eager write): both run on CUDA."""
    from qwen_chat.engine.model import spec_step
    from qwen_chat.engine.model.sampling import Sampler

    gen = torch.Generator().manual_seed(6)
    r = ModelRunner(m16, num_slots=2, max_context=512, device="cuda", kv_dtype=kv_quant.FP8)
    r.prefill(0, Seq(text_ids(gen, 100)).prompt())
    held = list(r.tables.blocks(0))
    dst = next(b for b in range(r.num_blocks) if b not in held)
    r.copy_blocks([(held[0], dst)])
    for i, cache in r.k_cache.items():
        assert torch.equal(cache[dst].view(torch.uint8), cache[held[0]].view(torch.uint8))
        assert torch.equal(r.k_scale[i][dst], r.k_scale[i][held[0]]) and r.k_scale[i][dst].abs().sum() > 0
    spec = spec_step.attach(r, None, k=2, max_batch=2)
    seconds = spec.step_time(Sampler(2, r.vocab_size, "cuda"), 2, given=True, steps=2, warmup=1)
    assert 0 < seconds < 10
