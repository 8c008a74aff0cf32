"""The decode step's projections and the communication that completes them, in one object.

The runner's decode step always calls one of these (``decode_projections`` picks it):

- ``LocalDecode`` (world size 1, ZeRO-3, or a model without row-parallel layers): the identity of tensor
  parallelism.  The single projections (each layer's token-mixer ``out_proj``/``o_proj``, ``down_proj`` and the
  lm_head) run on their local weight, bf16 or FP8 (the Triton GEMVs of ``qwen_chat.engine.model.gemv`` and
  ``fp8_gemv`` through ``fp8.linear`` when enabled, else the module itself); no communication.
- ``TensorParallelDecode``: the same, plus the tensor-parallel completions over a
  ``collectives.TensorParallelComm``: the all-reduce after each row-parallel projection (DeepSpeed AutoTP's
  ``LinearAllreduce``, ``tp_layers.RowParallelLinear``), the all-gather of the vocabulary-split lm_head
  (``tp_layers.GatheredColumnLinear``) and the sum of the vocabulary-split embedding's partial lookups
  (``tp_layers.VocabParallelEmbedding``).  With the fused kernels (symmetric memory, CUDA graphs, the Triton
  GEMV) each row-parallel projection writes its partial result into the comm's staging slot and the next
  ``add_norm`` does all-reduce + residual add + RMSNorm in one kernel (``all_reduce_add_norm``), in every layer
  or in none, so every step ends with the reduction that carries the end barrier.

Prefill does not use these: it calls the sharded modules, which communicate internally.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from qwen_chat.engine.model import fp8, fusion
from qwen_chat.engine.parallel.collectives import TensorParallelComm
from qwen_chat.engine.parallel.tp_layers import GatheredColumnLinear, VocabParallelEmbedding, row_parallel_weight

#: ``compute(out)``: a local projection that writes into ``out`` when it is not None, else returns a new tensor.
Compute = Callable[[Optional[torch.Tensor]], torch.Tensor]
#: ``add_norm(h, x, norm) -> (h + x, norm(h + x))``: the glue's residual add and RMSNorm (``glue.add_norm``).
AddNorm = Callable[[torch.Tensor, torch.Tensor, torch.nn.Module], tuple[torch.Tensor, torch.Tensor]]


def single_projections(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The projections a decode step runs one by one: the lm_head, then per layer the token mixer's output
    projection (``linear_attn.out_proj`` or ``self_attn.o_proj``) and the MLP's ``down_proj``."""
    singles = [model.lm_head]
    for layer in model.model.language_model.layers:
        mixer = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj
        singles += [mixer, layer.mlp.down_proj]
    return singles


