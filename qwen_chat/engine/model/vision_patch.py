"""The vision tower's patch embedding as the GEMM it is, instead of a 3-D convolution.

transformers' ``Qwen3_5VisionPatchEmbed`` views the processor's flattened patches ([N, C * T * P * P], C = 3
channels, T = 2 frames, P = 16 px; ``models/qwen3_5/modeling_qwen3_5.py``) as N tiny volumes and runs
``nn.Conv3d`` with kernel = stride = the volume: each output row is the dot product of one whole patch with each
filter, i.e. ``x @ W.reshape(out, -1).T + b``.  As a convolution, each new number of patches N (each new image
size) is a new problem for cuDNN, which selects and builds an execution plan for each new shape at its first
call; the GEMM has no per-shape plan.  Why here: on an H200 the first photo after ready took 61-117 ms in the
engine against 45-50 ms for the same photo later (2026-12-04, serve runs s17-s19), while the text prompts'
first and later TTFTs were equal; whether this change removes that difference is for the next GPU run to
show (on the 2-core CPU machine a new image size costs nothing extra either way).  The result equals the
convolution's up to the order of the sums (tests/engine/test_vision_patch.py).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _forward_as_gemm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """[N, C*T*P*P] patches (any float dtype) -> [N, embed_dim] in the weight's dtype."""
    w = self.proj.weight  # [embed_dim, C, T, P, P]
    x = hidden_states.reshape(-1, w[0].numel()).to(w.dtype)
    return F.linear(x, w.reshape(w.shape[0], -1), self.proj.bias)


def patch_embed_as_gemm(model: torch.nn.Module) -> int:
    """Make every vision patch embedding of ``model`` (modules with a ``proj`` ``nn.Conv3d`` whose kernel equals
    its stride, as ``Qwen3_5VisionPatchEmbed``) run as a GEMM.  Modules whose weight is not held whole here
    (DeepSpeed ZeRO-3 partitions it and gathers it only around ``proj``'s own call) keep the convolution.
    Returns how many were changed."""
    changed = 0
    for module in model.modules():
        proj = getattr(module, "proj", None)
        if not isinstance(proj, torch.nn.Conv3d) or tuple(proj.kernel_size) != tuple(proj.stride):
            continue
        if hasattr(proj.weight, "ds_id") or proj.weight.numel() == 0 or tuple(proj.padding) != (0, 0, 0):
            continue
        module.forward = types.MethodType(_forward_as_gemm, module)
        changed += 1
    return changed
