"""GPU-only checks of the runner's CUDA path: graph-captured decode (with and without the compiled glue)
against the reference transformers model in fp32, padded batches, and the sampler on CUDA.  Skipped without
CUDA.  Run on a GPU host: ``python -m pytest -q tests/gpu``.
"""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.requests import SamplingParams
from qwen_chat.engine.runner import ModelRunner
from qwen_chat.engine.sampling import Sampler
from tests.test_runner import TOL, LiveBatch, Seq, image_seq, rel_err, small_config, text_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fla_installed() -> bool:
    try:
        import fla  # noqa: F401
        return True
    except Exception:
        return False


# With fla-core installed, transformers' reference forward runs the chunked delta rule in fla's Triton kernels,
# whose fp32 dots use TF32: on 2026-11-30 (H200) the reference itself then differed from our exact fp32 decode
# recurrence by up to 2.0e-4 (prefill, also through fla, matched exactly).  Without fla the bound is issue 4's.
GPU_TOL = 1e-3 if _fla_installed() else TOL


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3_5ForConditionalGeneration

    # The reference's conv1d goes through cuDNN, which uses TF32 by default (~1e-4 relative error on its own).
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    m = Qwen3_5ForConditionalGeneration(small_config()).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0.0, 0.3)
    return m.to("cuda")


class CudaSeq(Seq):
    @torch.no_grad()
    def reference(self, model):
        ids = torch.tensor([self.ids], device="cuda")
        kw = {}
        if self.image is not None:
            kw = dict(pixel_values=self.image[0].cuda(), image_grid_thw=self.image[1].cuda(),
                      mm_token_type_ids=(ids == 300).long())
        return model(input_ids=ids, **kw).logits[0, -1]


@pytest.mark.parametrize("compile_glue", [False, True])
def test_graph_decode_matches_reference_with_joins_and_leaves(model, compile_glue):
    gen = torch.Generator().manual_seed(7)
    runner = ModelRunner(model, num_slots=4, max_context=1100, device="cuda", compile_glue=compile_glue)
    assert runner.use_cuda_graphs
    batch = LiveBatch(runner, model, gen)
    join, step, errs = batch.join, batch.step, batch.errs

    join(0, CudaSeq(text_ids(gen, 9)))
    step(4)
    img = image_seq(gen)
    join(2, CudaSeq(img.ids, img.image))
    join(3, CudaSeq(text_ids(gen, 520)))  # crosses into the 1024 context bucket
    step(6)  # batch of 3 runs padded to 4
    batch.leave(0)
    join(0, CudaSeq(text_ids(gen, 3)))
    step(5)
    assert len(runner._graphs) >= 2
    assert max(errs) <= GPU_TOL, max(errs)
    assert sorted(runner._prefill_graphs) == [128, 768]  # the joins above ran through prefill graphs


def test_graph_and_eager_decode_agree_in_bf16(model):
    gen = torch.Generator().manual_seed(8)
    m16 = model.to(torch.bfloat16)
    try:
        a = ModelRunner(m16, num_slots=2, max_context=256, device="cuda", use_cuda_graphs=True)
        b = ModelRunner(m16, num_slots=2, max_context=256, device="cuda", use_cuda_graphs=False)
        seqs = [Seq(text_ids(gen, 12)), Seq(text_ids(gen, 30))]
        for s, q in enumerate(seqs):
            a.prefill(s, q.prompt())
            b.prefill(s, q.prompt())
        for _ in range(8):
            toks = torch.randint(0, 290, (2,), generator=gen).cuda()
            assert rel_err(a.decode([0, 1], toks), b.decode([0, 1], toks)) < 2e-2
    finally:
        model.to(torch.float32)


def test_sampler_on_cuda_is_reproducible():
    logits = torch.randn(3, 1000, device="cuda")
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=1.0, seed=42, max_new_tokens=8,
                       stop_token_ids=())
    runs = []
    for _ in range(2):
        s = Sampler(3, 1000, "cuda")
        for slot in range(3):
            s.start(slot, p)
        runs.append([s.sample([0, 1, 2], logits) for _ in range(10)])
    assert runs[0] == runs[1]


def test_compiled_top_k_sampling_matches_the_general_path_on_cuda():
    """On CUDA the fused top-k path is ``torch.compile``d: it must draw what the general path draws."""
    gen = torch.Generator().manual_seed(3)
    p = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=5, max_new_tokens=8,
                        stop_token_ids=()),
         SamplingParams(temperature=0.0, top_p=1.0, top_k=20, presence_penalty=0.0, seed=6, max_new_tokens=8,
                        stop_token_ids=())]
    fused, general = Sampler(2, 248320, "cuda"), Sampler(2, 248320, "cuda")
    general._fused_k = 0
    for s in (fused, general):
        for slot, q in enumerate(p):
            s.start(slot, q)
    for n in (2, 1):  # a batch of two, then one row (another compiled shape)
        for _ in range(20):
            logits = (torch.randn(n, 248320, generator=gen) * 3).cuda()
            assert fused.sample(list(range(n)), logits) == general.sample(list(range(n)), logits)
