"""GPU checks of 4-bit weights (skipped without CUDA).

- The W4A16 GEMV kernels (qwen_chat.engine.model.int4_gemv) on the 9B's decode shapes, 1 to 64 rows, bf16
  activations, against x @ dequantised(w)^T in fp32: no worse than cuBLAS on the dequantised bf16 weight; the
  dequantisation kernel equals PyTorch's bit for bit.
- A small model (widths the kernels serve) with ``--quantize int4``: graph-captured decode through the 4-bit
  GEMV against transformers on the dequantised weights, fp32 activations, within 1e-4.
Run: ``python -m pytest -q tests/gpu/test_int4_cuda.py`` on a GPU host.
"""
from __future__ import annotations

import copy

import pytest
import torch

from qwen_chat.engine.checkpoints.int4_loading import quantize_model
from qwen_chat.engine.checkpoints.loading import torch_reference_kernels
from qwen_chat.engine.model import fp8, int4, int4_gemv
from qwen_chat.engine.model.runner import ModelRunner
from tests.support.small_model import TOL, small_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = ((12288, 4096), (10240, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (200, 256))
#: Other launch configs of one row (the row kernel with more groups per iteration, and the dot kernel).
ONE_ROW_OTHERS = (dict(BLOCK_N=32, R=4, num_warps=8, num_stages=3), dict(BLOCK_B=16, BLOCK_N=32, num_warps=4,
                                                                        num_stages=3))


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33, 64])
def test_int4_gemv_matches_the_dequantised_matmul(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for N, K in SHAPES:
        w = int4.quantize_groups(torch.randn(N, K, device="cuda", generator=gen) * 0.02)
        deq = w.dequantize(torch.float32)
        cpu = int4.Int4Weight(w.packed.cpu(), w.scale.cpu(), w.zero.cpu())
        assert torch.equal(int4_gemv.dequantize(w.packed, w.scale, w.zero, torch.float32), cpu.dequantize().cuda())
        x = torch.randn(rows, K, device="cuda", generator=gen).to(torch.bfloat16)
        assert int4_gemv.supports(x, w.packed, w.scale, w.zero)
        ours = fp8.linear(x, w, fast=True)
        ref = x.float() @ w.dequantize(torch.bfloat16).float().T
        cublas = torch.nn.functional.linear(x, deq.to(torch.bfloat16)).float()
        err, err_cublas = (ours.float() - ref).abs().max().item(), (cublas - ref).abs().max().item()
        assert ours.shape == (rows, N) and ours.dtype == torch.bfloat16
        assert err <= 2 * err_cublas + 1e-3, (N, K, err, err_cublas)
        for other in (ONE_ROW_OTHERS if rows == 1 else ()):
            if int4_gemv.valid_config(other, rows, K):
                y = int4_gemv.gemv_int4(x, w.packed, w.scale, w.zero, config=other)
                assert (y.float() - ref).abs().max().item() <= 2 * err_cublas + 1e-3, (N, K, other)


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


def test_int4_graph_decode_matches_transformers_on_the_dequantised_weights():
    from tests.support.small_model import LiveBatch, Seq, text_ids

    class CudaSeq(Seq):
        @torch.no_grad()
        def reference(self, model):
            return model(input_ids=torch.tensor([self.ids], device="cuda")).logits[0, -1]

    model = _kernel_sized_model()
    reference = copy.deepcopy(model)
    names = quantize_model(model)
    assert len(names) == 2 * (3 * 6 + 7)  # every decoder projection but in_proj_a / in_proj_b
    with torch.no_grad():
        for name in names:
            reference.get_submodule(name).weight.copy_(model.get_submodule(name).int4_weight().dequantize())
    with torch_reference_kernels():
        runner = ModelRunner(model, num_slots=4, max_context=512, device="cuda")
        assert runner.use_cuda_graphs and "int4 <= 64" in runner.impl["projections"]
        gen = torch.Generator().manual_seed(5)
        batch = LiveBatch(runner, reference, gen)
        batch.join(0, CudaSeq(text_ids(gen, 9)))
        batch.step(4)                          # one row: the row kernel
        batch.join(1, CudaSeq(text_ids(gen, 30)))
        batch.join(2, CudaSeq(text_ids(gen, 3)))
        batch.step(4)                          # three rows padded to four: the dot kernel
        assert max(batch.errs) <= TOL, max(batch.errs)
