"""The tensor-parallel layers written here (not DeepSpeed's) and the recognition of every TP projection.

- ``VocabParallelEmbedding``: the input embedding split by vocabulary rows (``shard_input_embedding``);
- ``GatheredColumnLinear``: the lm_head split by output rows, logits all-gathered (``shard_lm_head``);
- ``RowParallelLinear`` and ``split_gated_deltanet_heads``: a Gated DeltaNet layer split by heads, its
  ``out_proj`` row-parallel;
- ``shard_fp8_projections``: a model with FP8 weights (``fp8.Fp8Linear``) has its attention and MLP projections
  split here, on 128 x 128 block boundaries (DeepSpeed AutoTP would slice the FP8 data without its scales), and
  so does one with 4-bit weights (``int4.Int4Linear``: any output rows, input columns on 128-column groups);
- ``column_parallel_weight`` / ``row_parallel_weight``: this rank's weight of a projection whose forward is one
  local ``x @ w^T`` (DeepSpeed AutoTP's ``LinearLayer``; ``LinearAllreduce`` or ``RowParallelLinear``, then a
  sum-all-reduce), matched by class name and attributes so that nothing here imports deepspeed.

``qwen_chat.engine.parallel.sharding`` applies them before DeepSpeed's AutoTP; the decode step's TP path
(``qwen_chat.engine.parallel.tp_decode``) recognises them.  Every rank must hold the same model and call the
``shard_*`` functions at the same time.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from qwen_chat.engine.model.fp8 import BlockAlignmentError, Fp8Linear, Fp8Weight, Weight, linear
from qwen_chat.engine.model.int4 import GroupAlignmentError, Int4Linear, Int4Weight

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
    """One rank's input columns of a bias-free linear layer; the partial outputs are summed by an all-reduce.

    Holds ``weight_cols`` [O, I_local]: the columns of the full [O, I] weight that multiply this rank's slice
    of the input (which the caller already has locally, e.g. its own attention heads): a tensor, or for an
    ``fp8.Fp8Weight`` its float8 data, with the block scales in the buffer ``weight_cols_scale_inv``.  Output
    [..., O] equals the unsharded layer's (sum over ranks of the partial products).  Megatron-LM's
    RowParallelLinear (Shoeybi et al. 2019, sec. 3).  The weight is not called ``weight`` so that DeepSpeed
    AutoTP, which matches plan entries by parameter name, never splits it again.
    """

    def __init__(self, weight_cols: Weight, world_size: int, source: str = "") -> None:
        super().__init__()
        self.out_features, self.in_features = (int(d) for d in weight_cols.shape)
        self.world_size = world_size
        self.source = source
        data = (weight_cols.data if isinstance(weight_cols, Fp8Weight)
                else weight_cols.packed if isinstance(weight_cols, Int4Weight) else weight_cols)
        self.weight_cols = torch.nn.Parameter(data, requires_grad=False)
        self.register_buffer("weight_cols_scale_inv",
                             weight_cols.scale if isinstance(weight_cols, Fp8Weight) else None)
        four = isinstance(weight_cols, Int4Weight)
        self.register_buffer("weight_cols_scale", weight_cols.scale if four else None)
        self.register_buffer("weight_cols_zero_point", weight_cols.zero if four else None)

    def local_weight(self) -> Weight:
        """This rank's weight [O, I_local]: the tensor, or an ``fp8.Fp8Weight`` / ``int4.Int4Weight`` (built on
        each call)."""
        if self.weight_cols_scale is not None:
            return Int4Weight(self.weight_cols, self.weight_cols_scale, self.weight_cols_zero_point)
        if self.weight_cols_scale_inv is None:
            return self.weight_cols
        return Fp8Weight(self.weight_cols, self.weight_cols_scale_inv)

    def fp8_weight(self) -> Optional[Fp8Weight]:
        """The FP8 weight, or None for another one (``fp8.fp8_summary``)."""
        w = self.local_weight()
        return w if isinstance(w, Fp8Weight) else None

    def int4_weight(self) -> Optional[Int4Weight]:
        """The 4-bit weight, or None for another one (``int4.int4_summary``)."""
        w = self.local_weight()
        return w if isinstance(w, Int4Weight) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.local_weight()
        out = linear(x, w, fast=x.is_cuda and not isinstance(w, torch.Tensor))
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(out)
        return out


def rows_of(lin: torch.nn.Module, ranges: Sequence[tuple[int, int]], name: str) -> torch.nn.Module:
    """A new bias-free layer holding the output rows ``ranges`` ([start, stop) pairs, concatenated in order) of
    ``lin``: an ``nn.Linear`` (copied rows), an ``Fp8Linear`` (data and block scales, copied) or an ``Int4Linear``
    (packed values, scales and zero points, copied; any rows).  Raises BlockAlignmentError naming ``name`` when an
    FP8 range does not start and end on a 128-row block boundary."""
    if isinstance(lin, Fp8Linear):
        w = lin.fp8_weight()
        try:
            return Fp8Linear(Fp8Weight.cat_rows([w.rows(a, b) for a, b in ranges]))
        except BlockAlignmentError as exc:
            raise BlockAlignmentError(f"{name}: {exc}") from None
    if isinstance(lin, Int4Linear):  # groups run along the input: any rows
        w4 = lin.int4_weight()
        return Int4Linear(Int4Weight.cat_rows([w4.rows(a, b) for a, b in ranges]), source=lin.source)
    rows = torch.cat([torch.arange(a, b) for a, b in ranges]).to(lin.weight.device)
    out = torch.nn.Linear(lin.in_features, len(rows), bias=False, device="meta")
    out.weight = torch.nn.Parameter(lin.weight.data[rows].clone(), requires_grad=False)
    return out


def cols_of(lin: torch.nn.Module, start: int, stop: int, name: str) -> Weight:
    """Input columns start..stop-1 of ``lin``'s weight (copied): a tensor, an ``fp8.Fp8Weight`` (raises
    BlockAlignmentError naming ``name`` off the 128-column block boundaries) or an ``int4.Int4Weight`` (raises
    GroupAlignmentError naming ``name`` off the 128-column group boundaries)."""
    if isinstance(lin, Fp8Linear):
        try:
            return lin.fp8_weight().cols(start, stop)
        except BlockAlignmentError as exc:
            raise BlockAlignmentError(f"{name}: {exc}") from None
    if isinstance(lin, Int4Linear):
        try:
            return lin.int4_weight().cols(start, stop)
        except GroupAlignmentError as exc:
            raise GroupAlignmentError(f"{name}: {exc}") from None
    return lin.weight.data[:, start:stop].clone()


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


def split_gated_deltanet_heads(la: torch.nn.Module, rank: int, world: int, prefix: str = "") -> tuple[int, int]:
    """Keep rank ``rank``'s heads of one Gated DeltaNet layer ``la`` (of ``world`` ranks); returns its
    (key heads, value heads).

    Rank r of N keeps key heads [r * nk / N, (r + 1) * nk / N) and value heads [r * nv / N, (r + 1) * nv / N):
    the matching rows of ``in_proj_qkv`` (its q, k and v blocks) and of the depthwise ``conv1d``, of
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``A_log`` and ``dt_bias``, and the matching input columns of
    ``out_proj`` (``RowParallelLinear``: one all-reduce per layer).  Value head j reads key head j // (nv / nk)
    (the ``repeat_interleave`` grouping), so a rank's value heads only need its own key heads; the gated
    RMSNorm weight is per head dimension and stays whole.  The layer's head counts and widths are updated.
    FP8 projections are split on their 128 x 128 blocks (``rows_of``, ``cols_of``: BlockAlignmentError naming
    ``prefix`` + the projection when a rank's rows or columns would cut a block).
    """
    nk, nv, dk, dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    nk_l, nv_l = nk // world, nv // world
    k0, k1 = rank * nk_l * dk, (rank + 1) * nk_l * dk
    v0, v1 = rank * nv_l * dv, (rank + 1) * nv_l * dv
    h0, h1 = rank * nv_l, (rank + 1) * nv_l
    qkv_ranges = [(k0, k1), (nk * dk + k0, nk * dk + k1), (2 * nk * dk + v0, 2 * nk * dk + v1)]
    qkv_rows = torch.cat([torch.arange(a, b) for a, b in qkv_ranges])
    heads = torch.arange(h0, h1)
    with torch.no_grad():
        for attr, ranges in (("in_proj_qkv", qkv_ranges), ("in_proj_z", [(v0, v1)]), ("in_proj_b", [(h0, h1)]),
                             ("in_proj_a", [(h0, h1)])):
            setattr(la, attr, rows_of(getattr(la, attr), ranges, f"{prefix}linear_attn.{attr}"))
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
        la.out_proj = RowParallelLinear(cols_of(la.out_proj, v0, v1, f"{prefix}linear_attn.out_proj"), world,
                                        getattr(la.out_proj, "source", ""))
    la.num_k_heads, la.num_v_heads = nk_l, nv_l
    la.key_dim, la.value_dim = nk_l * dk, nv_l * dv
    la.conv_dim = 2 * la.key_dim + la.value_dim
    return nk_l, nv_l


def split_projections(layer: torch.nn.Module, rank: int, world: int, prefix: str = "") -> None:
    """Split one decoder layer's attention (``q_proj``/``k_proj``/``v_proj`` by output rows, ``o_proj`` by input
    columns) and MLP (``gate_proj``/``up_proj`` by rows, ``down_proj`` by columns) over ``world`` ranks, as
    transformers' tp_plan does (colwise / rowwise), for bf16 and FP8 layers alike: rank r keeps rows (columns)
    [r * n / world, (r + 1) * n / world) as an ``nn.Linear`` / ``Fp8Linear`` (``rows_of``) or a
    ``RowParallelLinear`` (``cols_of``: one all-reduce).  Used for models with FP8 weights, whose blocks DeepSpeed
    AutoTP cannot split.  Raises BlockAlignmentError naming the module when an FP8 rank share cuts a block."""
    owners = [("mlp", layer.mlp, ("gate_proj", "up_proj"), "down_proj")]
    if hasattr(layer, "self_attn"):
        owners.insert(0, ("self_attn", layer.self_attn, ("q_proj", "k_proj", "v_proj"), "o_proj"))
    with torch.no_grad():
        for label, owner, columns, row in owners:
            for attr in columns:
                lin = getattr(owner, attr)
                per = lin.out_features // world
                setattr(owner, attr, rows_of(lin, [(rank * per, (rank + 1) * per)], f"{prefix}{label}.{attr}"))
            lin = getattr(owner, row)
            per = lin.in_features // world
            setattr(owner, row, RowParallelLinear(cols_of(lin, rank * per, (rank + 1) * per, f"{prefix}{label}.{row}"),
                                                  world, getattr(lin, "source", "")))


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


def row_parallel_weight(m: torch.nn.Module) -> Optional[Weight]:
    """This rank's weight [out, in_local] (a tensor, or an ``fp8.Fp8Weight``) of a row-parallel projection whose forward is ``x @ w^T`` followed by a
    sum-all-reduce over all ranks: ``RowParallelLinear`` or DeepSpeed AutoTP's ``LinearAllreduce`` (bias-free,
    collectives not deferred to a compiler; deepspeed/module_inject/layers.py, DeepSpeed 0.19.8), without hooks.
    None for any other module."""
    if _hooked(m):
        return None
    if isinstance(m, RowParallelLinear):
        return m.local_weight()
    w = getattr(m, "weight", None)
    if (is_deepspeed_layer(m, "LinearAllreduce") and getattr(m, "bias", None) is None
            and isinstance(w, torch.Tensor) and w.dim() == 2
            and not getattr(m, "defer_collectives_to_compiler", False) and getattr(m, "mp_group", None) is not None):
        return w
    return None
