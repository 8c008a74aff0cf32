"""LoRA adapters (``--adapter DIR``): read a PEFT adapter folder, check it against the base model, merge it.

Folder, as peft's ``save_pretrained`` and MS-SWIFT write it: ``adapter_config.json`` (``peft_type`` ``LORA``,
``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``, ``rank_pattern``/``alpha_pattern``, ...) and
``adapter_model.safetensors`` with, per adapted ``nn.Linear``, ``base_model.model.<module>.lora_A.weight``
[r, in_features] and ``...lora_B.weight`` [out_features, r].  ``<module>`` is a module name of
``Qwen3_5ForConditionalGeneration`` (``model.language_model.layers.0.linear_attn.in_proj_qkv``); names of a
text-only ``Qwen3_5ForCausalLM`` (``model.layers.0...``) are mapped onto ``model.language_model.`` the way
transformers maps that model's checkpoints.

Merge (peft's ``LoraLayer.get_delta_weight``): W += s * (B @ A), s = alpha / r, or alpha / sqrt(r) with
``use_rslora`` (rank-stabilised LoRA, Kalajdzievski 2023); per-module r and alpha from ``rank_pattern`` /
``alpha_pattern`` with peft's matching rule (``get_pattern_key``: the pattern matches the end of the module
name at a dot).  ``fan_in_fan_out`` only describes GPT-2-style ``Conv1D`` weights; peft turns it off for
``nn.Linear`` (all Qwen3.5 projections), so it changes nothing here.  Computed in fp32 and rounded once to the
weight's dtype, on the weight's device, before sharding (bootstrap: load -> merge -> quantise -> shard), so every
projection the adapter names is covered: the Gated DeltaNet ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/
``in_proj_a``/``out_proj``, attention, MLP, the vision tower and ``lm_head``.  A layer an FP8 checkpoint holds in
FP8 (``fp8.Fp8Linear``) is dequantised to fp32, merged and quantised again in its 128 x 128 blocks.  A layer a
4-bit checkpoint holds in 4 bits (``int4.Int4Linear``) is refused (one line: use the bf16 checkpoint with
``--quantize int4``, which merges before it quantises).

Refused with one ``AdapterError`` line: another ``peft_type``, features that are not a plain low-rank delta
(DoRA, ``modules_to_save``, trained biases, ...), ``.bin`` weights, tensors other than lora_A/lora_B, a module
the base model lacks or that is not ``nn.Linear``, shapes or rank that do not fit, a ``target_modules`` name
that matches nothing, and ZeRO-3 (weights are partitioned while they load, so there is no full weight to add to).
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file

from qwen_chat.engine.checkpoints.layout import CheckpointError
from qwen_chat.engine.model.fp8 import Fp8Linear, quantize_blocks
from qwen_chat.engine.model.int4 import Int4Linear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: adapter_config.json fields that make the adapter more than W + s * B @ A when set (truthy).
UNSUPPORTED = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained modules)",
               "lora_bias": "lora_bias", "target_parameters": "target_parameters",
               "trainable_token_indices": "trainable_token_indices", "layer_replication": "layer_replication",
               "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_qalora": "QALoRA",
               "use_bdlora": "BD-LoRA", "arrow_config": "arrow routing", "kasa_config": "KaSA",
               "monteclora_config": "MonteCLoRA"}

#: Elements of a weight merged at a time (fp32 temporaries of 2 x 128 MiB at most).
MERGE_CHUNK = 2 ** 25

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
_TEXT_ONLY_PREFIX, _PREFIX = "model.", "model.language_model."


class AdapterError(CheckpointError):
    """The adapter folder cannot be used with this base model; the message is one line naming the file and
    the mismatch."""


@dataclass(frozen=True)
class LoraAdapter:
    """A read adapter.  ``pairs``: module name as stored -> (A [r, in], B [out, r]), fp32 or the stored dtype.
    ``config``: adapter_config.json.  ``name``: the folder name (shown by ``/v1/models``)."""

    folder: Path
    config: dict
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        """The adapter's folder name."""
        return self.folder.name

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """r and lora_alpha of ``module``: ``rank_pattern``/``alpha_pattern`` (peft's ``get_pattern_key``
        rule) else the config's ``r``/``lora_alpha`` (peft's defaults 8 / 8)."""
        def pick(patterns: Optional[dict], default):
            for key, value in (patterns or {}).items():
                if re.match(rf"(.*\.)?({key})$", module):
                    return value
            return default

        r = pick(self.config.get("rank_pattern"), self.config.get("r", 8))
        return int(r), float(pick(self.config.get("alpha_pattern"), self.config.get("lora_alpha", 8)))

    def scaling(self, module: str) -> float:
        """s = alpha / r, or alpha / sqrt(r) with ``use_rslora``."""
        r, alpha = self.rank_and_alpha(module)
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r


