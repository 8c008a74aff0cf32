"""DeepSpeed sharding of a loaded Qwen3.5 model: tensor parallel (AutoTP) or ZeRO-3, from ``ds_config.json``.

This is the only module of the service that imports ``deepspeed``.  Modes (``ShardingPlan.mode``):

- ``single``: no DeepSpeed; every rank holds the whole model (the default when no config is given).
- ``tp``: ``deepspeed.initialize(model, config={"tensor_parallel": {"autotp_size": N}, "zero_optimization":
  {"stage": 0}, ...})`` then ``engine.module.eval()``.  DeepSpeed reads transformers' ``base_model_tp_plan`` of
  Qwen3.5 (q/k/v, gate/up column-parallel; o_proj, down_proj row-parallel with one all-reduce; the vision
  tower replicated), except the Gated DeltaNet layers, which are split by heads here instead of the plan's
  ``colwise_gather_output`` (``_split_gated_deltanet``: one all-reduce per layer).  The input embedding, which
  that plan leaves whole, is split by vocabulary rows here (``tp_layers.VocabParallelEmbedding``), and the
  lm_head by output rows with gathered logits (``tp_layers.GatheredColumnLinear``, the plan's own style for it,
  applied here so it does not depend on the transformers version).  A model with FP8 or 4-bit weights
  (``fp8.Fp8Linear``, ``int4.Int4Linear``) has its attention and MLP projections split here too, on the 128 x 128
  blocks or 128-column groups (``_split_fp8_model``; a share that would cut one is refused with one line), and
  AutoTP only replicates the rest.  Needs deepspeed >= 0.19.6 and
  transformers >= 5.13 (older versions silently fall back to name heuristics that split Gated DeltaNet
  wrongly: docs/facts.md, "Sharding with DeepSpeed: tensor parallel").  N must divide the KV heads (4 on the
  9B): N in {1, 2, 4}.
- ``zero3`` / ``zero3-offload``: ZeRO stage 3; ``HfDeepSpeedConfig`` is created before ``from_pretrained``
  (so the weights are partitioned while loading) and kept alive for the life of the process (transformers
  holds it weakly); optional ``offload_param`` to CPU with pinned memory.  Small tensors (norms, ``A_log``,
  ``dt_bias``, the depthwise conv) stay resident through ``stage3_param_persistence_threshold``.

Usage (what ``qwen_chat.engine.startup.bootstrap`` does on every rank)::

    plan = read_plan(cfg.ds_config, world_size, device.type)
    check_tp_degree(text_config, plan.tp_size)
    prepare_loading(plan)                    # ZeRO-3: HfDeepSpeedConfig before from_pretrained
    loaded = load_model(path, device, dtype=plan.dtype, place_on_device=not plan.uses_deepspeed)
    model = shard_model(loaded.model, plan, device)
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from qwen_chat.config import ConfigError
from qwen_chat.engine.model.fp8 import BlockAlignmentError, Fp8Linear
from qwen_chat.engine.model.int4 import GroupAlignmentError, Int4Linear
from qwen_chat.engine.parallel.layout import resolve_tp_size
from qwen_chat.engine.parallel.tp_layers import (shard_input_embedding, shard_lm_head, split_gated_deltanet_heads,
                                                 split_projections)

log = logging.getLogger(__name__)

MODES = ("single", "tp", "zero3", "zero3-offload")

#: Minimum versions for AutoTP through transformers' tp_plan (docs/facts.md, "Sharding with DeepSpeed: tensor
#: parallel").
MIN_DEEPSPEED = (0, 19, 6)
MIN_TRANSFORMERS = (5, 13)

#: Parameters with fewer elements than this stay resident (not partitioned) under ZeRO-3 when the config
#: gives no value.  The largest small tensor of the 9B that the engine reads directly is the depthwise conv of
#: a Gated DeltaNet layer: (2 x 16 x 128 + 32 x 128) channels x width 4 = 32,768 elements
#: (docs/facts.md, "Shape"); norms are 4,096, ``A_log``/``dt_bias`` 32.
DEFAULT_PERSISTENCE_THRESHOLD = 100_000

#: Why ZeRO-3 and FP8 weights do not go together (start-up refusal, before any weight loads).
ZERO3_FP8_REFUSAL = ("ZeRO-3 cannot hold FP8 weights (it partitions each parameter while the checkpoint loads, apart "
                     "from its block scales); serve FP8 on one GPU or with tensor parallel, or use a bf16 checkpoint "
                     "without --quantize fp8 under ZeRO-3")
ZERO3_INT4_REFUSAL = ("ZeRO-3 cannot hold 4-bit weights (as for FP8); serve them on one GPU or with tensor "
                      "parallel, or use a bf16 checkpoint without --quantize int4 under ZeRO-3")

# Objects that must live as long as the process: HfDeepSpeedConfig (held weakly by transformers; once
# collected, ZeRO-3 loading and synced generation silently turn off) and the DeepSpeed engines (they own the
# ZeRO-3 parameter coordinator whose hooks gather weights at every forward).
_KEEP_ALIVE: list = []


class ShardingError(ConfigError):
    """The DeepSpeed config or the TP degree cannot work with this model or world size (start-up error)."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@dataclass(frozen=True)
