"""4-bit weights into the engine: a GPTQ / AWQ / compressed-tensors checkpoint's layers as ``int4.Int4Linear``,
``--quantize int4`` of a bf16 model, and the writer of a 4-bit folder in each format (the tests' checkpoints).

Loading (``loading.load_model`` for a folder whose ``layout.inspect_checkpoint`` found an ``Int4Spec``):
transformers' own GPTQ / AWQ / compressed-tensors quantizers need packages the service does not install
(optimum + gptqmodel, compressed-tensors) and a GPU for their kernels, so ``from_pretrained`` runs with the
``quantization_config`` taken out of the config (``fp8_loading.config_without_quantization``) and the 4-bit
tensors ignored (``int4_keys_ignored``); the quantised layers' ``.weight`` is then missing and left
uninitialised (``transformers.initialization.no_init_weights``: no random fill of memory that is replaced
next).  ``convert_int4_modules`` turns each of those layers into an ``Int4Linear`` from its tensors read from
the shards (``decode``: the format's packing to the engine's, module docstring of ``int4_format``), before the
model moves to its device.

``quantize_model`` (``--quantize int4``) quantises, in place, each linear layer of the text decoder that the
published FP8 export quantises (``fp8_loading.quantizable``) and whose input width is a multiple of 128, with
``int4.quantize_groups`` (asymmetric round-to-nearest in groups of 128), one layer at a time on the device.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qwen_chat.engine.checkpoints.fp8_format import canonical
from qwen_chat.engine.checkpoints.fp8_loading import _replace, quantizable
from qwen_chat.engine.checkpoints.int4_format import AWQ_ORDER, GROUP_SIZE, MARKER, SUFFIXES, Int4Spec
from qwen_chat.engine.checkpoints.layout import INDEX_FILE, CheckpointError, CheckpointReport, inspect_checkpoint
from qwen_chat.engine.model.int4 import GROUP, Int4Linear, Int4Weight, pack, quantize_groups, unpack

_AWQ_INVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))  # column 8c + j sits at nibble _AWQ_INVERSE[j]


def _unpack_cols(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] packed along the last dimension -> uint8 [R, C] (``int4.unpack``)."""
    return unpack(words.to(torch.int32).contiguous())


def _check_g_idx(g_idx: Optional[torch.Tensor], k: int, where: str) -> None:
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(k) // GROUP_SIZE):
        raise CheckpointError(f"{where}: the group index is not k // {GROUP_SIZE} (activation order, desc_act); "
                              "not supported: use an export with desc_act false, or a bf16 checkpoint with "
                              "--quantize int4")


