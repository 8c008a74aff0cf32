"""Weight fusion: projections that read the same input become one GEMM over one weight matrix.

Each layer has two projection groups: ``"mix"``, the token mixer's input projections (Gated DeltaNet
``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``, or attention ``q_proj``/``k_proj``/``v_proj``), and
``"mlp"``, the MLP's ``gate_proj``/``up_proj``.  A group is fused when every module computes ``x @ weight^T`` on a
local weight (``is_local_linear``, or ``fp8.is_local_fp8`` for an FP8 layer); the modules' ``weight`` parameters
are rebound to row blocks (views) of the fused matrix, so the model keeps working unchanged and no memory is
added.  A group that mixes bf16 and FP8 layers (the Gated DeltaNet ``in_proj_qkv``/``in_proj_z`` in FP8,
``in_proj_b``/``in_proj_a`` in bf16, as the published FP8 checkpoint has them) is fused into one GEMM per run of
layers of one kind; FP8 layers are fused only on 128-row block boundaries (each layer but the run's last has a
multiple of 128 rows: otherwise its last scale block would also cover the next layer's rows), else they stay
separate.  4-bit layers (``int4.is_local_int4``) fuse whatever their row counts (their groups run along the
input).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from qwen_chat.engine.model.fp8 import BLOCK, Fp8Weight, Weight, blocks, is_local_fp8
from qwen_chat.engine.model.int4 import Int4Weight, is_local_int4
from qwen_chat.engine.parallel.tp_layers import column_parallel_weight

#: One layer's projection groups: group name -> the modules, in output order.
Groups = dict[str, list]
#: One GEMM of a fused group: (weight [sum(out_features), in_features] (a tensor or an ``Fp8Weight``), the
#: out_features of each module it covers).
Part = tuple[Weight, list[int]]
#: A fused group: its GEMMs in module order (one when every module is of one kind).
Fused = list[Part]


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


def _view(like: torch.Tensor, offset: int, shape: tuple[int, int]) -> torch.Tensor:
    """A contiguous view of ``like``'s storage at element ``offset`` with ``shape``."""
    return like.new_empty(0).set_(like.untyped_storage(), offset, shape, (shape[1], 1))


