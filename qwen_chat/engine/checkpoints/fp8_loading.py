"""FP8 weights into the engine: an FP8 checkpoint's tensors as ``fp8.Fp8Linear`` modules, ``--quantize fp8`` of a
bf16 model, and the writer of an FP8 folder in the published layout (the tiny model's, for tests).

Loading (``loading.load_model`` for a folder whose ``layout.inspect_checkpoint`` found an ``Fp8Spec``): transformers
5.x's own FP8 quantizer (``FineGrainedFP8HfQuantizer``) dequantises to bf16 without a GPU and needs one (compute
capability >= 8.9) to keep FP8, so ``from_pretrained`` runs with the ``quantization_config`` taken out of the
config (``config_without_quantization``) and the scale tensors ignored (``scales_ignored``): it then loads each F8
weight cast to the load dtype, which is exact (every e4m3 value is a bf16 and an fp32 value).
``convert_fp8_modules`` turns those modules into ``Fp8Linear`` (the cast back to e4m3 is exact too) with the
block scales read from the shards, before the model is moved to its device, so no bf16 copy of them ever
reaches the GPU.

``quantize_model`` (``--quantize fp8``) quantises, in place, every linear layer of the text decoder that the
published export quantises (``fp8_format.default_not_convert`` names the rest), with ``fp8.quantize_blocks``,
one layer at a time on the given device; each bf16 weight is released as its FP8 replacement takes its place.
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qwen_chat.engine.checkpoints.fp8_format import (
    ACTIVATION_SCHEME, BLOCK_SIZE, FMT, QUANT_METHOD, SCALE_SUFFIX, TEXT_PREFIX, WEIGHT_SUFFIX, Fp8Spec, canonical,
    default_not_convert, excluded)
from qwen_chat.engine.checkpoints.layout import INDEX_FILE, CheckpointError, CheckpointReport
from qwen_chat.engine.model.fp8 import FP8_DTYPE, Fp8Linear, Fp8Weight, quantize_blocks

#: Unexpected checkpoint keys ``from_pretrained`` should not report while an FP8 checkpoint loads.
_SCALE_KEYS = r"\.weight_scale_inv$"


def config_without_quantization(path: Path):
    """``AutoConfig`` of the folder with ``quantization_config`` removed (top level and ``text_config``), so
    ``from_pretrained(path, config=...)`` loads plainly, without transformers' quantizer."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    for cfg in (config, config.get_text_config()):
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    return config


@contextlib.contextmanager
def scales_ignored(model_class) -> Iterator[None]:
    """While loading ``model_class``: ``weight_scale_inv`` keys are ignored as unexpected (no report of hundreds
    of keys; ``convert_fp8_modules`` reads them).  Restores the class attribute after."""
    name = "_keys_to_ignore_on_load_unexpected"
    own = model_class.__dict__.get(name)  # None: inherited from Qwen3_5PreTrainedModel
    setattr(model_class, name, list(getattr(model_class, name) or []) + [_SCALE_KEYS])
    try:
        yield
    finally:
        if own is None:
            delattr(model_class, name)
        else:
            setattr(model_class, name, own)


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _linear(model: torch.nn.Module, name: str, where: Path) -> torch.nn.Linear:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise CheckpointError(f"{where}: {name}{WEIGHT_SUFFIX} is FP8 but the model has no module {name}") from None
    if not isinstance(module, torch.nn.Linear) or module.bias is not None:
        raise CheckpointError(f"{where}: {name}{WEIGHT_SUFFIX} is FP8 but {name} is a {type(module).__name__}"
                              f"{' with a bias' if isinstance(module, torch.nn.Linear) else ''} (only bias-free "
                              "linear layers can hold FP8 weights)")
    return module


