"""Weight fusion: projections that read the same input become one GEMM over one weight matrix.

Each layer has two projection groups: ``"mix"``, the token mixer's input projections (Gated DeltaNet
``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``, or attention ``q_proj``/``k_proj``/``v_proj``), and
``"mlp"``, the MLP's ``gate_proj``/``up_proj``.  A group is fused when every module computes ``x @ weight^T`` on a
local weight (``is_local_linear``); the modules' ``weight`` parameters are rebound to row blocks (views) of the
fused matrix, so the model keeps working unchanged and no memory is added.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from qwen_chat.engine.parallel.tp_layers import column_parallel_weight

#: One layer's projection groups: group name -> the modules, in output order.
Groups = dict[str, list]
#: A fused group: (weight [sum(out_features), in_features], out_features of each module).
Fused = tuple[torch.Tensor, list[int]]


def is_plain_linear(m: torch.nn.Module) -> bool:
    """A bias-free ``torch.nn.Linear`` itself (not a sharded subclass or replacement) without forward hooks or
    accelerate's ``_hf_hook`` (its device-map/offload wrapper, which moves the weight on call): its weight
    may be read directly."""
    return (type(m) is torch.nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
            and not hasattr(m, "_hf_hook"))


def is_local_linear(m: torch.nn.Module) -> bool:
    """A projection whose forward is exactly ``x @ m.weight^T`` on this rank's weight [out, in]: a plain
    ``nn.Linear`` (``is_plain_linear``) or DeepSpeed AutoTP's column-parallel ``LinearLayer`` without bias,
    gathered output or overlapped communication (``tp_layers.column_parallel_weight``)."""
    return is_plain_linear(m) or column_parallel_weight(m) is not None


def fuse_linears(mods: Sequence[torch.nn.Module]) -> Optional[Fused]:
    """Put the weights of projections that read the same input into one matrix, so one GEMM replaces several.

    Applies only when every module computes ``x @ weight^T`` on a local weight (``is_local_linear``: a plain
    ``torch.nn.Linear`` without bias or hooks, or DeepSpeed AutoTP's column-parallel ``LinearLayer``), all on one
    (real) device and dtype with the same input width (not to hooked or ZeRO-3 modules, nor to
    accelerate-offloaded ones).  The fused matrix
    [sum(out_features), in_features] is built once and each module's ``weight`` is rebound to its row block (a
    view), so the model keeps working unchanged and no memory is added; called again on already-fused modules
    it returns the same storage.

    Returns ``(weight, out_sizes)`` (``F.linear(x, weight).split(out_sizes, -1)`` equals ``[m(x) for m in mods]``)
    or None when the modules cannot be fused.
    """
    if len(mods) < 2 or not all(is_local_linear(m) for m in mods):
        return None
    ws = [m.weight for m in mods]
    if (len({(w.device, w.dtype, w.shape[1]) for w in ws}) != 1 or ws[0].device.type == "meta"
            or not all(w.is_contiguous() for w in ws)):
        return None
    sizes = [int(w.shape[0]) for w in ws]
    n_in = int(ws[0].shape[1])
    storage = ws[0].untyped_storage()
    offsets = [ws[0].storage_offset() + n_in * sum(sizes[:j]) for j in range(len(ws))]
    with torch.no_grad():
        if all(w.untyped_storage().data_ptr() == storage.data_ptr() and w.storage_offset() == o
               for w, o in zip(ws, offsets)):  # fused before (another runner on the same model)
            fused = ws[0].new_empty(0).set_(storage, offsets[0], (sum(sizes), n_in), (n_in, 1))
            return fused, sizes
        fused = torch.cat([w.detach() for w in ws], dim=0)
        start = 0
        for m, n in zip(mods, sizes):
            m.weight = torch.nn.Parameter(fused[start:start + n], requires_grad=m.weight.requires_grad)
            start += n
    return fused, sizes


def projection_groups(layer: torch.nn.Module) -> Groups:
    """The projection groups of one decoder layer: ``{"mix": [...], "mlp": [gate_proj, up_proj]}``."""
    if hasattr(layer, "linear_attn"):
        la = layer.linear_attn
        groups = {"mix": [la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a]}
    else:
        at = layer.self_attn
        groups = {"mix": [at.q_proj, at.k_proj, at.v_proj]}
    groups["mlp"] = [layer.mlp.gate_proj, layer.mlp.up_proj]
    return groups


def fuse_layers(layers: Sequence[torch.nn.Module], enabled: bool = True) -> tuple[list[Groups], list[dict[str, Fused]]]:
    """Every layer's projection groups and the fused weight of each group that ``fuse_linears`` accepts (none
    when ``enabled`` is false, e.g. under ZeRO-3).  Returns (groups per layer, {group: (weight, sizes)} per
    layer)."""
    groups = [projection_groups(layer) for layer in layers]
    fused = [{} if not enabled else {k: f for k, mods in g.items() if (f := fuse_linears(mods)) is not None}
             for g in groups]
    return groups, fused
