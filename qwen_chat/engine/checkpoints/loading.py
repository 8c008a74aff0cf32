"""Find and load a Qwen3.5 checkpoint: processor + model from a hub id, a local folder or the built-in tiny model.

``--model`` accepts:
- ``tiny``: the built-in demo checkpoint (``qwen_chat.engine.checkpoints.tiny``), written once to the cache folder;
- a local checkpoint folder (it must contain ``config.json``);
- a Hugging Face hub id such as ``Qwen/Qwen3.5-9B``, fetched with ``huggingface_hub.snapshot_download``
  (its own progress bars; a cached copy is used when offline).

Loading always goes through ``from_pretrained`` (``AutoProcessor`` and ``Qwen3_5ForConditionalGeneration``),
so the tiny model and a real checkpoint share one code path.  Before it, ``layout.inspect_checkpoint`` checks
the folder (model type, shards, quantisation) from its JSON files and safetensors headers, and after the
processor and the weights load, ``layout.check_tokenizer`` and ``layout.check_loading_info`` refuse a foreign
tokenizer or missing weights: each refusal is one ``CheckpointError`` line naming the file.  An FP8 checkpoint
(the 128 x 128 block format) loads through the same call without transformers' quantizer, and its FP8 layers
become ``fp8.Fp8Linear`` before the model moves to its device (``fp8_loading``); a 4-bit checkpoint (GPTQ,
AWQ, compressed-tensors ``pack-quantized``) likewise, its 4-bit layers becoming ``int4.Int4Linear``
(``int4_loading``).  bf16 on CUDA,
fp32 on CPU (the published weights are bf16, docs/facts.md, "Shape"; CPU matmuls in bf16 are slow and less
exact).

Under a DeepSpeed sharding plan the caller (``qwen_chat.engine.startup.bootstrap``) first runs
``sharding.prepare_loading(plan)`` (for ZeRO-3 it keeps an ``HfDeepSpeedConfig`` alive, so ``from_pretrained``
partitions the weights as it builds the model), then calls ``load_model(..., place_on_device=False)`` and hands the
result to ``sharding.shard_model``; ``from_pretrained`` therefore stays a plain call here and the model is not
moved when the caller manages placement.

Usage: ``python -m qwen_chat.engine.checkpoints.loading tiny`` prints the resolved folder, the model info and the
Gated DeltaNet kernels.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.utils import is_torchvision_available

from qwen_chat.chat_types import ModelInfo
from qwen_chat.config import MODEL_HINT, local_checkpoint_problem
from qwen_chat.engine.checkpoints.folders import DEFAULT_CACHE_DIR, HUB_ALLOW_PATTERNS
from qwen_chat.engine.checkpoints.fp8_loading import config_without_quantization, convert_fp8_modules, scales_ignored
from qwen_chat.engine.checkpoints.int4_loading import convert_int4_modules, int4_keys_ignored, missing_besides_int4
from qwen_chat.engine.checkpoints.layout import (CheckpointReport, check_loading_info, check_tokenizer,
                                                 inspect_checkpoint)
from qwen_chat.engine.checkpoints.tiny import DEMO_CONFIG_KEY, DEMO_MARKER_FILE, build_tiny_checkpoint
from qwen_chat.engine.model import precision

log = logging.getLogger(__name__)


class ModelUnavailable(RuntimeError):
    """The ``--model`` value cannot be resolved to a checkpoint folder; the message says what to do."""


@dataclass
class LoadedModel:
    """A loaded checkpoint.

    ``model``: ``Qwen3_5ForConditionalGeneration`` in eval mode (bf16 on CUDA, fp32 on CPU unless overridden).
    ``processor``: ``Qwen3VLProcessor`` (tokenizer + ``Qwen2VLImageProcessor`` + chat template).
    ``tokenizer``: the processor's tokenizer.  ``info``: name, demo flag, context length in tokens.
    ``checkpoint``: the folder it was loaded from.  ``report``: what ``layout.inspect_checkpoint`` found there.
    """

    model: Any
    processor: Any
    tokenizer: Any
    info: ModelInfo
    checkpoint: Path
    report: Optional[CheckpointReport] = None


class ImageTextProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without its video processor.

    transformers 5.x builds ``Qwen3VLVideoProcessor`` with torchvision, and PyPI has no torchvision wheel that
    works with the CPU build of torch.  The service sends images and text only, so where torchvision is
    missing ``load_processor`` uses this class: same tokenizer, image processor, chat template and
    ``__call__``/``apply_chat_template`` behaviour for text and images; passing ``videos`` is not supported.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # ProcessorMixin derives the sub-processor list from this signature: image_processor, tokenizer.
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def resolve_checkpoint(model: str, cache_dir: Optional[Path] = None) -> Path:
    """Turn a ``--model`` value into a local checkpoint folder.

    Args:
        model: ``"tiny"``, a path to a local checkpoint folder, or a hub id (``owner/name``).
        cache_dir: where the tiny model is built (default ``~/.cache/qwen_chat``); hub downloads use the
            Hugging Face cache (``HF_HOME``).

    Raises:
        ModelUnavailable: the folder has no ``config.json``, or the hub id is unknown, gated, or not cached
            while offline.  The message names ``--model PATH`` and ``--model tiny``.
    """
    hint = MODEL_HINT
    if model == "tiny":
        return build_tiny_checkpoint(Path(cache_dir or DEFAULT_CACHE_DIR).expanduser())
    problem = local_checkpoint_problem(model)
    if problem:
        raise ModelUnavailable(problem)
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve()
    try:
        return Path(snapshot_download(model, allow_patterns=HUB_ALLOW_PATTERNS))
    except LocalEntryNotFoundError as exc:
        raise ModelUnavailable(f"Model {model!r} is not in the local Hugging Face cache and cannot be downloaded "
                               f"now (offline?): {_first_line(exc)} {hint}") from exc
    except (HfHubHTTPError, HFValidationError, OSError) as exc:
        raise ModelUnavailable(f"Cannot download model {model!r}: {_first_line(exc)} {hint}") from exc


def _first_line(exc: BaseException) -> str:
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
    return line + "."


def load_processor(path: Path):
    """Load the checkpoint's processor with ``AutoProcessor``; without torchvision, its image+text subset.

    Returns a ``Qwen3VLProcessor`` (or ``ImageTextProcessor`` where torchvision is not installed).  Its
    tokenizer does not warn about texts longer than the model's context: the service measures every prompt
    against its context and refuses one too long with its own message (``ContextTooLong``), so transformers'
    "will result in indexing errors" line in the log would only mislead.
    """
    processor = None
    if is_torchvision_available():
        try:
            processor = AutoProcessor.from_pretrained(path)
        except (ImportError, OSError, ValueError, TypeError) as exc:
            # Only the video half can be at fault here when the image+text half loads below.
            log.warning("AutoProcessor failed (%s); using the image+text processor without video", exc)
    if processor is None:
        processor = ImageTextProcessor.from_pretrained(path)
    warned = getattr(processor.tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):  # transformers' own "said once already" mark for that warning
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    return processor


def is_demo_checkpoint(path: Path, config: Any = None) -> bool:
    """True for the built-in tiny model (``"qwen_chat_demo": true`` in config.json or the marker file)."""
    if config is not None and getattr(config, DEMO_CONFIG_KEY, False):
        return True
    if (Path(path) / DEMO_MARKER_FILE).is_file():
        return True
    try:
        return bool(json.loads((Path(path) / "config.json").read_text()).get(DEMO_CONFIG_KEY, False))
    except (OSError, ValueError):
        return False


def display_name(path: Path) -> str:
    """A readable model name for a checkpoint folder: ``owner/name`` for a Hugging Face cache snapshot
    (``.../models--owner--name/snapshots/<commit>``), else the folder name."""
    path = Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name[len("models--"):].replace("--", "/")
    return path.name


def default_dtype(device: str) -> torch.dtype:
    """bf16 on CUDA (the published weights' dtype), fp32 elsewhere."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_model(path: Path, device: str, dtype: Optional[torch.dtype] = None, *, place_on_device: bool = True,
               name: Optional[str] = None, report: Optional[CheckpointReport] = None) -> LoadedModel:
    """Load processor and model from a checkpoint folder.

    Args:
        path: checkpoint folder (from ``resolve_checkpoint``).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; picks the default dtype and, with ``place_on_device``,
            where the weights go.
        dtype: weight dtype; None means bf16 on CUDA, fp32 on CPU.
        place_on_device: move the model to ``device`` after loading.  Pass False when the caller manages
            placement (ZeRO-3 under ``HfDeepSpeedConfig``, a ``device_map``, tensor parallel).
        name: name shown to users (default: the folder name; "tiny" shows as "qwen3.5-tiny (demo)").
        report: the folder's ``layout.inspect_checkpoint`` result when the caller already has it.

    An FP8 checkpoint (``report.fp8``) keeps its FP8 layers as ``fp8.Fp8Linear`` (``fp8_loading``), a 4-bit one
    (``report.int4``: GPTQ, AWQ, compressed-tensors) its 4-bit layers as ``int4.Int4Linear``
    (``int4_loading``); the rest loads in ``dtype``.

    Raises:
        CheckpointError (``layout``): one line naming the file, for a foreign model type, a missing shard, a
            quantised checkpoint other than FP8 in the block format or a broken FP8 one, a tokenizer with other
            special ids, or weights the checkpoint lacks.
        OSError / ValueError from transformers when the folder does not hold a loadable Qwen3.5 checkpoint.
    """
    path = Path(path)
    dtype = dtype or default_dtype(device)
    report = report or inspect_checkpoint(path)
    log.info("checkpoint %s: %s", path, report.describe())
    processor = load_processor(path)
    check_tokenizer(processor.tokenizer, path)
    if report.int4 is not None:
        with int4_keys_ignored(Qwen3_5ForConditionalGeneration, report.int4):
            model, loading_info = Qwen3_5ForConditionalGeneration.from_pretrained(
                path, config=config_without_quantization(path), dtype=dtype, output_loading_info=True)
        loading_info["missing_keys"] = missing_besides_int4(loading_info.get("missing_keys") or (), report.int4)
    elif report.fp8 is None:
        model, loading_info = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=dtype,
                                                                             output_loading_info=True)
    else:
        with scales_ignored(Qwen3_5ForConditionalGeneration):
            model, loading_info = Qwen3_5ForConditionalGeneration.from_pretrained(
                path, config=config_without_quantization(path), dtype=dtype, output_loading_info=True)
    check_loading_info(loading_info, path)
    if report.fp8 is not None:
        convert_fp8_modules(model, report)
    if report.int4 is not None:
        convert_int4_modules(model, report)
    if place_on_device:
        model.to(device)
    model.eval()
    demo = is_demo_checkpoint(path, model.config)
    text_config = model.config.get_text_config()
    info = ModelInfo(
        name=name or ("qwen3.5-tiny (demo)" if demo else display_name(path)),
        demo=demo,
        context_length=int(text_config.max_position_embeddings),
    )
    return LoadedModel(model=model, processor=processor, tokenizer=processor.tokenizer, info=info,
                       checkpoint=path, report=report)