def fuse_fp8(mods: Sequence[torch.nn.Module]) -> Optional[tuple[Fp8Weight, list[int]]]:
    """``fuse_linears`` for FP8 layers (``fp8.is_local_fp8``): their data and block scales stacked by rows into one
    ``Fp8Weight`` and each layer rebound to its rows (views).  Only on block boundaries: every layer but the last
    must have a multiple of 128 rows; all on one device with one input width.  Called again on fused layers it
    returns the same storage.  Returns ``(weight, out_sizes)`` or None when they cannot be fused."""
    if len(mods) < 2 or not all(is_local_fp8(m) for m in mods):
        return None
    ws = [m.fp8_weight() for m in mods]
    if (len({(w.device, w.shape[1]) for w in ws}) != 1 or any(w.shape[0] % BLOCK for w in ws[:-1])
            or ws[0].device.type == "meta" or not all(w.data.is_contiguous() and w.scale.is_contiguous() for w in ws)):
        return None
    sizes = [int(w.shape[0]) for w in ws]
    n_in, kb = int(ws[0].shape[1]), int(ws[0].scale.shape[1])
    d0, s0 = ws[0].data, ws[0].scale
    data_at = [d0.storage_offset() + n_in * sum(sizes[:j]) for j in range(len(ws))]
    scale_at = [s0.storage_offset() + kb * (sum(sizes[:j]) // BLOCK) for j in range(len(ws))]
    shape, scale_shape = (sum(sizes), n_in), (blocks(sum(sizes)), kb)
    with torch.no_grad():
        if all(w.data.untyped_storage().data_ptr() == d0.untyped_storage().data_ptr() and w.data.storage_offset() == a
               and w.scale.untyped_storage().data_ptr() == s0.untyped_storage().data_ptr()
               and w.scale.storage_offset() == b for w, a, b in zip(ws, data_at, scale_at)):
            return Fp8Weight(_view(d0, data_at[0], shape), _view(s0, scale_at[0], scale_shape)), sizes
        return _rebound(mods, Fp8Weight.cat_rows(ws), sizes), sizes


def _rebound(mods: Sequence[torch.nn.Module], fused, sizes: Sequence[int]):
    """Rebind each quantized layer of ``mods`` to its rows of ``fused`` (an ``Fp8Weight`` or ``Int4Weight``
    stacked by rows, ``sizes`` rows each: views, so the layers share its storage).  Returns ``fused``."""
    start = 0
    for m, n in zip(mods, sizes):
        m.set_weight(fused.rows(start, start + n))
        start += n
    return fused


def _stacked(parts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A view of ``parts`` stacked by rows when they already lie one after the other in one storage, else
    None."""
    p0 = parts[0]
    at = p0.storage_offset()
    for p in parts:
        if (not p.is_contiguous() or p.untyped_storage().data_ptr() != p0.untyped_storage().data_ptr()
                or p.storage_offset() != at):
            return None
        at += p.numel()
    return _view(p0, p0.storage_offset(), (sum(int(p.shape[0]) for p in parts), int(p0.shape[1])))


def fuse_int4(mods: Sequence[torch.nn.Module]) -> Optional[tuple[Int4Weight, list[int]]]:
    """``fuse_linears`` for 4-bit layers (``int4.is_local_int4``): their packed values, scales and zero points
    stacked by rows into one ``Int4Weight`` (any row counts: the groups run along the input) and each layer
    rebound to its rows (views); all on one device with one input width.  Called again on fused layers it
    returns the same storage.  Returns ``(weight, out_sizes)`` or None when they cannot be fused."""
    if len(mods) < 2 or not all(is_local_int4(m) for m in mods):
        return None
    ws = [m.int4_weight() for m in mods]
    if len({(w.device, w.shape[1]) for w in ws}) != 1 or ws[0].device.type == "meta":
        return None
    sizes = [int(w.shape[0]) for w in ws]
    with torch.no_grad():
        views = [_stacked([getattr(w, f) for w in ws]) for f in ("packed", "scale", "zero")]
        if all(v is not None for v in views):
            return Int4Weight(*views), sizes
        return _rebound(mods, Int4Weight.cat_rows(ws), sizes), sizes


def _kind(m: torch.nn.Module) -> Optional[str]:
    return ("fp8" if is_local_fp8(m) else "int4" if is_local_int4(m) else "bf16" if is_local_linear(m)
            else None)


def _local_weight(m: torch.nn.Module) -> Weight:
    if is_local_fp8(m):
        return m.fp8_weight()
    if is_local_int4(m):
        return m.int4_weight()
    return m.weight if is_plain_linear(m) else column_parallel_weight(m)


def fuse_group(mods: Sequence[torch.nn.Module]) -> Optional[Fused]:
    """One group's GEMMs: each run of consecutive modules of one kind (bf16 ``is_local_linear``, FP8
    ``fp8.is_local_fp8``; an FP8 run also ends after a layer whose rows are not a multiple of 128) fused by
    ``fuse_linears`` / ``fuse_fp8``, a module left alone as its own part.  None when a module is neither kind
    (hooked, ZeRO-3, offloaded: every module is then called) or when nothing fuses."""
    kinds = [_kind(m) for m in mods]
    if len(mods) < 2 or None in kinds:
        return None
    runs: list[list] = [[mods[0]]]
    for prev, m, kind, prev_kind in zip(mods, mods[1:], kinds[1:], kinds):
        aligned = prev_kind != "fp8" or prev.out_features % BLOCK == 0
        if kind == prev_kind and aligned:
            runs[-1].append(m)
        else:
            runs.append([m])
    parts: Fused = []
    for run in runs:
        fuse = {"fp8": fuse_fp8, "int4": fuse_int4}.get(_kind(run[0]), fuse_linears)
        fused = fuse(run) if len(run) > 1 else None
        parts += [fused] if fused is not None else [(w, [int(w.shape[0])]) for w in map(_local_weight, run)]
    return parts if len(parts) < len(mods) else None


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
    """Every layer's projection groups and the GEMMs of each group that ``fuse_group`` fuses (none when
    ``enabled`` is false, e.g. under ZeRO-3).  Returns (groups per layer, {group: Fused} per layer)."""
    groups = [projection_groups(layer) for layer in layers]
    fused = [{} if not enabled else {k: f for k, mods in g.items() if (f := fuse_group(mods)) is not None}
             for g in groups]
    return groups, fused


def weight_of(m: torch.nn.Module) -> Optional[Weight]:
    """The weight a projection multiplies by when its forward is exactly ``x @ w^T``: an ``Fp8Linear``'s
    ``Fp8Weight``, an ``Int4Linear``'s ``Int4Weight``, else a plain bias-free ``nn.Linear``'s weight tensor; None
    for anything else."""
    if is_local_fp8(m):
        return m.fp8_weight()
    if is_local_int4(m):
        return m.int4_weight()
    return m.weight if is_plain_linear(m) else None


def dequant_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the largest dequantised FP8 or 4-bit weight a prefill step holds at once (its [N, K] temporary
    in ``dtype``): the largest group of such layers that read one input (``projection_groups``: fused into
    one GEMM) or the largest single one; 0 without quantised weights.  Part of the activation reserve
    (``runner_setup.size_memory``)."""
    def elems(m: torch.nn.Module) -> int:
        for attr in ("fp8_weight", "int4_weight"):
            get = getattr(m, attr, None)
            w = get() if callable(get) else None
            if isinstance(w, (Fp8Weight, Int4Weight)):
                return w.shape[0] * w.shape[1]
        return 0

    best = max((elems(m) for m in model.modules()), default=0)
    for layer in model.model.language_model.layers:
        for mods in projection_groups(layer).values():
            best = max(best, sum(elems(m) for m in mods))
    return best * dtype.itemsize
