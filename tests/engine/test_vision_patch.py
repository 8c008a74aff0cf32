"""The vision tower's patch embedding run as a GEMM (qwen_chat.engine.model.vision_patch) equals transformers'
Conv3d, for the embedding alone and for the image features of the whole tower, in fp32 on CPU."""
from __future__ import annotations

import copy

import torch

from qwen_chat.engine.model.vision_patch import patch_embed_as_gemm
from tests.support.small_model import small_model


def test_patch_embedding_as_a_gemm_equals_the_convolution():
    ref = small_model()
    ours = copy.deepcopy(ref)
    assert patch_embed_as_gemm(ours) == 1  # the one Qwen3_5VisionPatchEmbed; nothing else has a strided Conv3d
    gen = torch.Generator().manual_seed(3)
    for grid in ((1, 4, 6), (1, 8, 8), (1, 2, 14)):  # three image sizes (patches 24, 64, 28)
        t, h, w = grid
        pv = torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=gen)
        thw = torch.tensor([list(grid)])
        with torch.no_grad():
            want = ref.model.visual.patch_embed(pv)
            got = ours.model.visual.patch_embed(pv)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            f_want = ref.model.get_image_features(pv, thw)
            f_got = ours.model.get_image_features(pv, thw)
        f_want = f_want.pooler_output if hasattr(f_want, "pooler_output") else f_want
        f_got = f_got.pooler_output if hasattr(f_got, "pooler_output") else f_got
        for a, b in zip(f_got, f_want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert patch_embed_as_gemm(ours) == 1  # applying it again changes nothing else