# Gated DeltaNet ops -> (transformers function in modeling_qwen3_5, optional package it prefers).
_KERNEL_FUNCTIONS = {
    "chunked delta rule (prefill)": "torch_chunk_gated_delta_rule",
    "recurrent delta rule (decode)": "torch_recurrent_gated_delta_rule",
    "causal conv1d (prefill)": "causal_conv1d_fn",
    "causal conv1d update (decode)": "causal_conv1d_update",
}


def describe_kernels() -> dict[str, str]:
    """Which implementation transformers resolved for each Gated DeltaNet op.

    transformers decorates each op with ``use_kernel_func_from_hub_with_fallback``: at import it tries the
    original package (``fla`` for the delta rule, ``causal_conv1d`` for the conv) and keeps the PyTorch
    reference when the import fails; the choice is held in the wrapper's closure (``implementation``).
    Hub kernels (``kernels`` package, ``use_kernels=True``) would replace these at model load and are not
    reported here.

    Returns: op name -> ``"fla (module.function)"``, ``"causal_conv1d (module.function)"`` or
    ``"torch fallback"``.
    """
    result = {}
    for label, func_name in _KERNEL_FUNCTIONS.items():
        func = getattr(modeling_qwen3_5, func_name)
        closure = inspect.getclosurevars(func).nonlocals if func.__closure__ else {}
        impl = closure.get("implementation")
        if impl is None or not closure.get("is_new_implementation", False):
            result[label] = "torch fallback"
        else:
            module = getattr(impl, "__module__", "") or ""
            package = module.split(".")[0]
            result[label] = f"{package} ({module}.{getattr(impl, '__name__', '?')})"
    return result