def decode(spec: Int4Spec, t: dict[str, torch.Tensor], where: str) -> Int4Weight:
    """One layer's stored tensors ``t`` (suffix -> tensor, e.g. ".qweight") in ``spec``'s format as the engine's
    ``Int4Weight`` (``int4_format`` module docstring; exact: the values, zero points and fp16/bf16 scales are
    kept).  Raises CheckpointError naming ``where`` for a group index other than k // 128 or a symmetric
    checkpoint's stored zero point that is not zero."""
    if spec.method == "compressed-tensors":
        n, k = (int(d) for d in t[".weight_shape"].tolist())
        _check_g_idx(t.get(".weight_g_idx"), k, where)
        packed = t[".weight_packed"].to(torch.int32).contiguous()
        scale = t[".weight_scale"].float().contiguous()
        if spec.symmetric:
            if ".weight_zero_point" in t and bool(t[".weight_zero_point"].ne(0).any()):
                raise CheckpointError(f"{where}: a symmetric layer stores a weight_zero_point that is not zero")
            zero = torch.full(scale.shape, 8, dtype=torch.uint8)
        else:
            zero = _unpack_cols(t[".weight_zero_point"].t()).t().contiguous()
        return Int4Weight(packed, scale, zero)
    scales = t[".scales"].float()
    if spec.method == "gptq":
        k = t[".qweight"].shape[0] * 8
        _check_g_idx(t.get(".g_idx"), k, where)
        packed = t[".qweight"].to(torch.int32).t().contiguous()            # [N, K/8], packed along K as ours
        zeros = _unpack_cols(t[".qzeros"]).to(torch.int16)                    # [G, N]
        if spec.zeros_minus_one:
            zeros = zeros + 1
    else:  # awq: [K, N/8] and [G, N/8] packed along N in AWQ_ORDER
        raw = _unpack_cols(t[".qweight"])                                     # [K, N] in packing order
        k, n = raw.shape
        q = raw.view(k, n // 8, 8)[:, :, list(_AWQ_INVERSE)].reshape(k, n)
        packed = pack(q.t().contiguous())
        zraw = _unpack_cols(t[".qzeros"])
        zeros = zraw.view(zraw.shape[0], n // 8, 8)[:, :, list(_AWQ_INVERSE)].reshape(zraw.shape[0], n)
    return Int4Weight(packed, scales.t().contiguous(), zeros.to(torch.uint8).t().contiguous())


def encode(w: Int4Weight, method: str, symmetric: bool, scale_dtype: torch.dtype = torch.float16,
           zeros_minus_one: bool = True) -> dict[str, torch.Tensor]:
    """``w`` in ``method``'s stored layout (the inverse of ``decode``): suffix -> tensor.  ``symmetric`` requires
    zero points of 8; GPTQ with ``zeros_minus_one`` (v1) requires them >= 1.  Scales are stored in
    ``scale_dtype`` (``w.scale`` should be representable in it for an exact round trip).  Raises ValueError
    when the zero points do not fit the format."""
    n, k = w.shape
    zero = w.zero
    if symmetric and bool(zero.ne(8).any()):
        raise ValueError("encode: a symmetric format needs every zero point to be 8")
    if method == "compressed-tensors":
        out = {".weight_packed": w.packed.clone(), ".weight_scale": w.scale.to(scale_dtype),
               ".weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if not symmetric:
            out[".weight_zero_point"] = pack(zero.t().contiguous()).t().contiguous()
        return out
    scales = w.scale.t().contiguous().to(scale_dtype)
    q = unpack(w.packed)                                                      # [N, K]
    if method == "gptq":
        z = zero.t().to(torch.int16) - (1 if zeros_minus_one else 0)
        if bool((z < 0).any()):
            raise ValueError("encode: a zero point of 0 cannot be stored in GPTQ v1 (zero - 1 < 0)")
        return {".qweight": w.packed.t().contiguous(), ".qzeros": pack(z.contiguous()), ".scales": scales,
                ".g_idx": (torch.arange(k) // GROUP_SIZE).to(torch.int32)}
    order = list(AWQ_ORDER)
    qt = q.t().contiguous().view(k, n // 8, 8)[:, :, order].reshape(k, n)
    zt = zero.t().contiguous()
    zt = zt.view(zt.shape[0], n // 8, 8)[:, :, order].reshape(zt.shape[0], n)
    return {".qweight": pack(qt), ".qzeros": pack(zt.contiguous()), ".scales": scales}


@contextlib.contextmanager
def int4_keys_ignored(model_class, spec: Int4Spec) -> Iterator[None]:
    """While loading ``model_class``: the 4-bit tensors of ``spec``'s format are ignored as unexpected keys (no
    report of hundreds of keys; ``convert_int4_modules`` reads them), the 4-bit layers' ``.weight`` is not reported
    missing, and weights left missing are not filled with random values
    (``transformers.initialization.no_init_weights``).  Restores the class attributes after."""
    from transformers.initialization import no_init_weights

    patterns = {"_keys_to_ignore_on_load_unexpected": r"\.(" + "|".join(s[1:] for s in SUFFIXES[spec.method]) + r")$",
                "_keys_to_ignore_on_load_missing": r"^(" + "|".join(re.escape(canonical(m)) for m in spec.modules)
                + r")\.weight$"}
    own = {name: model_class.__dict__.get(name) for name in patterns}
    for name, pattern in patterns.items():
        setattr(model_class, name, list(getattr(model_class, name) or []) + [pattern])
    try:
        with no_init_weights():
            yield
    finally:
        for name, value in own.items():
            if value is None:
                delattr(model_class, name)
            else:
                setattr(model_class, name, value)


def missing_besides_int4(missing: Sequence[str], spec: Int4Spec) -> list[str]:
    """The ``missing_keys`` of a load other than the ``.weight`` of the checkpoint's 4-bit layers (either
    spelling of the text decoder)."""
    expected = {canonical(m) + ".weight" for m in spec.modules}
    return [k for k in missing if canonical(k) not in expected]


@torch.no_grad()
def convert_int4_modules(model: torch.nn.Module, report: CheckpointReport) -> list[str]:
    """Replace each layer the checkpoint stores in 4 bits (``report.int4.modules``) with an ``Int4Linear`` of its
    tensors read from the shards (``decode``), on the CPU.  Returns the converted module names.  Raises
    CheckpointError (naming the shard) for a name that is not a bias-free ``nn.Linear`` of the model, a shape
    other than the module's, or the refusals of ``decode``."""
    spec: Int4Spec = report.int4
    marker = MARKER[spec.method]
    by_shard: dict[str, list[str]] = {}
    for name in spec.modules:
        by_shard.setdefault(report.shard_of[name + marker], []).append(name)
    handles: dict[str, object] = {}
    try:
        for shard, names in sorted(by_shard.items()):
            for name in names:
                where = str(report.folder / shard)
                stored = {}
                for suffix in SUFFIXES[spec.method]:
                    if name + suffix in report.tensors:
                        file = report.shard_of[name + suffix]
                        if file not in handles:
                            handles[file] = safe_open(str(report.folder / file), "pt").__enter__()
                        stored[suffix] = handles[file].get_tensor(name + suffix)
                try:
                    module = model.get_submodule(canonical(name))
                except AttributeError:
                    raise CheckpointError(f"{where}: {name} is 4-bit but the model has no module {name}") from None
                if type(module) is not torch.nn.Linear or module.bias is not None:
                    raise CheckpointError(f"{where}: {name} is 4-bit but it is a {type(module).__name__} (only "
                                          "bias-free linear layers can hold 4-bit weights)")
                w = decode(spec, stored, f"{where}: {name}")
                if tuple(w.shape) != (module.out_features, module.in_features):
                    raise CheckpointError(f"{where}: {name} is a 4-bit [{w.shape[0]}, {w.shape[1]}] weight but the "
                                          f"model's layer is [{module.out_features}, {module.in_features}]")
                _replace(model, canonical(name), Int4Linear(w, source=spec.method))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return list(spec.modules)


def int4_quantizable(model: torch.nn.Module) -> list[str]:
    """The layers ``--quantize int4`` converts: ``fp8_loading.quantizable`` (the text decoder's linear layers
    that the published FP8 export quantises) whose input width is a multiple of 128."""
    return [n for n in quantizable(model) if model.get_submodule(n).in_features % GROUP == 0]


@torch.no_grad()
def quantize_model(model: torch.nn.Module, *, device: Optional[torch.device] = None) -> list[str]:
    """``--quantize int4``: replace every ``int4_quantizable`` layer with an ``Int4Linear`` of its weight quantised
    by ``int4.quantize_groups``, computed on ``device`` (default: the weight's) where the 4-bit weight then
    stays; each bf16 weight is released when its layer is replaced.  Returns the quantised module names."""
    names = int4_quantizable(model)
    for name in names:
        module = model.get_submodule(name)
        weight = module.weight.to(device) if device is not None else module.weight
        _replace(model, name, Int4Linear(quantize_groups(weight), source="--quantize int4"))
        del module, weight
    return names


def _format_config(method: str, symmetric: bool, not_convert: Sequence[str], gptq_format: str) -> dict:
    """The ``quantization_config`` a public export of ``method`` declares (``int4_format`` docstring)."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "desc_act": False, "sym": symmetric,
                "checkpoint_format": gptq_format, "modules_to_not_convert": list(not_convert)}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": list(not_convert)}
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP_SIZE,
               "dynamic": False, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": list(not_convert), "kv_cache_scheme": None, "sparsity_config": {}}


def write_int4_checkpoint(src: Path, dst: Path, method: str, *, symmetric: bool = False,
                          gptq_format: str = "gptq") -> tuple[Path, dict[str, Int4Weight]]:
    """Write the bf16/fp32 checkpoint folder ``src`` as a 4-bit one of ``method`` ("gptq", "awq",
    "compressed-tensors") in ``dst`` (replaced when it exists): each text-decoder linear weight that the
    published FP8 export quantises (``fp8_format.default_not_convert`` names the rest) and whose input width is
    a multiple of 128 is quantised by ``int4.quantize_groups`` (``symmetric``: zero point 8, scale amax / 7.5,
    as GPTQ's symmetric quantiser) with its scales rounded to fp16 (AWQ, GPTQ) or bf16 (compressed-tensors) and
    stored in the format's tensors in the same shard; config.json gets the format's ``quantization_config``;
    other files are copied.  Returns (``dst``, module name -> the ``Int4Weight`` the folder encodes)."""
    from qwen_chat.engine.checkpoints.fp8_format import TEXT_PREFIX, default_not_convert, excluded

    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    report = inspect_checkpoint(src)
    config = json.loads((src / "config.json").read_text())
    not_convert = default_not_convert(config.get("text_config", config)["layer_types"])
    scale_dtype = torch.bfloat16 if method == "compressed-tensors" else torch.float16
    written: dict[str, Int4Weight] = {}
    weight_map = {}
    for shard in report.shards:
        out = {}
        for name, t in load_file(str(src / shard)).items():
            module = name[:-len(".weight")]
            if (name.endswith(".weight") and t.dim() == 2 and t.shape[1] % GROUP == 0 and t.shape[0] % 8 == 0
                    and canonical(module).startswith(TEXT_PREFIX + "layers.") and not excluded(module, not_convert)):
                w = quantize_groups(t, symmetric=symmetric)
                w = Int4Weight(w.packed, w.scale.to(scale_dtype).float(), w.zero)
                for suffix, v in encode(w, method, symmetric, scale_dtype, gptq_format == "gptq").items():
                    out[module + suffix] = v
                written[module] = w
            else:
                out[name] = t
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        weight_map.update((n, shard) for n in out)
    if (src / INDEX_FILE).is_file():
        (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config["quantization_config"] = _format_config(method, symmetric, not_convert, gptq_format)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return dst, written
