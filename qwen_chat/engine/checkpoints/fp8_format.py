"""The FP8 checkpoint format the service accepts, checked from config.json and the safetensors headers alone.

Accepted (DeepSeek-V3's block format, as Qwen/Qwen3.5-9B-FP8 and community FP8 exports use it; docs/checkpoints.md,
"FP8"): ``quantization_config`` {``quant_method`` "fp8", ``fmt`` "e4m3", ``activation_scheme`` "dynamic",
``weight_block_size`` [128, 128], ``modules_to_not_convert`` [...]} in config.json (top level or in
``text_config``); each quantised linear layer stores ``<module>.weight`` as F8_E4M3 [N, K] and
``<module>.weight_scale_inv`` [ceil(N/128), ceil(K/128)] in F32 (BF16 or F16 also read; they are converted to fp32),
which multiplies (w = fp8 * scale_inv).  Other tensors (the modules left unquantised: lm_head, the vision
tower, ``in_proj_a``/``in_proj_b``, embeddings, norms) keep their dtypes.  ``mtp.*`` tensors are not checked here
(``model.mtp.load_mtp_head`` reads them, dequantising FP8 ones).

Which modules are FP8 is read from the tensors' dtypes, not from ``modules_to_not_convert``; that list is
checked against them (a module it names must not be stored in F8).  Its names are matched with
``excluded``, which treats the text decoder's two spellings alike: ``model.language_model.layers.N...``
(``Qwen3_5ForConditionalGeneration``) and ``model.layers.N...`` (a text-only ``Qwen3_5ForCausalLM``), so an
entry written for one model matches in the other (transformers 5.x's quantizer matches them literally and
silently quantises bf16 weights of a text-only load; see docs/checkpoints.md).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from qwen_chat.engine.checkpoints.errors import CheckpointError

QUANT_METHOD = "fp8"
FMT = "e4m3"
ACTIVATION_SCHEME = "dynamic"
BLOCK_SIZE = (128, 128)
FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = ".weight_scale_inv"
WEIGHT_SUFFIX = ".weight"
#: safetensors dtypes accepted for the block scales (converted to fp32 on load).
SCALE_DTYPES = ("F32", "BF16", "F16")
MTP_PREFIX = "mtp."
TEXT_PREFIX, TEXT_ONLY_PREFIX, VISION_PREFIX = "model.language_model.", "model.", "model.visual."
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


class Fp8FormatError(CheckpointError):
    """The FP8 part of a checkpoint is not in the accepted format; the message is one line naming the file."""


@dataclass(frozen=True)
class Fp8Spec:
    """The FP8 weights of a checkpoint: ``modules`` (module names whose weight is F8_E4M3, sorted),
    ``not_convert`` (config.json's ``modules_to_not_convert``), ``config`` (the whole ``quantization_config``)."""

    modules: tuple[str, ...]
    not_convert: tuple[str, ...]
    config: Mapping[str, Any]


def canonical(name: str) -> str:
    """A module name with the text decoder spelled as in ``Qwen3_5ForConditionalGeneration``:
    ``model.layers.0.mlp`` -> ``model.language_model.layers.0.mlp``; other names unchanged."""
    if not name.startswith(TEXT_ONLY_PREFIX) or (name + ".").startswith((TEXT_PREFIX, VISION_PREFIX)):
        return name
    return TEXT_PREFIX + name[len(TEXT_ONLY_PREFIX):]


def excluded(module: str, entries: Iterable[str]) -> bool:
    """True when ``modules_to_not_convert`` ``entries`` name ``module``: an entry matches the module itself or a
    module under it (up to a dot), as a regex with the same boundary, or as a dotted suffix (``lm_head``,
    ``in_proj_a``) -- transformers' rule (``quantizers_utils.should_convert_module``), applied to
    ``canonical`` names so either spelling of the text decoder matches the other."""
    name = canonical(module)
    for entry in entries:
        full = canonical(entry)
        if name == full or name.startswith(full + ".") or name.endswith("." + entry) or name == entry:
            return True
        try:
            if re.match(rf"(?:{full}){_BOUNDARY}", name):
                return True
        except re.error:
            continue
    return False


def check_quantization(config_file: Path, quantization: Any) -> tuple[str, ...]:
    """Check an FP8 ``quantization_config``; returns its ``modules_to_not_convert``.  Raises Fp8FormatError naming
    ``config_file`` for another ``quant_method`` (the 4-bit ones are checked by ``int4_format`` first), ``fmt``, activation scheme
    or block size."""
    if not isinstance(quantization, dict):
        raise Fp8FormatError(f"{config_file}: quantization_config is not a JSON object")
    method = quantization.get("quant_method")
    if method != QUANT_METHOD:
        raise Fp8FormatError(f"{config_file}: quantization_config quant_method {method!r} is not supported "
                             f"(only {QUANT_METHOD!r}, the 128 x 128 block format, or 4-bit 'gptq', 'awq' or "
                             "'compressed-tensors' in groups of 128; or use a bf16 checkpoint)")
    fmt = quantization.get("fmt", FMT)
    if fmt != FMT:
        raise Fp8FormatError(f"{config_file}: quantization_config fmt {fmt!r} is not supported (only {FMT!r})")
    scheme = quantization.get("activation_scheme", ACTIVATION_SCHEME)
    if scheme != ACTIVATION_SCHEME:
        raise Fp8FormatError(f"{config_file}: quantization_config activation_scheme {scheme!r} is not supported "
                             f"(only {ACTIVATION_SCHEME!r}: no stored activation scales)")
    block = quantization.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or tuple(block) != BLOCK_SIZE:
        raise Fp8FormatError(f"{config_file}: quantization_config weight_block_size {block!r} is not supported "
                             f"(only {list(BLOCK_SIZE)})")
    if quantization.get("scale_fmt", "float") != "float":
        raise Fp8FormatError(f"{config_file}: quantization_config scale_fmt {quantization['scale_fmt']!r} is not "
                             "supported (only 'float' scales)")
    not_convert = quantization.get("modules_to_not_convert") or []
    if not isinstance(not_convert, list) or not all(isinstance(n, str) for n in not_convert):
        raise Fp8FormatError(f"{config_file}: quantization_config modules_to_not_convert is not a list of names")
    return tuple(not_convert)


def check_fp8_tensors(folder: Path, config_file: Path, quantization: Optional[Mapping[str, Any]],
                      tensors: Mapping[str, tuple[str, Sequence[int]]],
                      shard_of: Mapping[str, str]) -> Optional[Fp8Spec]:
    """Check the FP8 tensors of a folder against its ``quantization_config`` (None when config.json has none).

    tensors: name -> (safetensors dtype, shape), from the headers; shard_of: name -> shard file name.
    Returns the ``Fp8Spec``, or None for a checkpoint with neither a quantization_config nor F8 tensors.
    Raises Fp8FormatError (one line naming the file) for: the config problems of ``check_quantization``; F8
    tensors without a quantization_config; an F8 tensor that is not a 2-D ``.weight``; a weight without its
    ``weight_scale_inv`` or a scale without its F8 weight; a scale of another dtype or shape than
    [ceil(N/128), ceil(K/128)]; a module stored in F8 that ``modules_to_not_convert`` names.
    """
    rows = {n: v for n, v in tensors.items() if not n.startswith(MTP_PREFIX)}
    f8 = sorted(n for n, (dtype, _) in rows.items() if dtype == FP8_DTYPE)
    if quantization is None:
        if f8:
            raise Fp8FormatError(f"{folder / shard_of[f8[0]]}: {f8[0]} is {FP8_DTYPE} but {config_file} has no "
                                 "quantization_config")
        return None
    not_convert = check_quantization(config_file, quantization)
    modules = []
    for name in f8:
        where = folder / shard_of[name]
        shape = tuple(rows[name][1])
        if not name.endswith(WEIGHT_SUFFIX) or len(shape) != 2:
            raise Fp8FormatError(f"{where}: {name} is {FP8_DTYPE} {list(shape)}; only 2-D linear weights may be")
        module = name[:-len(WEIGHT_SUFFIX)]
        scale = module + SCALE_SUFFIX
        want = [-(-shape[0] // BLOCK_SIZE[0]), -(-shape[1] // BLOCK_SIZE[1])]
        if scale not in rows:
            raise Fp8FormatError(f"{where}: {name} is {FP8_DTYPE} but its block scales {scale} are missing")
        s_dtype, s_shape = rows[scale]
        if s_dtype not in SCALE_DTYPES or list(s_shape) != want:
            raise Fp8FormatError(f"{folder / shard_of[scale]}: {scale} is {s_dtype} {list(s_shape)}, expected "
                                 f"{' or '.join(SCALE_DTYPES)} {want} (one scale per 128 x 128 block of {name})")
        if excluded(module, not_convert):
            raise Fp8FormatError(f"{where}: {name} is {FP8_DTYPE} but quantization_config modules_to_not_convert "
                                 f"names {module} (the checkpoint contradicts its config.json)")
        modules.append(module)
    known = {m + SCALE_SUFFIX for m in modules}
    for name in sorted(rows):
        if name.endswith(SCALE_SUFFIX) and name not in known:
            raise Fp8FormatError(f"{folder / shard_of[name]}: {name} has no {FP8_DTYPE} weight "
                                 f"{name[:-len(SCALE_SUFFIX)]}{WEIGHT_SUFFIX}")
    return Fp8Spec(modules=tuple(modules), not_convert=not_convert, config=dict(quantization))


def default_not_convert(layer_types: Sequence[str]) -> list[str]:
    """The ``modules_to_not_convert`` of the published FP8 export, for a model with these ``layer_types``: the LM
    head, the vision tower and every Gated DeltaNet layer's ``in_proj_a``/``in_proj_b`` (their 32 outputs per
    layer drive the gates), with the multi-token-prediction head; names in the ``model.language_model.``
    spelling (docs/checkpoints.md, "FP8": what is inferred and what is not)."""
    names = ["lm_head", "model.visual", "mtp"]
    for i, kind in enumerate(layer_types):
        if kind == "linear_attention":
            names += [f"{TEXT_PREFIX}layers.{i}.linear_attn.in_proj_a", f"{TEXT_PREFIX}layers.{i}.linear_attn.in_proj_b"]
    return names
