"""The runner's implementation switches, whose defaults are what production runs.

``RunnerOptions()`` is the service's runner: each switch left at None ("auto") is resolved against the device
and the model by ``resolve_options``, in this one place.  Benchmarks and tests set a switch to True or False to
compare implementations; True where it cannot work raises ValueError.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from qwen_chat.engine.model import gemv, prefill_kernels


@dataclass(frozen=True)
class RunnerOptions:
    """How the runner computes (not what: every combination gives the same model, up to rounding).

    Attributes (None = auto, what production does):
        cuda_graphs: capture the decode step (per batch size and context bucket) and the bucketed prefill in CUDA
            graphs.  Auto: on for CUDA unless ZeRO-3.
        compile_glue: fuse the decode step's element-wise glue with ``torch.compile`` (``glue``).  Auto: as
            ``cuda_graphs``.
        fast_gemv: run the projections of batches of <= ``gemv.MAX_ROWS`` rows through the Triton kernels of
            ``gemv``.  Auto: as ``cuda_graphs`` when Triton is importable.
        gdn_kernel: run each Gated DeltaNet decode token as one Triton kernel (``gdn.gdn_decode``) instead of the
            glue's ``gdn_step``.  Auto: as ``fast_gemv`` where ``gdn.supports`` every layer.  True needs
            ``gdn.supports`` (CUDA, or Triton's interpreter on CPU for tests).
        prefill_graphs: run a step's single prompt chunk of <= 1,024 tokens padded to a bucket, in pieces between
            attention calls (``prefill_graph``), CUDA graphs when ``cuda_graphs``.  Auto: as ``cuda_graphs``
            without tensor parallelism (its prefill all-reduces are not captured).  True on CPU runs the padded
            pieces eagerly (tests).
        prefill_kernels: run the prefill's RMSNorms, SwiGLU and each Gated DeltaNet conv (with its SiLU and
            q/k l2-norm) as fused Triton kernels (``prefill_kernels``).  Auto: on CUDA with Triton, not under
            ZeRO-3.  True needs ``prefill_kernels.available`` (CUDA, or Triton's interpreter on CPU for tests).
        tp_allreduce: under tensor parallelism, the all-reduce kind of ``collectives.TensorParallelComm``:
            "auto", "symm_mem" or "nccl" (``collectives.BACKENDS``).
        tp_fused: under tensor parallelism, offer the fused all-reduce + residual add + RMSNorm kernels.
    """

    cuda_graphs: Optional[bool] = None
    compile_glue: Optional[bool] = None
    fast_gemv: Optional[bool] = None
    gdn_kernel: Optional[bool] = None
    prefill_graphs: Optional[bool] = None
    prefill_kernels: Optional[bool] = None
    tp_allreduce: str = "auto"
    tp_fused: bool = True


def auto_prefill_graphs(*, cuda: bool, zero3: bool, tensor_parallel: bool) -> bool:
    """Whether production runs the prefill graphs (``RunnerOptions.prefill_graphs`` left auto): with CUDA graphs
    (CUDA, not ZeRO-3) and without tensor parallelism.  The memory budget asks too, to reserve their pool."""
    return cuda and not zero3 and not tensor_parallel


def resolve_options(options: RunnerOptions, *, device: torch.device, zero3: bool,
                    gdn_fits: bool, tensor_parallel: bool = False) -> RunnerOptions:
    """``options`` with every auto switch decided (all six are then bools).

    device: the model's device; zero3: parameters partitioned by DeepSpeed ZeRO-3; gdn_fits: ``gdn.supports``
    the state of every Gated DeltaNet layer and its norm is ``Qwen3_5RMSNormGated`` (false under ZeRO-3);
    tensor_parallel: the model is sharded over several ranks.

    Raises ValueError: ``cuda_graphs=True`` off CUDA or under ZeRO-3; ``fast_gemv=True`` off CUDA or without
    Triton; ``gdn_kernel=True`` where ``gdn_fits`` is false; ``prefill_graphs=True`` under ZeRO-3 or tensor
    parallelism; ``prefill_kernels=True`` where ``prefill_kernels.available`` is false.
    """
    cuda = device.type == "cuda"
    graphs = options.cuda_graphs
    if graphs is None:
        graphs = cuda and not zero3
    if graphs and (not cuda or zero3):
        raise ValueError("CUDA graphs need a CUDA device and cannot be used under ZeRO-3")
    compile_glue = graphs if options.compile_glue is None else options.compile_glue
    fast_gemv = options.fast_gemv
    if fast_gemv is None:
        fast_gemv = graphs and gemv.triton is not None
    if fast_gemv and (not cuda or gemv.triton is None):
        raise ValueError("fast_gemv needs a CUDA device and Triton")
    if options.gdn_kernel and not gdn_fits:
        raise ValueError("gdn_kernel needs Triton, CUDA (or TRITON_INTERPRET=1), SiLU, Qwen3_5RMSNormGated and "
                         "power-of-two head dims")
    gdn_kernel = gdn_fits and (bool(fast_gemv) if options.gdn_kernel is None else bool(options.gdn_kernel))
    prefill_graphs = options.prefill_graphs
    if prefill_graphs is None:
        prefill_graphs = graphs and auto_prefill_graphs(cuda=cuda, zero3=zero3, tensor_parallel=tensor_parallel)
    if prefill_graphs and (zero3 or tensor_parallel):
        raise ValueError("prefill graphs cannot be used under ZeRO-3 or tensor parallelism")
    kernels = options.prefill_kernels
    if kernels is None:
        kernels = cuda and not zero3 and prefill_kernels.available(device)
    if kernels and not prefill_kernels.available(device):
        raise ValueError("prefill_kernels needs Triton and CUDA (or TRITON_INTERPRET=1)")
    return dataclasses.replace(options, cuda_graphs=bool(graphs), compile_glue=bool(compile_glue),
                               fast_gemv=bool(fast_gemv), gdn_kernel=bool(gdn_kernel),
                               prefill_graphs=bool(prefill_graphs), prefill_kernels=bool(kernels))