@contextlib.contextmanager
def torch_reference_kernels() -> Iterator[None]:
    """While active, transformers' Qwen3.5 runs its PyTorch reference for every Gated DeltaNet op
    (``_KERNEL_FUNCTIONS``: the functions under transformers' kernel decorator, ``inspect.unwrap``) and cuBLAS,
    cuDNN and attention run plain fp32 (``precision.exact_fp32``): an exact fp32 reference (fla's kernels, which
    the decorator prefers, round fp32 inputs of their ``tl.dot`` calls to TF32).  For accuracy checks
    (bench/fp8_accuracy.py, tests/gpu); restores everything on exit."""
    saved = {name: getattr(modeling_qwen3_5, name) for name in _KERNEL_FUNCTIONS.values()}
    flags = precision.exact_fp32()
    try:
        for name, func in saved.items():
            setattr(modeling_qwen3_5, name, inspect.unwrap(func))
        yield
    finally:
        for name, func in saved.items():
            setattr(modeling_qwen3_5, name, func)
        precision.restore(flags)


if __name__ == "__main__":
    folder = resolve_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny")
    loaded = load_model(folder, "cuda" if torch.cuda.is_available() else "cpu")
    print(folder)
    print(loaded.info)
    for op, impl in describe_kernels().items():
        print(f"{op}: {impl}")