def read_adapter(folder: Path, *, zero3: bool = False) -> LoraAdapter:
    """Read and check an adapter folder on its own (no base model yet): config, features, tensor names, ranks.

    ``zero3``: the model will be ZeRO-3-partitioned while it loads (refused: nothing to merge into).
    Raises: AdapterError (one line naming the file).
    """
    folder = Path(folder)
    if zero3:
        raise AdapterError(f"--adapter {folder}: cannot be merged under ZeRO-3 (the weights are partitioned while "
                           "they load); use single or tensor parallel mode, or merge it into the checkpoint")
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    try:
        config = json.loads(config_path.read_text())
    except OSError as exc:
        raise AdapterError(f"{config_path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise AdapterError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{config_path}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{config_path}: {what} is not supported: only a plain LoRA delta can be merged")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{config_path}: bias {config['bias']!r} is not supported: only bias 'none' (trained "
                           "biases are not a low-rank delta)")
    if not weights_path.is_file():
        other = "adapter_model.bin is not supported; save with safetensors" if \
            (folder / "adapter_model.bin").is_file() else "missing"
        raise AdapterError(f"{weights_path}: {other}")
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise AdapterError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{weights_path}: tensor {key} is not a LoRA A/B weight (not supported)")
        found.setdefault(match["module"], {})[match["kind"]] = tensor
    if not found:
        raise AdapterError(f"{weights_path}: holds no LoRA weights")
    adapter = LoraAdapter(folder=folder, config=config, pairs={})
    for module, parts in sorted(found.items()):
        if set(parts) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{weights_path}: {module} has only {', '.join(parts)}")
        a, b = parts["lora_A"], parts["lora_B"]
        r, _ = adapter.rank_and_alpha(module)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"{weights_path}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                               f"which do not fit rank r={r} of {CONFIG_FILE}")
        adapter.pairs[module] = (a, b)
    return adapter


def _target_names(config: dict) -> tuple[Any, ...]:
    targets = config.get("target_modules")
    if targets is None or isinstance(targets, str):
        return ()
    return tuple(t for t in targets if t != "all-linear")


