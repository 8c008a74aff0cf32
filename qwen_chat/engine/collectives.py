"""Collectives of the tensor-parallel decode step: the all-reduce after each row-parallel projection, and the
broadcast that gives every rank rank 0's sampled tokens.

At batch 1 a TP=2 decode step of the 9B runs 66 all-reduces of one hidden row (4,096 bf16 = 8 KiB): after the
vocabulary-split embedding and after each of the 64 row-parallel projections (24 Gated DeltaNet ``out_proj``,
8 ``o_proj``, 32 ``down_proj``; ``qwen_chat.engine.sharding``).  Such small messages are bound by latency, not
bandwidth, so the kernel that does them matters:

- ``symm_mem``: PyTorch's symmetric-memory one-shot all-reduce (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``,
  ``torch.distributed._symmetric_memory``): each rank copies its partial sums into a buffer that every peer maps
  over NVLink, and one kernel reads all peers' buffers and adds them.  No NVLink multicast is used (the GPU hosts
  here must run with it off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).  Used for messages up to
  ``SYMM_MEM_MAX_BYTES``;
- ``torch.distributed``: ``torch.distributed.all_reduce`` (NCCL on CUDA, gloo on CPU), for everything else and
  as the fallback when symmetric memory cannot be set up (CPU, no P2P access, an older PyTorch).

``TensorParallelComm(group, device, dtype).all_reduce(x)`` picks the first at construction (``backend="auto"``)
after checking it on a probe; ``QWEN_CHAT_TP_ALLREDUCE=nccl`` forces ``torch.distributed``.  Both kinds can be captured in a CUDA
graph.  Measured on 2 x H200: docs/performance.md ("Tensor parallel").
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: Largest all-reduce (bytes) sent through symmetric memory; larger ones go to NCCL.  32 rows of the 9B's
#: 4,096-wide hidden state in bf16 = 256 KiB (the decode batches the service runs at most).
SYMM_MEM_MAX_BYTES = 256 * 1024

#: Environment variable that forces the all-reduce kind: "auto" (default), "symm_mem" or "nccl" (plain
#: ``torch.distributed``).
BACKEND_ENV = "QWEN_CHAT_TP_ALLREDUCE"


class TensorParallelComm:
    """Sum-all-reduce and token broadcast over a tensor-parallel process group.

    Args:
        group: the TP process group (default: the default group, as the service runs TP over all ranks).
        device: this rank's device.
        dtype: dtype of the activations to reduce (the symmetric buffer is allocated in it).
        backend: "auto" (symmetric memory when it works here, else ``torch.distributed``), "symm_mem" (raise if
            it cannot be set up) or "nccl" (``torch.distributed``); default from ``QWEN_CHAT_TP_ALLREDUCE``, else
            "auto".
        max_bytes: largest message sent through symmetric memory.

    Attributes: ``world_size``, ``rank``, ``kind`` ("symm_mem" or "torch.distributed": what ``all_reduce`` uses
    for messages up to ``max_bytes``).  Every rank of ``group`` must construct it at the same time (rendezvous inside).

    Raises:
        ValueError: unknown ``backend``.
        RuntimeError: ``backend="symm_mem"`` and symmetric memory could not be set up or failed its check.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device, dtype: torch.dtype,
                 backend: Optional[str] = None, max_bytes: int = SYMM_MEM_MAX_BYTES) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device)
        self.dtype = dtype
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        backend = (backend or os.environ.get(BACKEND_ENV) or "auto").strip().lower()
        if backend not in ("auto", "symm_mem", "nccl"):
            raise ValueError(f"{BACKEND_ENV} must be auto, symm_mem or nccl (got {backend!r})")
        self.kind = "torch.distributed"
        self.max_numel = max(1, int(max_bytes) // torch.empty(0, dtype=dtype).element_size())
        self._buf: Optional[torch.Tensor] = None
        self._group_name = ""
        if backend != "nccl" and self.device.type == "cuda" and self.world_size > 1:
            try:
                self._setup_symm_mem()
                self.kind = "symm_mem"
            except Exception as exc:  # noqa: BLE001 - optional fast path
                if backend == "symm_mem":
                    raise RuntimeError(f"symmetric-memory all-reduce unavailable: {exc}") from exc
                log.info("TP all-reduce: symmetric memory unavailable (%s: %s); using torch.distributed",
                         type(exc).__name__, str(exc)[:200])
        log.info("TP all-reduce over %d ranks: %s (<= %d KiB), torch.distributed above", self.world_size, self.kind,
                 self.max_numel * torch.empty(0, dtype=dtype).element_size() // 1024)

    def _setup_symm_mem(self) -> None:
        """Allocate and rendezvous the symmetric buffer, then check one all-reduce against the known sum."""
        import torch.distributed._symmetric_memory as symm_mem

        name = self.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(name)  # needed by older PyTorch, a no-op or deprecated later
            except Exception:  # noqa: BLE001
                pass
        buf = symm_mem.empty(self.max_numel, dtype=self.dtype, device=self.device)
        symm_mem.rendezvous(buf, name)
        self._buf, self._group_name = buf, name
        # Check: rank r contributes r + 1 everywhere, so every element must equal W (W + 1) / 2.
        probe = torch.full((8, 128), float(self.rank + 1), dtype=self.dtype, device=self.device)
        got = self._symm_all_reduce(probe)
        want = self.world_size * (self.world_size + 1) / 2
        if not bool((got.float() == want).all()):
            raise RuntimeError(f"symmetric-memory all-reduce check failed: got {got.float().unique().tolist()}, "
                               f"want {want}")

    def _symm_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        view = self._buf[:x.numel()].view_as(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", self._group_name, out)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group's ranks (same shape and dtype).  Returns a new tensor (symmetric memory)
        or ``x`` itself, reduced in place (``torch.distributed``).  Queued on the current stream; capturable in a CUDA graph.

        With two ranks every rank gets the same bits (each adds the same two partial results, and one
        addition does not depend on the order).  Sampled tokens never depend on it: ``broadcast_from_rank0``.
        """
        if self.world_size == 1:
            return x
        if (self._buf is not None and x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.max_numel
                and (x.numel() * x.element_size()) % 16 == 0):
            return self._symm_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` [..., n] along the last dimension in rank order: [..., W * n]
        (``all_gather_into_tensor``, one NCCL call)."""
        if self.world_size == 1:
            return x
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).contiguous()                      # [R, n]
        parts = torch.empty((self.world_size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(parts, x, group=self.group)           # rank blocks along dim 0: [W * R, n]
        full = parts.view(self.world_size, x.shape[0], x.shape[1]).permute(1, 0, 2)
        return full.reshape(*lead, self.world_size * x.shape[1])


def broadcast_from_rank0(tokens: torch.Tensor) -> torch.Tensor:
    """Replace ``tokens`` (int64 [B], on the device) in place with rank 0's values over the default process group
    and return it (queued, no host wait).  Used as ``Sampler.token_sync`` when several ranks run: each rank then
    records and feeds rank 0's sampled tokens, even where the ranks' logits differ in the last bit."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tokens, src=0)
    return tokens


def tp_comm_for(model: torch.nn.Module, device, dtype: torch.dtype) -> Optional[TensorParallelComm]:
    """The ``TensorParallelComm`` for a model sharded by tensor parallelism over the default group, or None when
    torch.distributed is not initialised, runs one rank, or the model holds no row-parallel layer.  Collective:
    every rank calls it at the same time."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from qwen_chat.engine.sharding import RowParallelLinear

    if not any(isinstance(m, RowParallelLinear) or _is_deepspeed_row_parallel(m) for m in model.modules()):
        return None
    return TensorParallelComm(None, device, dtype)


def _is_deepspeed_row_parallel(m: torch.nn.Module) -> bool:
    return type(m).__name__ == "LinearAllreduce" and type(m).__module__.startswith("deepspeed.")
