"""The runner's per-sequence state: the paged KV cache of the full-attention layers (blocks of
``paged.BLOCK_TOKENS`` positions) and the conv and recurrent state of the Gated DeltaNet layers in a pool of
``num_slots + 1`` slots (the extra one is the scratch slot that absorbs the padding rows of graph-padded
batches).

Local widths (heads on this rank) are probed through the model's own, possibly sharded, projections
(``probe_geometry``), so the same code sizes the state unsharded, under tensor parallelism and under ZeRO-3,
and the memory budget (``memory.plan_memory``) can price a slot and a KV token before anything is allocated.
Memory (bf16, full config; docs/facts.md, "Per-token cost (batch 1 decode, bf16)"): 32 KiB of KV cache per
token plus 48 MiB of fp32 recurrent state per slot; with ``--kv-cache-dtype fp8`` 16.25 KiB of KV per token
(``kv_quant``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from qwen_chat.engine.model import gdn, kv_quant


@dataclass(frozen=True)
class Geometry:
    """Per-layer kinds and local widths of a model on this rank.

    ``kinds``: per layer "linear" (Gated DeltaNet) or "full" (attention).  ``geo``: per layer a dict of local
    widths: Gated DeltaNet ``dk, dv, K, conv_dim, key_dim, value_dim, nk, nv``; attention ``hd, nq, nkv,
    groups, scale``.  ``dtype``: the model's, of the conv state (the recurrent state is fp32); ``kv_dtype``: the
    KV cache's storage (None: ``dtype``; ``kv_quant.FP8`` adds a scale per position and KV head).
    """

    kinds: tuple
    geo: tuple
    dtype: torch.dtype
    kv_dtype: Optional[torch.dtype] = None

    @property
    def kv_storage(self) -> torch.dtype:
        """The KV cache's element dtype (``kv_dtype``, else the model's)."""
        return self.kv_dtype if self.kv_dtype is not None else self.dtype

    def _layers(self, kind: str):
        """The geometry dicts of the layers of ``kind`` ("linear" or "full")."""
        return [g for k, g in zip(self.kinds, self.geo) if k == kind]

    def slot_bytes(self) -> int:
        """Bytes of one slot's Gated DeltaNet state: conv ring (dtype) + fp32 recurrent state, all layers."""
        return sum(g["conv_dim"] * g["K"] * self.dtype.itemsize + g["nv"] * g["dv"] * g["dk"] * 4
                   for g in self._layers("linear"))

    def kv_token_bytes(self) -> int:
        """Bytes of KV cache per token of context: keys + values of every attention layer, as stored
        (``kv_quant.token_bytes``: FP8 elements and their scales, or the model's dtype)."""
        return sum(2 * kv_quant.token_bytes(g["nkv"], g["hd"], self.kv_storage) for g in self._layers("full"))

    def layer_kv_token_bytes(self, g: Optional[dict] = None) -> int:
        """Bytes of keys + values per token of one attention layer ``g`` (default: the widest), what a later
        prompt chunk holds per token of its sequence's past while it gathers them in the model's dtype
        (``kv_quant.gather_bytes``: with an FP8 cache, also one gathered FP8 copy)."""
        if g is None:
            return max((self.layer_kv_token_bytes(x) for x in self._layers("full")), default=0)
        return kv_quant.gather_bytes(g["nkv"], g["hd"], self.dtype, self.kv_storage)

    def query_heads(self) -> int:
        """Local query heads of the widest attention layer (sizes the decode attention's score buffer)."""
        return max((g["nq"] for g in self._layers("full")), default=0)

    def conv_width(self) -> int:
        """Channels of the widest Gated DeltaNet conv (``conv_dim``)."""
        return max((g["conv_dim"] for g in self._layers("linear")), default=0)


