"""The tensor-parallel layers written here (not DeepSpeed's) and the recognition of every TP projection.

- ``VocabParallelEmbedding``: the input embedding split by vocabulary rows (``shard_input_embedding``);
- ``GatheredColumnLinear``: the lm_head split by output rows, logits all-gathered (``shard_lm_head``);
- ``RowParallelLinear`` and ``split_gated_deltanet_heads``: a Gated DeltaNet layer split by heads, its
  ``out_proj`` row-parallel;
- ``column_parallel_weight`` / ``row_parallel_weight``: this rank's weight of a projection whose forward is one
  local ``x @ w^T`` (DeepSpeed AutoTP's ``LinearLayer``; ``LinearAllreduce`` or ``RowParallelLinear``, then a
  sum-all-reduce), matched by class name and attributes so that nothing here imports deepspeed.

``qwen_chat.engine.parallel.sharding`` applies them before DeepSpeed's AutoTP; the decode step's TP path
(``qwen_chat.engine.parallel.tp_decode``) recognises them.  Every rank must hold the same model and call the
``shard_*`` functions at the same time.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)


class VocabParallelEmbedding(torch.nn.Module):
    """One rank's rows of an input embedding table; the lookup is completed by an all-reduce (sum).

    Rank r of N holds rows ``[r * ceil(V / N), min(V, (r + 1) * ceil(V / N)))`` of the ``[V, H]`` table; ids
    outside its range embed to zeros, and the all-reduce over the default process group (the TP group: the
    service runs TP over all ranks) adds the one non-zero row, so the result equals the unsharded lookup
    exactly in any dtype.  Scheme: Megatron-LM's VocabParallelEmbedding (Shoeybi et al. 2019, sec. 3).

    Why: transformers' Qwen3.5 tp_plan leaves the untied 248,320 x 4,096 input embedding (2.03 GB in bf16)
    whole on every rank, and DeepSpeed only splits embeddings tied to a vocab-parallel head.

    Input: int64 ids of any shape [...]; output: [..., H] in the table's dtype.
    """

    def __init__(self, full: torch.nn.Embedding, rank: int, world_size: int) -> None:
        super().__init__()
        vocab, self.embedding_dim = full.weight.shape
        per = -(-vocab // world_size)
        self.num_embeddings = vocab
        self.start, self.end = min(vocab, rank * per), min(vocab, (rank + 1) * per)
        self.padding_idx = full.padding_idx
        self.weight = torch.nn.Parameter(full.weight.data[self.start:self.end].clone(), requires_grad=False)

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the lookup: rows of its range, zeros for ids outside it ([..., H]); the sum over
        ranks is the full lookup."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = torch.nn.functional.embedding(local.clamp(0, max(0, self.end - self.start - 1)), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.partial(ids)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(out)
        return out


class GatheredColumnLinear(torch.nn.Module):
    """One rank's output rows of a bias-free ``nn.Linear``; the local outputs are all-gathered into the full width.

    Rank r of N holds rows ``[r * O / N, (r + 1) * O / N)`` of the ``[O, I]`` weight (O divisible by N) as
    ``weight_rows`` and computes those O / N outputs; an all-gather over the default process group (the TP group)
    concatenates them in rank order, so the result has the unsharded shape [..., O] and the same values (each
    output is the same dot product as before).  This is the ``colwise_gather_output`` style of transformers' tp_plan, applied
    to the lm_head here so that it is split whatever the installed transformers/DeepSpeed pair does with the
    model-level plan entry (seen whole with transformers 5.17, split with 5.23).

    Input [..., I]; output [..., O] in the weight's dtype.
    """

    def __init__(self, full: torch.nn.Linear, rank: int, world_size: int) -> None:
        super().__init__()
        self.out_features, self.in_features = full.weight.shape
        per = self.out_features // world_size
        self.world_size = world_size
        # Not called ``weight``: DeepSpeed AutoTP matches the plan's "lm_head" entry by parameter name
        # (``lm_head.weight``) and would try to split this module a second time.
        self.weight_rows = torch.nn.Parameter(full.weight.data[rank * per:(rank + 1) * per].clone(),
                                              requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = torch.nn.functional.linear(x, self.weight_rows).contiguous()
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return local
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, local)
        return torch.cat(parts, dim=-1)


class RowParallelLinear(torch.nn.Module):
    """One rank's input columns of a bias-free ``nn.Linear``; the partial outputs are summed by an all-reduce.

    Holds ``weight_cols`` [O, I_local]: the columns of the full [O, I] weight that multiply this rank's slice
    of the input (which the caller already has locally, e.g. its own attention heads).  Output [..., O] equals
    the unsharded layer's (sum over ranks of the partial products).  Megatron-LM's RowParallelLinear (Shoeybi
    et al. 2019, sec. 3).  The weight is not called ``weight`` so that DeepSpeed AutoTP, which matches plan
    entries by parameter name, never splits it again.
    """

    def __init__(self, weight_cols: torch.Tensor, world_size: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_cols.shape
        self.world_size = world_size
        self.weight_cols = torch.nn.Parameter(weight_cols, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, self.weight_cols)
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(out)
        return out


def shard_lm_head(model: torch.nn.Module) -> None:
    """Replace a bias-free ``lm_head`` whose width divides by the world size with ``GatheredColumnLinear``."""
    head = getattr(model, "lm_head", None)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or head.out_features % world:
        return
    if head.weight is model.get_input_embeddings().weight:  # tied head: leave it to the tied embedding
        return
    model.lm_head = GatheredColumnLinear(head, rank, world)
    log.info("TP: lm_head split by output rows over %d ranks (%d x %d each), logits all-gathered", world,
             head.out_features // world, head.in_features)


def shard_input_embedding(model: torch.nn.Module) -> None:
    """Replace the model's input embedding with this rank's ``VocabParallelEmbedding`` (before AutoTP)."""
    full = model.get_input_embeddings()
    if not isinstance(full, torch.nn.Embedding):
        return
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model.set_input_embeddings(VocabParallelEmbedding(full, rank, world))
    log.info("TP: input embedding split by vocabulary rows over %d ranks (%d x %d each)", world,
             -(-full.weight.shape[0] // world), full.weight.shape[1])


def split_gated_deltanet_heads(la: torch.nn.Module, rank: int, world: int) -> tuple[int, int]:
    """Keep rank ``rank``'s heads of one Gated DeltaNet layer ``la`` (of ``world`` ranks); returns its
    (key heads, value heads).

    Rank r of N keeps key heads [r * nk / N, (r + 1) * nk / N) and value heads [r * nv / N, (r + 1) * nv / N):
    the matching rows of ``in_proj_qkv`` (its q, k and v blocks) and of the depthwise ``conv1d``, of
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``A_log`` and ``dt_bias``, and the matching input columns of
    ``out_proj`` (``RowParallelLinear``: one all-reduce per layer).  Value head j reads key head j // (nv / nk)
    (the ``repeat_interleave`` grouping), so a rank's value heads only need its own key heads; the gated
    RMSNorm weight is per head dimension and stays whole.  The layer's head counts and widths are updated.
    """
    nk, nv, dk, dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    nk_l, nv_l = nk // world, nv // world
    k_rows = torch.arange(rank * nk_l * dk, (rank + 1) * nk_l * dk)
    v_rows = torch.arange(rank * nv_l * dv, (rank + 1) * nv_l * dv)
    heads = torch.arange(rank * nv_l, (rank + 1) * nv_l)
    qkv_rows = torch.cat([k_rows, nk * dk + k_rows, 2 * nk * dk + v_rows])
    with torch.no_grad():
        for lin, rows in ((la.in_proj_qkv, qkv_rows), (la.in_proj_z, v_rows), (la.in_proj_b, heads),
                          (la.in_proj_a, heads)):
            lin.weight = torch.nn.Parameter(lin.weight.data[rows.to(lin.weight.device)].clone(),
                                            requires_grad=False)
            lin.out_features = lin.weight.shape[0]
        conv = la.conv1d
        conv.weight = torch.nn.Parameter(conv.weight.data[qkv_rows.to(conv.weight.device)].clone(),
                                         requires_grad=False)
        if conv.bias is not None:
            conv.bias = torch.nn.Parameter(conv.bias.data[qkv_rows.to(conv.bias.device)].clone(),
                                           requires_grad=False)
        conv.in_channels = conv.out_channels = conv.groups = len(qkv_rows)
        la.A_log = torch.nn.Parameter(la.A_log.data[heads.to(la.A_log.device)].clone(), requires_grad=False)
        la.dt_bias = torch.nn.Parameter(la.dt_bias.data[heads.to(la.dt_bias.device)].clone(),
                                        requires_grad=False)
        w = la.out_proj.weight.data
        la.out_proj = RowParallelLinear(w[:, v_rows.to(w.device)].clone(), world)
    la.num_k_heads, la.num_v_heads = nk_l, nv_l
    la.key_dim, la.value_dim = nk_l * dk, nv_l * dv
    la.conv_dim = 2 * la.key_dim + la.value_dim
    return nk_l, nv_l


def is_deepspeed_layer(m: torch.nn.Module, name: str) -> bool:
    """True when ``m`` is DeepSpeed's class ``name`` (matched by name, so this module need not import deepspeed
    to recognise AutoTP's layers)."""
    return type(m).__name__ == name and type(m).__module__.startswith("deepspeed.")