class LocalDecode:
    """Decode projections on this rank alone (world size 1: no communication).

    Args:
        model: the ``Qwen3_5ForConditionalGeneration`` the runner drives.
        dtype: activation dtype (the embedding's output is cast to it).
        fast_gemv: run the projections the step runs itself through ``gemv.gemv`` where ``gemv.supports`` them.
        add_norm: the glue's residual add + RMSNorm (``glue.add_norm``, compiled or not).
        zero3: ZeRO-3 partitioned parameters: every projection is called as a module (its hooks gather it).

    Attributes: ``kind`` (``impl["tp_all_reduce"]``: None here) and ``fused`` (``impl["tp_fused_all_reduce_norm"]``).
    """

    kind: Optional[str] = None
    fused = False

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype, fast_gemv: bool, add_norm: AddNorm,
                 zero3: bool) -> None:
        lm = model.model.language_model
        self._embed, self._first_norm = lm.embed_tokens, lm.layers[0].input_layernorm
        self._dtype, self._fast_gemv, self._add_norm = dtype, bool(fast_gemv), add_norm
        self._singles = single_projections(model)
        # id(module) -> (this rank's weight (tensor or fp8.Fp8Weight), how to finish: None, "all_reduce" or
        # "all_gather")
        self._direct: dict[int, tuple[fp8.Weight, Optional[str]]] = {}
        for m in ([] if zero3 else self._singles):
            entry = self._entry(m)
            if entry is not None:
                self._direct[id(m)] = entry

    def _entry(self, m: torch.nn.Module) -> Optional[tuple[fp8.Weight, Optional[str]]]:
        """How the step runs module ``m`` itself: (weight, finish), or None to call the module."""
        w = fusion.weight_of(m)
        return None if w is None else (w, None)

    # ------------------------------------------------------------------ step
    def begin_step(self, rows: int) -> None:
        """Called before tracing or running a decode step of ``rows`` rows (decides the fused path)."""

    def end_step(self) -> None:
        """Called after the step's last ``add_norm`` (also when it raised)."""

    def embed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings h [B, hidden] (activation dtype) of int64 tokens [B] and the first layer's normed
        input x [B, hidden]."""
        h = self._embed(tokens).to(self._dtype)
        return h, self._first_norm(h)

    def add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: torch.nn.Module,
                 last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add and the next RMSNorm after a token mixer or MLP: (h + x, norm(h + x)), [B, hidden].
        ``last``: the step's final one."""
        return self._add_norm(h, x, norm)

    def weight(self, mod: torch.nn.Module) -> Optional[fp8.Weight]:
        """This rank's weight [N, in] (a tensor or an ``fp8.Fp8Weight``) of a projection the step runs itself, or
        None (the module is called)."""
        entry = self._direct.get(id(mod))
        return None if entry is None else entry[0]

    def linear(self, mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``mod(x)`` for x [B, in] in decode.  A projection the step runs itself (``weight(mod)`` not None) goes
        through its local weight (Triton GEMV when enabled, else cuBLAS) and is completed across the ranks;
        any other module is called."""
        direct = self._direct.get(id(mod))
        if direct is None or (direct[1] is None and not self._fast_gemv):
            return mod(x)
        w = direct[0]
        return self.run(mod, x.shape[0], lambda out: self._matmul(x, w, out))

    def run(self, mod: torch.nn.Module, rows: int, compute: Compute) -> torch.Tensor:
        """Complete ``compute(out)``, a local projection of ``rows`` rows with ``mod``'s weight
        (``weight(mod)`` must not be None), across the ranks: here, its output as it is."""
        w, finish = self._direct[id(mod)]
        return self._run(w, finish, rows, compute)

    def _run(self, w: fp8.Weight, finish: Optional[str], rows: int, compute: Compute) -> torch.Tensor:
        return compute(None)

    def _matmul(self, x: torch.Tensor, w: fp8.Weight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, in] @ w[out, in]^T, into ``out`` [B, out] when given: the Triton GEMVs when enabled and they
        apply, else cuBLAS (``fp8.linear``)."""
        return fp8.linear(x, w, out, fast=self._fast_gemv)


class TensorParallelDecode(LocalDecode):
    """Decode projections completed over the tensor-parallel group of ``comm`` (see the module docstring).

    Args: as ``LocalDecode``, plus ``comm`` (the group's ``TensorParallelComm``) and ``cuda_graphs`` (the fused
    all-reduce + RMSNorm is used only inside captured steps).  Attributes: ``kind`` (``comm.kind``), ``fused``
    (whether the fused all-reduce + residual add + RMSNorm applies to this model).
    """

    def __init__(self, model: torch.nn.Module, *, comm: TensorParallelComm, dtype: torch.dtype, fast_gemv: bool,
                 cuda_graphs: bool, add_norm: AddNorm, zero3: bool) -> None:
        self._comm = comm
        super().__init__(model, dtype=dtype, fast_gemv=fast_gemv, add_norm=add_norm, zero3=zero3)
        self.kind = comm.kind
        lm = model.model.language_model
        norms = [lm.norm] + [n for layer in lm.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        rowpar = [self._direct.get(id(m), (None, None))[1] == "all_reduce" for m in self._singles[1:]]
        self.fused = (self._fast_gemv and cuda_graphs and comm.fused_rows(model.config.text_config.hidden_size) > 0
                      and all(rowpar) and isinstance(self._embed, VocabParallelEmbedding)
                      and all(type(n).__name__ == "Qwen3_5RMSNorm" and hasattr(n, "eps") for n in norms))
        self._step_fused = False  # set while a decode step that uses it is traced or run

    def _entry(self, m: torch.nn.Module) -> Optional[tuple[fp8.Weight, Optional[str]]]:
        if (w := fusion.weight_of(m)) is not None:
            return w, None
        if (w := row_parallel_weight(m)) is not None:
            return w, "all_reduce"
        if isinstance(m, GatheredColumnLinear):
            return m.weight_rows, "all_gather"
        return None

    def begin_step(self, rows: int) -> None:
        self._step_fused = self.fused and rows <= self._comm.fused_rows(self._embed.embedding_dim)

    def end_step(self) -> None:
        self._step_fused = False

    def embed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LocalDecode.embed``; the vocabulary-split table's partial lookups are summed over the ranks
        (with the norm in one kernel in a fused step)."""
        if not isinstance(self._embed, VocabParallelEmbedding):
            return super().embed(tokens)
        norm = self._first_norm
        part = self._embed.partial(tokens).to(self._dtype)
        if self._step_fused:
            staged = self._comm.staging(*part.shape)
            staged.copy_(part)
            return self._comm.all_reduce_add_norm(staged, None, norm.weight, norm.eps)
        h = self._comm.all_reduce(part)
        return h, norm(h)

    def add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: torch.nn.Module,
                 last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LocalDecode.add_norm``; in a fused step x is the staged partial result and one kernel also sums
        it over the ranks (``last``: the step's final reduction, which waits for the peers to finish reading)."""
        if self._step_fused:
            return self._comm.all_reduce_add_norm(x, h, norm.weight, norm.eps, end_barrier=last)
        return self._add_norm(h, x, norm)

    def _run(self, w: fp8.Weight, finish: Optional[str], rows: int, compute: Compute) -> torch.Tensor:
        """In a fused step a row-parallel output goes to the comm's staging slot [rows, N] and is returned
        unreduced (the next ``add_norm`` reduces it); with the fused kernels the vocabulary-split lm_head's output
        is staged and gathered by one kernel (``all_gather_staged``, fp32); otherwise the output is summed over
        the ranks ("all_reduce"), concatenated ("all_gather": [B, W * N]) or left as it is."""
        if finish == "all_reduce" and self._step_fused:
            out = self._comm.staging(rows, w.shape[0])
            compute(out)
            return out
        if finish == "all_gather" and self.fused and rows <= self._comm.gather_rows(w.shape[0]):
            out = self._comm.staging(rows, w.shape[0])
            compute(out)
            return self._comm.all_gather_staged(out)                # fp32 [rows, W * N]
        y = compute(None)
        if finish == "all_reduce":
            return self._comm.all_reduce(y)
        if finish == "all_gather":
            return self._comm.all_gather_last(y)
        return y


def is_tensor_parallel(model: torch.nn.Module, zero3: bool) -> bool:
    """Whether ``model`` runs tensor parallel: torch.distributed runs several ranks and the model holds a
    row-parallel layer (``tp_layers.row_parallel_weight``), not under ZeRO-3."""
    return (not zero3 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and any(row_parallel_weight(m) is not None for m in model.modules()))


def decode_projections(model: torch.nn.Module, *, device, dtype: torch.dtype, fast_gemv: bool, cuda_graphs: bool,
                       add_norm: AddNorm, zero3: bool, backend: str = "auto", fused: bool = True) -> LocalDecode:
    """The decode projections for ``model``: ``TensorParallelDecode`` over the default process group when it
    ``is_tensor_parallel``; else ``LocalDecode``.  ``backend``/``fused``: the
    ``TensorParallelComm``'s all-reduce kind and fused kernels.  Collective under TP: every rank calls it at
    the same time (the comm's rendezvous).  Raises ValueError for an unknown ``backend`` (under TP only)."""
    local = dict(dtype=dtype, fast_gemv=fast_gemv, add_norm=add_norm, zero3=zero3)
    if not is_tensor_parallel(model, zero3):
        return LocalDecode(model, **local)
    comm = TensorParallelComm(None, device, dtype, backend=backend, fused=fused)
    return TensorParallelDecode(model, comm=comm, cuda_graphs=cuda_graphs, **local)