@torch.no_grad()
def convert_fp8_modules(model: torch.nn.Module, report: CheckpointReport) -> list[str]:
    """Replace each linear layer that the checkpoint stores in F8 (``report.fp8.modules``) with an ``Fp8Linear``
    holding its weight (cast back to float8_e4m3fn, exact) and its block scales (read from the shards, as fp32),
    on the weight's device.  Returns the converted module names.  Raises CheckpointError (naming the shard) for
    a name that is not a bias-free ``nn.Linear`` of the model, or e4m3 values the load did not keep exactly."""
    spec: Fp8Spec = report.fp8
    by_shard: dict[str, list[str]] = {}  # scales grouped by the shard that holds them: each opened once
    for name in spec.modules:
        by_shard.setdefault(report.shard_of[name + SCALE_SUFFIX], []).append(name)
    for shard, names in sorted(by_shard.items()):
        with safe_open(str(report.folder / shard), "pt") as f:
            for name in names:
                where = report.folder / report.shard_of[name + WEIGHT_SUFFIX]
                module = _linear(model, name, where)
                data = module.weight.data.to(FP8_DTYPE)
                if not torch.equal(data.to(module.weight.dtype), module.weight.data):
                    raise CheckpointError(f"{where}: {name}{WEIGHT_SUFFIX} did not load as exact e4m3 values")
                scale = f.get_tensor(name + SCALE_SUFFIX).float().to(data.device)
                _replace(model, name, Fp8Linear(Fp8Weight(data, scale)))
    return list(spec.modules)


def quantizable(model: torch.nn.Module, not_convert: Optional[Sequence[str]] = None) -> list[str]:
    """Names of the linear layers ``quantize_model`` converts: the bias-free ``nn.Linear`` modules of the text
    decoder's layers (either spelling: ``Qwen3_5ForConditionalGeneration`` or a text-only ``Qwen3_5ForCausalLM``)
    that ``not_convert`` (default ``default_not_convert`` of the model's layer types) does not name."""
    if not_convert is None:
        not_convert = default_not_convert(model.config.get_text_config().layer_types)
    return [name for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and m.bias is None and canonical(name).startswith(TEXT_PREFIX + "layers.")
            and not excluded(name, not_convert)]


@torch.no_grad()
def quantize_model(model: torch.nn.Module, *, device: Optional[torch.device] = None,
                   not_convert: Optional[Sequence[str]] = None) -> list[str]:
    """``--quantize fp8``: replace every ``quantizable`` layer with an ``Fp8Linear`` of its weight quantised in
    128 x 128 blocks (``fp8.quantize_blocks``), computed on ``device`` (default: the weight's) where the FP8
    weight then stays; each bf16 weight is released when its layer is replaced.  Layers already FP8 are left
    as they are.  Returns the quantised module names."""
    names = quantizable(model, not_convert)
    for name in names:
        module = model.get_submodule(name)
        weight = module.weight.to(device) if device is not None else module.weight
        _replace(model, name, Fp8Linear(quantize_blocks(weight)))
        del module, weight
    return names


def write_fp8_checkpoint(src: Path, dst: Path, *, not_convert: Optional[Sequence[str]] = None,
                         scale_dtype: torch.dtype = torch.float32) -> Path:
    """Write the bf16 checkpoint folder ``src`` (the published layout, e.g. the tiny model's) as an FP8 one in
    ``dst`` (created; replaced when it exists): the text decoder's linear weights that ``not_convert`` (default
    ``default_not_convert``) does not name become F8_E4M3 with a ``weight_scale_inv`` [ceil(N/128),
    ceil(K/128)] in ``scale_dtype`` beside them in the same shard, the index lists the scales, and config.json
    gets the ``quantization_config`` of the published FP8 export.  Every other file is copied.  Returns ``dst``."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    if not_convert is None:
        not_convert = default_not_convert(text["layer_types"])
    index = json.loads((src / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    total = 0
    for shard in sorted(set(weight_map.values())):
        tensors = load_file(str(src / shard))
        out = {}
        for name, t in tensors.items():
            module = name[:-len(WEIGHT_SUFFIX)]
            if (name.endswith(WEIGHT_SUFFIX) and t.dim() == 2 and canonical(module).startswith(TEXT_PREFIX + "layers.")
                    and not excluded(module, not_convert)):
                q = quantize_blocks(t)
                out[name], out[module + SCALE_SUFFIX] = q.data, q.scale.to(scale_dtype)
                weight_map[module + SCALE_SUFFIX] = shard
            else:
                out[name] = t
        total += sum(v.numel() * v.element_size() for v in out.values())
        save_file(out, str(dst / shard), metadata={"format": "pt"})
    index["metadata"] = {"total_size": total}
    (dst / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "activation_scheme": ACTIVATION_SCHEME,
                                     "fmt": FMT, "weight_block_size": list(BLOCK_SIZE),
                                     "modules_to_not_convert": list(not_convert)}
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return dst
