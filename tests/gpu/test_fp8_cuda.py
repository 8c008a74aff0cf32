"""GPU checks of FP8 weights and of exact fp32 (skipped without CUDA).

- The FP8 GEMV kernels (qwen_chat.engine.model.fp8_gemv) on the 9B's decode shapes, 1 to 64 rows, plain and
  SwiGLU input, against x @ dequantised(w)^T in fp32: no worse than cuBLAS on the dequantised bf16 weight; the
  dequantisation kernel equals PyTorch's.
- A small model (widths the kernels serve) with ``--quantize fp8``: graph-captured decode through the FP8 GEMV
  against transformers on the dequantised weights, fp32 activations, within 1e-4.
- The full published config in fp32 (random weights; needs about 45 GB): the engine against transformers'
  exact fp32 (``loading.torch_reference_kernels``) within 1e-4, text and image prompt, prefill and decode; this
  is what TF32 (fla's ``tl.dot``, cuDNN's default) used to break by about 0.4%.
Run: ``python -m pytest -q tests/gpu/test_fp8_cuda.py`` on a GPU host.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from qwen_chat.engine.checkpoints.fp8_loading import quantize_model
from qwen_chat.engine.checkpoints.loading import torch_reference_kernels
from qwen_chat.engine.model import fp8, fp8_gemv
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PreparedPrompt
from tests.support.small_model import TOL, rel_err, small_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: Every kernel of one row: the row kernel, the dot kernel with 128 and 256 columns per iteration.
ONE_ROW_OTHERS = (dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=3),
                  dict(BLOCK_B=16, BLOCK_N=32, num_warps=4, num_stages=3),
                  dict(BLOCK_B=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3))
SHAPES = ((12288, 4096), (10240, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (200, 256))


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33, 64])
def test_fp8_gemv_matches_the_dequantised_matmul(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for N, K in SHAPES:
        w = fp8.quantize_blocks(torch.randn(N, K, device="cuda", generator=gen) * 0.02)
        deq = w.dequantize(torch.float32)
        assert torch.equal(fp8_gemv.dequantize(w.data, w.scale, torch.float32),
                           fp8.Fp8Weight(w.data.cpu(), w.scale.cpu()).dequantize(torch.float32).cuda())
        for swiglu in (False, True):
            x = torch.randn(rows, 2 * K if swiglu else K, device="cuda", generator=gen).to(torch.bfloat16)
            xin = x
            if swiglu:
                g, u = x.float().split(K, dim=-1)
                xin = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
            assert fp8_gemv.supports(x, w.data, w.scale, swiglu)
            ours = fp8.linear(x, w, fast=True, swiglu=swiglu)
            ref = xin.float() @ deq.T
            cublas = torch.nn.functional.linear(xin, deq.to(torch.bfloat16)).float()
            err, err_cublas = (ours.float() - ref).abs().max().item(), (cublas - ref).abs().max().item()
            assert ours.shape == (rows, N) and ours.dtype == torch.bfloat16
            assert err <= 2 * err_cublas + 1e-3, (N, K, swiglu, err, err_cublas)
            for other in (ONE_ROW_OTHERS if rows == 1 else ()):  # pick_config's measured tiles choose one of them
                y = fp8_gemv.gemv_fp8(x, w.data, w.scale, swiglu=swiglu, config=other)
                assert (y.float() - ref).abs().max().item() <= 2 * err_cublas + 1e-3, (N, K, swiglu, other)


def _kernel_sized_model():
    from transformers import Qwen3_5ForConditionalGeneration

    cfg = small_config()
    tc = cfg.text_config
    tc.hidden_size, tc.intermediate_size, tc.head_dim = 256, 512, 64
    tc.linear_key_head_dim, tc.linear_value_head_dim = 64, 64
    tc.rope_parameters["mrope_section"] = [4, 2, 2]
    cfg.vision_config.out_hidden_size = 256
    torch.manual_seed(1)
    return Qwen3_5ForConditionalGeneration(cfg).eval().to("cuda")


def test_fp8_graph_decode_matches_transformers_on_the_dequantised_weights():
    from tests.support.small_model import LiveBatch, Seq, text_ids

    class CudaSeq(Seq):
        @torch.no_grad()
        def reference(self, model):
            return model(input_ids=torch.tensor([self.ids], device="cuda")).logits[0, -1]

    model = _kernel_sized_model()
    reference = copy.deepcopy(model)
    names = quantize_model(model)
    with torch.no_grad():
        for name in names:
            reference.get_submodule(name).weight.copy_(model.get_submodule(name).fp8_weight().dequantize())
    with torch_reference_kernels():
        runner = ModelRunner(model, num_slots=4, max_context=512, device="cuda")
        assert runner.use_cuda_graphs and "fp8" in runner.impl["projections"]
        gen = torch.Generator().manual_seed(5)
        batch = LiveBatch(runner, reference, gen)
        batch.join(0, CudaSeq(text_ids(gen, 9)))
        batch.step(4)                          # one row: the row kernels, the SwiGLU in the down projection
        batch.join(1, CudaSeq(text_ids(gen, 30)))
        batch.join(2, CudaSeq(text_ids(gen, 3)))
        batch.step(4)                          # three rows padded to four: the dot kernels
        assert max(batch.errs) <= TOL, max(batch.errs)


def _full_config():
    from transformers import Qwen3_5Config

    raw = json.loads((Path(__file__).resolve().parents[2] / "bench" / "qwen3_5_9b_config.json").read_text())
    return Qwen3_5Config(**raw)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 60 * 2**30,
                    reason="needs a GPU with >= 60 GB for the full config in fp32")
def test_engine_fp32_equals_exact_transformers_fp32_at_full_size():
    from transformers import Qwen3_5ForConditionalGeneration

    config = _full_config()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(0)
    vc = config.vision_config
    patches = 224 // vc.patch_size
    n_img = patches * patches // vc.spatial_merge_size ** 2
    image_ids = torch.cat([torch.randint(0, 240000, (10,), generator=gen), torch.tensor([config.vision_start_token_id]),
                           torch.full((n_img,), config.image_token_id), torch.tensor([config.vision_end_token_id]),
                           torch.randint(0, 240000, (10,), generator=gen)])
    prompts = [PreparedPrompt(input_ids=torch.randint(0, 240000, (64,), generator=gen)),
               PreparedPrompt(input_ids=image_ids, image_grid_thw=torch.tensor([[1, patches, patches]]),
                              pixel_values=torch.randn(patches * patches, 3 * vc.temporal_patch_size * vc.patch_size ** 2,
                                                       generator=gen),
                              mm_token_type_ids=(image_ids == config.image_token_id).long())]
    runner = ModelRunner(model, num_slots=2, max_context=512, device="cuda")
    errs = []
    with torch_reference_kernels(), torch.no_grad():
        for slot, p in enumerate(prompts):
            ids, extra = p.input_ids.tolist(), []
            logits = runner.prefill(slot, p)
            for step in range(4):
                kw = {}
                if p.pixel_values is not None:
                    mm = torch.cat([p.mm_token_type_ids, torch.zeros(len(extra), dtype=torch.long)])
                    kw = dict(pixel_values=p.pixel_values.cuda(), image_grid_thw=p.image_grid_thw.cuda(),
                              mm_token_type_ids=mm[None].cuda())
                ref = model(input_ids=torch.tensor([ids + extra], device="cuda"), **kw).logits[0, -1].float()
                errs.append(rel_err(logits, ref))
                extra.append(int(ref.argmax()))
                logits = runner.decode([slot], torch.tensor([extra[-1]], device="cuda"))[0]
    assert max(errs) <= 1e-4, errs