def resolve_modules(adapter: LoraAdapter, model: torch.nn.Module) -> dict[str, tuple[str, torch.nn.Module]]:
    """Map each adapted module to the base model's ``nn.Linear`` (or ``fp8.Fp8Linear``) and check the shapes.

    Returns: base model module name -> (name as stored in the adapter, the module).

    Raises: AdapterError naming the first module that does not exist, is not linear or has other in/out
    features, or a ``target_modules`` name that matches no module of the base model or only modules that are
    not linear (``conv1d``).
    """
    modules = dict(model.named_modules())
    weights = adapter.folder / WEIGHTS_FILE
    for target in _target_names(adapter.config):
        matches = [m for name, m in modules.items() if name == target or name.endswith("." + target)]
        if not matches:
            raise AdapterError(f"{adapter.folder / CONFIG_FILE}: target module {target!r} matches no module of "
                               "the base model (adapter made for another architecture?)")
        if not any(isinstance(m, (torch.nn.Linear, Fp8Linear, Int4Linear)) for m in matches):
            raise AdapterError(f"{adapter.folder / CONFIG_FILE}: target module {target!r} is a "
                               f"{type(matches[0]).__name__} in the base model; only nn.Linear layers can be merged")
    resolved = {}
    for stored, (a, b) in adapter.pairs.items():
        name = stored
        if name not in modules and name.startswith(_TEXT_ONLY_PREFIX) and not name.startswith(_PREFIX):
            name = _PREFIX + name[len(_TEXT_ONLY_PREFIX):]
        module = modules.get(name)
        if module is None:
            raise AdapterError(f"{weights}: module {stored} does not exist in the base model (adapter made for "
                               f"another architecture? base_model_name_or_path "
                               f"{adapter.config.get('base_model_name_or_path')!r})")
        if isinstance(module, Int4Linear):
            raise AdapterError(f"{weights}: module {name} holds 4-bit weights ({module.source}); a LoRA adapter is "
                               "not merged into them (quantising the merged weight again would add a second "
                               "rounding to the export's): start from the bf16 checkpoint with --adapter and "
                               "--quantize int4 (the adapter is merged first)")
        if not isinstance(module, (torch.nn.Linear, Fp8Linear)):
            raise AdapterError(f"{weights}: module {name} is a {type(module).__name__}, only nn.Linear layers can "
                               "be merged")
        want = (module.out_features, module.in_features)
        if (b.shape[0], a.shape[1]) != want:
            raise AdapterError(f"{weights}: {name} is {b.shape[0]} x {a.shape[1]} (out x in) in the adapter but "
                               f"{want[0]} x {want[1]} in the base model (adapter made for another model size?)")
        resolved[name] = (stored, module)
    return resolved


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, adapter: LoraAdapter) -> list[str]:
    """Check the adapter against ``model`` (``resolve_modules``) and merge it into the weights in place.

    Every module is checked before any weight changes, so a refused adapter leaves the model as loaded.
    Returns the merged module names (base model names).  Raises: AdapterError.
    """
    from qwen_chat.engine.parallel.sharding import is_zero3_partitioned

    resolved = resolve_modules(adapter, model)
    if is_zero3_partitioned(model):
        raise AdapterError(f"--adapter {adapter.folder}: the weights are ZeRO-3-partitioned; cannot merge")
    for stored, module in resolved.values():
        if isinstance(module, Fp8Linear):  # dequantise, merge in fp32, quantise again
            a, b = (t.to(module.weight.device, torch.float32) for t in adapter.pairs[stored])
            merged = module.fp8_weight().dequantize(torch.float32) + adapter.scaling(stored) * (b @ a)
            module.set_weight(quantize_blocks(merged))
            continue
        w, scale = module.weight, adapter.scaling(stored)
        a, b = (t.to(w.device, torch.float32) for t in adapter.pairs[stored])
        rows = max(1, MERGE_CHUNK // w.shape[1])  # bounds the fp32 temporaries (lm_head: 248,320 rows)
        for start in range(0, w.shape[0], rows):
            part = w[start:start + rows]
            part.copy_((part.float() + scale * (b[start:start + rows] @ a)).to(w.dtype))
    return list(resolved)


def describe_merge(adapter: LoraAdapter, merged: list[str]) -> str:
    """One log line: the adapter, its rank/alpha, and the merged modules with layer numbers folded into N,
    e.g. ``model.language_model.layers.N.linear_attn.in_proj_qkv x24``."""
    counts = Counter(re.sub(r"\.\d+\.", ".N.", name) for name in merged)
    patterns = ", ".join(f"{p} x{n}" for p, n in sorted(counts.items()))
    cfg = adapter.config
    return (f"adapter {adapter.name}: merged {len(merged)} modules (r={cfg.get('r')}, lora_alpha="
            f"{cfg.get('lora_alpha')}{', rslora' if cfg.get('use_rslora') else ''}): {patterns}")