class ShardingPlan:
    """How this process group shards the model.

    ``mode``: one of ``MODES``.  ``tp_size``: tensor-parallel degree (1 unless ``mode == "tp"``).
    ``world_size``: ranks in the group.  ``ds_config``: the dict handed to ``deepspeed.initialize`` (None for
    ``single``), already adapted to the device (bf16 switched off on CPU).  ``dtype``: weight dtype to load
    with (bf16 on CUDA when the config enables it, else fp32 on CPU; None lets the loader choose).
    ``source``: the file the config came from (None when built in code).
    """

    mode: str
    tp_size: int
    world_size: int
    ds_config: Optional[Mapping[str, Any]] = None
    dtype: Optional[torch.dtype] = None
    source: Optional[Path] = None

    @property
    def uses_deepspeed(self) -> bool:
        return self.mode != "single"

    @property
    def is_zero3(self) -> bool:
        return self.mode in ("zero3", "zero3-offload")

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``tp (autotp_size=2, world 2, bf16, ds_config.json)``."""
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "default dtype"
        src = str(self.source) if self.source is not None else "built-in"
        if self.mode == "tp":
            detail = f"autotp_size={self.tp_size}"
        elif self.is_zero3:
            zo = self.ds_config["zero_optimization"]
            detail = (f"stage 3, offload_param={zo.get('offload_param', {}).get('device', 'none')}, "
                      f"persistence_threshold={zo.get('stage3_param_persistence_threshold')}")
        else:
            detail = "no DeepSpeed, full model on every rank"
        return f"{self.mode} ({detail}, world {self.world_size}, {dtype}, {src})"


def default_tp_config(world_size: int) -> dict:
    """The tensor-parallel DeepSpeed config used when several ranks run without ``--ds-config``."""
    return {
        "tensor_parallel": {"autotp_size": int(world_size)},
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": 1,
    }


def read_plan(path: Optional[Path], world_size: int, device_type: str) -> ShardingPlan:
    """Build the ``ShardingPlan`` from a DeepSpeed JSON config.

    Args:
        path: the ``--ds-config`` file, or None (world size 1: ``single``; several ranks: TP over all of them).
        world_size: number of ranks in this group (the launcher's world, or one data-parallel replica's ranks:
            ``layout.ReplicaLayout.tp_size``).
        device_type: ``"cuda"`` or ``"cpu"``; on CPU bf16 is switched off (fp32 weights, exact comparisons)
            and ``offload_param`` is dropped (the weights already live in host memory).

    ``tensor_parallel.autotp_size`` may be ``"auto"`` or absent: it then equals the group's size
    (``layout.resolve_tp_size``).  A TP degree must equal the group's size (data-parallel replicas are groups of
    their own).

    Raises:
        ShardingError: unreadable JSON, unsupported ZeRO stage, or a TP degree that differs from the world size.
    """
    if path is None:
        if world_size == 1:
            return ShardingPlan(mode="single", tp_size=1, world_size=1)
        raw, source = default_tp_config(world_size), None
    else:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ShardingError(f"cannot read DeepSpeed config {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ShardingError(f"DeepSpeed config {path} must be a JSON object")
        source = Path(path)
    ds = copy.deepcopy(raw)
    ds.setdefault("train_micro_batch_size_per_gpu", 1)  # required by deepspeed.initialize, even for inference
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    stage = int(zero.get("stage", 0))
    tp_section = ds.get("tensor_parallel") or {}

    if device_type != "cuda":
        ds["bf16"] = {"enabled": False}
        ds.pop("fp16", None)
        if "offload_param" in zero:
            log.info("CPU ranks: dropping zero_optimization.offload_param (the weights already live in host memory)")
            zero.pop("offload_param")
    bf16 = bool((ds.get("bf16") or {}).get("enabled", False))
    fp16 = bool((ds.get("fp16") or {}).get("enabled", False))
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32

    if stage == 3:
        if tp_section.get("autotp_size") not in (None, "auto", 1):
            raise ShardingError(f"{source or 'DeepSpeed config'}: combine either ZeRO-3 or tensor_parallel, not both")
        ds.pop("tensor_parallel", None)
        zero.setdefault("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD)
        offload = (zero.get("offload_param") or {}).get("device", "none")
        mode = "zero3-offload" if offload == "cpu" else "zero3"
        return ShardingPlan(mode=mode, tp_size=1, world_size=world_size, ds_config=ds, dtype=dtype, source=source)
    if stage != 0:
        raise ShardingError(
            f"{source or 'DeepSpeed config'}: zero_optimization.stage {stage} is not an inference mode; "
            "use stage 0 with tensor_parallel (TP) or stage 3 (ZeRO-3)"
        )
    try:
        tp_size = resolve_tp_size(tp_section.get("autotp_size", "auto"), world_size)
    except ValueError as exc:
        raise ShardingError(f"{source or 'DeepSpeed config'}: {exc}") from None
    if tp_size != world_size:
        raise ShardingError(
            f"tensor_parallel.autotp_size is {tp_size} but the launcher started {world_size} ranks; they must be "
            f"equal (set NUM_GPUS={tp_size}, or \"autotp_size\": \"auto\", or --data-parallel)"
        )
    ds["tensor_parallel"] = {**tp_section, "autotp_size": tp_size}
    if tp_size == 1 and world_size == 1:
        return ShardingPlan(mode="single", tp_size=1, world_size=1, dtype=dtype, source=source)
    return ShardingPlan(mode="tp", tp_size=tp_size, world_size=world_size, ds_config=ds, dtype=dtype, source=source)


def check_tp_degree(text_config, tp_size: int) -> None:
    """Refuse a TP degree that does not split every head group of ``text_config`` evenly.

    Checked: ``num_key_value_heads`` (4 on the 9B), ``num_attention_heads`` (16), ``linear_num_key_heads`` (16)
    and ``linear_num_value_heads`` (32) must all be divisible by ``tp_size`` (docs/facts.md, "Shape").

    Raises:
        ShardingError: naming the head count and the TP degrees that would work.
    """
    if tp_size <= 1:
        return
    kv = int(text_config.num_key_value_heads)
    counts = {
        "num_key_value_heads": kv,
        "num_attention_heads": int(text_config.num_attention_heads),
        "linear_num_key_heads": int(getattr(text_config, "linear_num_key_heads", kv) or kv),
        "linear_num_value_heads": int(getattr(text_config, "linear_num_value_heads", kv) or kv),
    }
    for name, n in counts.items():
        if n % tp_size:
            ok = [d for d in (1, 2, 4, 8) if all(v % d == 0 for v in counts.values())]
            raise ShardingError(
                f"tensor parallel degree {tp_size} does not divide {name} = {n} of this model; "
                f"use one of {ok} (NUM_GPUS / autotp_size), or ZeRO-3 (deploy/ds_config.zero3.json)"
            )


def check_versions() -> None:
    """Raise ``ShardingError`` when deepspeed < 0.19.6 or transformers < 5.13 (AutoTP would split wrongly)."""
    import deepspeed
    import transformers

    if _version_tuple(deepspeed.__version__) < MIN_DEEPSPEED:
        raise ShardingError(f"tensor parallel needs deepspeed >= 0.19.6, found {deepspeed.__version__}")
    if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
        raise ShardingError(f"tensor parallel needs transformers >= 5.13, found {transformers.__version__}")


def prepare_loading(plan: ShardingPlan) -> None:
    """Before ``from_pretrained``: for ZeRO-3, create the ``HfDeepSpeedConfig`` and keep it for the process.

    With it alive, ``from_pretrained`` builds the model under ``deepspeed.zero.Init`` so no rank ever holds
    all weights.  No-op for other modes.
    """
    if not plan.is_zero3:
        return
    from transformers.integrations import HfDeepSpeedConfig

    _KEEP_ALIVE.append(HfDeepSpeedConfig(dict(plan.ds_config)))


def shard_model(model: torch.nn.Module, plan: ShardingPlan, device: torch.device) -> torch.nn.Module:
    """Apply ``plan`` to a loaded model and return the module to run (eval mode).

    ``single``: moves the model to ``device``.  ``tp``: AutoTP replaces the nn.Linear layers named by the tp_plan
    in place with sharded DeepSpeed layers (weights moved to the rank's device).  ``zero3*``: wraps the model
    already partitioned at load time.  Every rank must call this at the same time (collectives inside).

    Raises: ShardingError: versions too old for AutoTP; FP8 / 4-bit weights whose rank shares would cut their
        128 x 128 blocks / 128-column groups (one line naming the module); ZeRO-3 with FP8 or 4-bit weights.
    """
    for kind, refusal in ((Fp8Linear, ZERO3_FP8_REFUSAL), (Int4Linear, ZERO3_INT4_REFUSAL)):
        if plan.is_zero3 and any(isinstance(m, kind) for m in model.modules()):
            raise ShardingError(refusal)
    if not plan.uses_deepspeed:
        return model.to(device).eval()
    import deepspeed

    if plan.mode == "tp":
        check_versions()
        shard_input_embedding(model)
        shard_lm_head(model)
        fp8 = any(isinstance(m, (Fp8Linear, Int4Linear)) for m in model.model.language_model.layers.modules())
        try:
            if _split_gated_deltanet(model) == 0 and fp8:
                raise ShardingError("tensor parallel with FP8 or 4-bit weights needs the Gated DeltaNet layers split "
                                    "by heads, and this model's tp_plan could not be edited")
            if fp8:
                _split_fp8_model(model)
        except (BlockAlignmentError, GroupAlignmentError) as exc:
            what = "128 x 128 FP8 blocks" if isinstance(exc, BlockAlignmentError) else "4-bit groups"
            raise ShardingError(f"tensor parallel over {plan.tp_size} ranks would cut the {what} of "
                                f"{exc}; serve this model on fewer GPUs (or one), or in bf16") from None
    engine = deepspeed.initialize(model=model, config=dict(plan.ds_config))[0]
    _KEEP_ALIVE.append(engine)
    module = engine.module.eval()
    if plan.is_zero3:
        _gather_persistent(module)
    return module


def _split_gated_deltanet(model: torch.nn.Module) -> int:
    """Split every Gated DeltaNet layer by heads over the TP ranks (before AutoTP); returns the layers split.

    transformers' tp_plan marks all five Gated DeltaNet projections ``colwise_gather_output``: each rank then
    all-gathers four projection outputs and runs the whole recurrence, conv and out_proj itself (TP=2 then
    decoded slower than one GPU; measured: docs/performance.md).  Instead each rank keeps its own heads
    (``tp_layers.split_gated_deltanet_heads``: one all-reduce per layer, after ``out_proj``).  The plan's
    ``linear_attn`` entries are removed so AutoTP leaves these layers alone.  Skipped (returns 0) when the plan
    cannot be edited on this model.
    """
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    left = _drop_plan_entries(model, (".linear_attn.",))
    if left:
        log.warning("TP: tp_plan entries %s could not be removed; Gated DeltaNet stays gathered", left)
        return 0
    count, nk_l, nv_l = 0, 0, 0
    for i, layer in enumerate(model.model.language_model.layers):
        la = getattr(layer, "linear_attn", None)
        if la is None:
            continue
        nk_l, nv_l = split_gated_deltanet_heads(la, rank, world, f"model.language_model.layers.{i}.")
        count += 1
    log.info("TP: %d Gated DeltaNet layers split by heads over %d ranks (%d key / %d value heads each)", count,
             world, nk_l, nv_l)
    return count


def _drop_plan_entries(model: torch.nn.Module, parts: tuple[str, ...]) -> list[str]:
    """Remove the tp_plan entries whose pattern contains one of ``parts`` from the model's and its config's plans
    (so AutoTP leaves those modules alone); returns the matching entries still in the plan DeepSpeed reads."""
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    plan = model.__dict__.get("_tp_plan")
    if isinstance(plan, dict):
        model._tp_plan = {k: v for k, v in plan.items() if not any(p in k for p in parts)}
    cfg_plan = getattr(model.config, "base_model_tp_plan", None)
    if isinstance(cfg_plan, dict):
        model.config.base_model_tp_plan = {k: v for k, v in cfg_plan.items() if not any(p in k for p in parts)}
    return [k for k in (_get_hf_tp_plan(model) or {}) if any(p in k for p in parts)]


def _split_fp8_model(model: torch.nn.Module) -> None:
    """TP for a model with FP8 or 4-bit weights: every decoder layer's attention and MLP projections split here
    (``tp_layers.split_projections``, bf16, FP8 and 4-bit layers alike) and their tp_plan entries removed, so AutoTP
    never slices an FP8 weight without its scales.  Raises BlockAlignmentError (``split_projections``) and
    ShardingError when the plan cannot be edited on this model."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    left = _drop_plan_entries(model, (".self_attn.", ".mlp."))
    if left:
        raise ShardingError(f"tensor parallel with FP8 weights: tp_plan entries {left} could not be removed")
    for i, layer in enumerate(model.model.language_model.layers):
        split_projections(layer, rank, world, f"model.language_model.layers.{i}.")
    log.info("TP: FP8 model: attention and MLP projections split on 128 x 128 blocks over %d ranks", world)


def _gather_persistent(module: torch.nn.Module) -> None:
    """ZeRO-3: gather the parameters marked persistent (numel <= stage3_param_persistence_threshold) once.

    DeepSpeed marks them at ``initialize`` but gathers each only at the first forward of its module; the
    engine's runner reads some directly (the Gated DeltaNet ``conv1d.weight``, ``A_log``, ``dt_bias``) without
    calling their module, so they must be whole from the start and stay whole.

    DeepSpeed 0.19.8 releases even persistent parameters after a module's forward while its trace of the module
    order is incomplete (``PartitionedParameterCoordinator.release_sub_module``), and the trace never completes
    here because the runner calls submodules, not the root module.  Flagging them ``is_external_param`` is the
    flag that the coordinator's release path honours, so they are never partitioned again.  Collective: every
    rank runs this with the same model.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    persistent = [p for p in module.parameters() if getattr(p, "ds_persist", False)]
    pending = [p for p in persistent if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if pending:
        pending[0].all_gather(param_list=pending)
    for p in persistent:
        p.is_external_param = True
    log.info("ZeRO-3: %d persistent parameters (%.3g M elements) resident on every rank", len(persistent),
             sum(p.ds_numel for p in persistent) / 1e6)


def local_parameter_count(model: torch.nn.Module) -> int:
    """Parameters this rank holds (elements): ZeRO-3 partitions count their local slice (``ds_tensor``),
    AutoTP shards their local width, replicated tensors in full."""
    total = 0
    for p in model.parameters():
        part = getattr(p, "ds_tensor", None)
        total += int(part.numel()) if part is not None else int(p.numel())
    return total


def is_zero3_partitioned(model: torch.nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 has partitioned the parameters of ``model`` (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())