def _hooked(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def column_parallel_weight(m: torch.nn.Module) -> Optional[torch.Tensor]:
    """This rank's weight [out_local, in] of DeepSpeed AutoTP's column-parallel ``LinearLayer`` when its forward
    is exactly ``x @ w^T`` on the local rows: no bias, no gathered output, no overlapped communication, no hooks
    (deepspeed/module_inject/layers.py, DeepSpeed 0.19.8).  None for any other module."""
    w = getattr(m, "weight", None)
    if (is_deepspeed_layer(m, "LinearLayer") and getattr(m, "bias", None) is None
            and not getattr(m, "gather_output", False) and not getattr(type(m), "tp_overlap_comm", False)
            and not _hooked(m) and isinstance(w, torch.Tensor) and w.dim() == 2):
        return w
    return None


def row_parallel_weight(m: torch.nn.Module) -> Optional[torch.Tensor]:
    """This rank's weight [out, in_local] of a row-parallel projection whose forward is ``x @ w^T`` followed by a
    sum-all-reduce over all ranks: ``RowParallelLinear`` or DeepSpeed AutoTP's ``LinearAllreduce`` (bias-free,
    collectives not deferred to a compiler; deepspeed/module_inject/layers.py, DeepSpeed 0.19.8), without hooks.
    None for any other module."""
    if _hooked(m):
        return None
    if isinstance(m, RowParallelLinear):
        return m.weight_cols
    w = getattr(m, "weight", None)
    if (is_deepspeed_layer(m, "LinearAllreduce") and getattr(m, "bias", None) is None
            and isinstance(w, torch.Tensor) and w.dim() == 2
            and not getattr(m, "defer_collectives_to_compiler", False) and getattr(m, "mp_group", None) is not None):
        return w
    return None
