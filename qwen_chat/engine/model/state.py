"""The runner's static per-slot state: the KV cache of the full-attention layers and the conv and recurrent
state of the Gated DeltaNet layers, allocated once for ``num_slots + 1`` slots (the extra one is the scratch
slot that absorbs the padding rows of graph-padded batches).

Local widths (heads on this rank) are probed through the model's own, possibly sharded, projections, so the
same code sizes the state unsharded, under tensor parallelism and under ZeRO-3.  Memory per slot (bf16, full
config; docs/facts.md, "Per-token cost (batch 1 decode, bf16)"): 32 KiB of KV cache per token of context plus
48 MiB of fp32 recurrent state.
"""
from __future__ import annotations

from typing import Sequence

import torch

from qwen_chat.engine.model import gdn


class SlotState:
    """Per-layer geometry and state tensors of every slot.

    Args:
        layers: the text decoder's layers (``model.model.language_model.layers``).
        num_slots: live sequences; the tensors hold ``num_slots + 1`` slots (scratch slot ``num_slots``).
        max_context: tokens per slot of KV cache.
        hidden_size: input width of the projections (probed with one zero row).
        device, dtype: of the KV cache and the conv state (the recurrent state is fp32).

    Attributes:
        kinds: per layer, "linear" (Gated DeltaNet) or "full" (attention).
        geo: per layer, a dict of local widths: Gated DeltaNet ``dk, dv, K, conv_dim, key_dim, value_dim, nk,
            nv``; attention ``hd, nq, nkv, groups, scale``.
        k_cache, v_cache: layer index -> [slots + 1, nkv, max_context, hd] (dtype).
        conv_state: layer index -> [slots + 1, conv_dim, K] (dtype): the ring of the last K conv inputs per
            channel (``glue.gdn_step``).
        rec_state: layer index -> [slots + 1, nv, dv, dk] fp32: the recurrent state stored value-major, S^T
            (``glue.gdn_step``).

    Raises:
        RuntimeError: ZeRO-3 partitioned a Gated DeltaNet layer's ``conv1d``/``A_log`` (they must stay
            resident), or their widths do not match the projections' (an unsupported sharding).
    """

    @torch.no_grad()
    def __init__(self, layers: Sequence[torch.nn.Module], *, num_slots: int, max_context: int, hidden_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        S = num_slots + 1  # + scratch slot for padding rows
        T = max_context
        x = torch.zeros(1, hidden_size, device=device, dtype=dtype)
        self.kinds: list[str] = []
        self.geo: list[dict] = []
        self.k_cache: dict[int, torch.Tensor] = {}
        self.v_cache: dict[int, torch.Tensor] = {}
        self.conv_state: dict[int, torch.Tensor] = {}
        self.rec_state: dict[int, torch.Tensor] = {}
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
                self.kinds.append("linear")
                self.conv_state[i] = torch.zeros(S, conv_dim, K, device=device, dtype=dtype)
                self.rec_state[i] = torch.zeros(S, geo["nv"], dv, dk, device=device, dtype=torch.float32)
            else:
                at = layer.self_attn
                hd = at.head_dim
                nq = at.q_proj(x).shape[-1] // (2 * hd)
                nkv = at.k_proj(x).shape[-1] // hd
                geo = dict(hd=hd, nq=nq, nkv=nkv, groups=nq // nkv, scale=at.scaling)
                self.kinds.append("full")
                self.k_cache[i] = torch.zeros(S, nkv, T, hd, device=device, dtype=dtype)
                self.v_cache[i] = torch.zeros(S, nkv, T, hd, device=device, dtype=dtype)
            self.geo.append(geo)

    def gdn_kernel_fits(self, layers: Sequence[torch.nn.Module], zero3: bool) -> bool:
        """True when ``gdn.gdn_decode`` applies to every Gated DeltaNet layer: ``gdn.supports`` its state and
        activation, and its norm is ``Qwen3_5RMSNormGated``; never under ZeRO-3."""
        return not zero3 and all(
            gdn.supports(self.conv_state[i], self.rec_state[i], g["dk"], g["dv"], layers[i].linear_attn.activation)
            and type(layers[i].linear_attn.norm).__name__ == "Qwen3_5RMSNormGated"
            for i, g in enumerate(self.geo) if self.kinds[i] == "linear")
