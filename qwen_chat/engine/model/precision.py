"""Exact fp32 on CUDA: the library defaults that round fp32 inputs to lower precision, switched off in one place.

By default on an NVIDIA GPU not every kernel computes fp32 in fp32: cuDNN's convolutions (the Gated DeltaNet
conv1d) use TF32 (``torch.backends.cudnn.allow_tf32`` is True by default), cuBLAS does when
``torch.backends.cuda.matmul.allow_tf32`` is set, and ``F.scaled_dot_product_attention`` on fp32 inputs picks a
fused kernel (memory-efficient, CUTLASS) whose arithmetic is not the plain fp32 of its math backend.
``exact_fp32`` turns all of these to plain fp32 (SDPA: the math backend only) for the whole process and
returns what was set before, for ``restore``.  An fp32 engine on CUDA (``delta_rule.resolve_chunk_rule``) and
the fp32 reference of the accuracy checks (``loading.torch_reference_kernels``) both call it, so both compute
the same plain fp32 (measured: docs/performance.md, "FP8 weights", accuracy).
"""
from __future__ import annotations

import torch

_SDPA = ("flash", "mem_efficient", "cudnn")


def exact_fp32() -> dict:
    """Switch TF32 off in cuBLAS and cuDNN and leave SDPA only its math backend (process-wide).  Returns the
    previous settings ({flag name: bool}) for ``restore``."""
    before = {"matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32}
    for name in _SDPA:
        before[name] = getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for name in _SDPA:
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(False)
    return before


def restore(before: dict) -> None:
    """Put back the settings ``exact_fp32`` returned."""
    torch.backends.cuda.matmul.allow_tf32 = before["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = before["cudnn_tf32"]
    for name in _SDPA:
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(before[name])