@torch.no_grad()
def probe_geometry(layers: Sequence[torch.nn.Module], *, hidden_size: int, device: torch.device,
                   dtype: torch.dtype, kv_dtype: Optional[torch.dtype] = None) -> Geometry:
    """Probe each layer's local widths with one zero row through its (possibly sharded) projections
    (``kv_dtype``: the KV cache's storage, ``Geometry.kv_dtype``).

    Raises RuntimeError: ZeRO-3 partitioned a Gated DeltaNet layer's ``conv1d``/``A_log`` (they must stay
    resident), or their widths do not match the projections' (an unsupported sharding).
    """
    x = torch.zeros(1, hidden_size, device=device, dtype=dtype)
    kinds, geos = [], []
    for i, layer in enumerate(layers):
        if hasattr(layer, "linear_attn"):
            la = layer.linear_attn
            dk, dv, K = la.head_k_dim, la.head_v_dim, la.conv_kernel_size
            conv_dim = la.in_proj_qkv(x).shape[-1]
            value_dim = la.in_proj_z(x).shape[-1]
            key_dim = (conv_dim - value_dim) // 2
            geo = dict(dk=dk, dv=dv, K=K, conv_dim=conv_dim, key_dim=key_dim, value_dim=value_dim,
                       nk=key_dim // dk, nv=value_dim // dv)
            w = la.conv1d.weight
            if w.numel() == 0 or la.A_log.numel() == 0:
                raise RuntimeError(
                    "Gated DeltaNet conv1d/A_log are partitioned (ZeRO-3): raise "
                    "stage3_param_persistence_threshold above their size so they stay resident")
            if w.shape[0] != conv_dim or la.A_log.numel() != geo["nv"] or la.dt_bias.numel() != geo["nv"]:
                raise RuntimeError(
                    f"layer {i}: conv1d/A_log/dt_bias ({w.shape[0]}, {la.A_log.numel()}) do not match the "
                    f"projection widths ({conv_dim}, {geo['nv']} value heads): unsupported sharding")
            kinds.append("linear")
        else:
            at = layer.self_attn
            hd = at.head_dim
            nq = at.q_proj(x).shape[-1] // (2 * hd)
            nkv = at.k_proj(x).shape[-1] // hd
            geo = dict(hd=hd, nq=nq, nkv=nkv, groups=nq // nkv, scale=at.scaling)
            kinds.append("full")
        geos.append(geo)
    return Geometry(tuple(kinds), tuple(geos), dtype, kv_dtype if kv_dtype != dtype else None)


class SlotState:
    """State tensors of every slot and every KV block.

    Args:
        geometry: ``probe_geometry``'s result.
        num_slots: live sequences; the slot tensors hold ``num_slots + 1`` slots (scratch slot ``num_slots``).
        num_blocks: KV blocks (``paged.BLOCK_TOKENS`` positions each); the caches hold ``num_blocks + 1`` (the
            null block ``num_blocks``).
        block_tokens: positions per block.
        device: of every tensor.

    Attributes:
        kinds, geo: as ``Geometry``.
        k_cache, v_cache: layer index -> [num_blocks + 1, block_tokens, nkv, hd] (``Geometry.kv_storage``);
            position p of a sequence lives in block ``table[p // block_tokens]`` at offset ``p % block_tokens``.
        k_scale, v_scale: layer index -> [num_blocks + 1, block_tokens, nkv] fp32, the FP8 cache's scales
            (``kv_quant``); empty for a cache in the model's dtype.
        conv_state: layer index -> [slots + 1, conv_dim, K] (dtype): the ring of the last K conv inputs per
            channel (``glue.gdn_step``).
        rec_state: layer index -> [slots + 1, nv, dv, dk] fp32: the recurrent state stored value-major, S^T
            (``glue.gdn_step``).
    """

    @torch.no_grad()
    def __init__(self, geometry: Geometry, *, num_slots: int, num_blocks: int, block_tokens: int,
                 device: torch.device) -> None:
        S = num_slots + 1  # + the scratch slot for padding rows
        dtype = geometry.dtype
        self.kinds, self.geo = list(geometry.kinds), list(geometry.geo)
        self.k_cache: dict[int, torch.Tensor] = {}
        self.v_cache: dict[int, torch.Tensor] = {}
        self.k_scale: dict[int, torch.Tensor] = {}
        self.v_scale: dict[int, torch.Tensor] = {}
        kv = geometry.kv_storage
        self.conv_state: dict[int, torch.Tensor] = {}
        self.rec_state: dict[int, torch.Tensor] = {}
        for i, (kind, g) in enumerate(zip(self.kinds, self.geo)):
            if kind == "linear":
                self.conv_state[i] = torch.zeros(S, g["conv_dim"], g["K"], device=device, dtype=dtype)
                self.rec_state[i] = torch.zeros(S, g["nv"], g["dv"], g["dk"], device=device, dtype=torch.float32)
            else:
                shape = (num_blocks + 1, block_tokens, g["nkv"], g["hd"])
                self.k_cache[i] = torch.zeros(shape, device=device, dtype=kv)
                self.v_cache[i] = torch.zeros(shape, device=device, dtype=kv)
                if kv_quant.is_quantized(kv):
                    self.k_scale[i] = torch.zeros(shape[:-1], device=device, dtype=torch.float32)
                    self.v_scale[i] = torch.zeros(shape[:-1], device=device, dtype=torch.float32)

    def gdn_kernel_fits(self, layers: Sequence[torch.nn.Module], zero3: bool) -> bool:
        """True when ``gdn.gdn_decode`` applies to every Gated DeltaNet layer: ``gdn.supports`` its state and
        activation, and its norm is ``Qwen3_5RMSNormGated``; never under ZeRO-3."""
        return not zero3 and all(
            gdn.supports(self.conv_state[i], self.rec_state[i], g["dk"], g["dv"], layers[i].linear_attn.activation)
            and type(layers[i].linear_attn.norm).__name__ == "Qwen3_5RMSNormGated"
            for i, g in enumerate(self.geo) if self.kinds[i] == "linear")
