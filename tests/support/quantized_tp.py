"""Tensor parallel over 2 CPU ranks (gloo) with quantized weights: the body both FP8 and 4-bit tests run (and
``fp8_kv_tp_body``: the FP8 KV cache's).

``quantized_tp_body(rank, report, ...)`` (bind its keywords with ``functools.partial`` and give it to
``two_ranks.run_two_ranks``) builds a small Qwen3.5 whose MLP width keeps the quantization blocks whole on each
rank, quantizes it, decodes greedily on one rank and sharded over both, and records in ``report``: ``tp1`` and
``tp2`` (the tokens of both prompts, unsharded and sharded), ``rel_err`` (of the sharded logits against the
unsharded ones), ``row_parallel`` (row-parallel layers whose shards stayed quantized), ``quantized_layers``
(``fp8.weights_report``'s count for the kind) and ``refusal`` (the sharding error for a width that cuts a
block; None when it was accepted).
"""
from __future__ import annotations

import copy
import os
from typing import Callable

import torch
from transformers import Qwen3_5ForConditionalGeneration

from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PreparedPrompt
from tests.support.small_model import rel_err


def greedy_two_prompts(model, steps: int = 6, kv_dtype=None) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of two prompts decoded together for ``steps`` steps after their prefill, and the logits of
    every step (float [2 * (steps + 1), vocab]); ``kv_dtype``: the runner's KV cache storage."""
    runner = ModelRunner(model, num_slots=2, max_context=128, device="cpu", kv_dtype=kv_dtype)
    prompts = [torch.arange(5, 17), torch.arange(100, 103)]
    logits = torch.stack([runner.prefill(s, PreparedPrompt(input_ids=p)) for s, p in enumerate(prompts)])
    tokens, rows = [[int(x)] for x in logits.argmax(-1)], [logits]
    for _ in range(steps):
        logits = runner.decode([0, 1], torch.tensor([t[-1] for t in tokens]))
        rows.append(logits)
        for t, nxt in zip(tokens, logits.argmax(-1).tolist()):
            t.append(nxt)
    return tokens, torch.cat(rows)


def _launcher_env(rank: int) -> None:
    """What a launcher sets (DeepSpeed needs LOCAL_RANK; its CPU all-reduce names its buffers by the port)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getppid() % 20000))


def fp8_kv_tp_body(rank: int, report: dict, *, config) -> None:
    """One rank's part of the FP8 KV cache under tensor parallelism: the model of ``config`` decoded greedily with
    an FP8 cache on one rank and sharded over both; records ``tp1``, ``tp2`` and ``rel_err`` as
    ``quantized_tp_body`` does."""
    from qwen_chat.engine.model.kv_quant import FP8
    from qwen_chat.engine.parallel import sharding
    from qwen_chat.engine.parallel.ranks import unlink_deepspeed_shm

    _launcher_env(rank)
    plan = sharding.read_plan(None, 2, "cpu")
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    report["tp1"], ref = greedy_two_prompts(copy.deepcopy(model), kv_dtype=FP8)
    sharded = sharding.shard_model(model, plan, torch.device("cpu"))
    torch.distributed.barrier()  # every rank has mapped the others' buffers
    unlink_deepspeed_shm(rank)
    report["tp2"], out = greedy_two_prompts(sharded, kv_dtype=FP8)
    report["rel_err"] = rel_err(out, ref)


def quantized_tp_body(rank: int, report: dict, *, config_of: Callable[[int], object],
                      quantize: Callable[[torch.nn.Module], object], kind: str, fits: int, cuts: int) -> None:
    """One rank's part (module docstring).  ``config_of(width)``: the model config with that MLP width;
    ``quantize(model)``: quantizes it in place; ``kind``: "fp8" or "int4"; ``fits`` / ``cuts``: MLP widths whose
    shards keep / cut the quantization blocks."""
    from qwen_chat.engine.model import fp8
    from qwen_chat.engine.parallel import sharding
    from qwen_chat.engine.parallel.ranks import unlink_deepspeed_shm
    from qwen_chat.engine.parallel.tp_layers import RowParallelLinear

    _launcher_env(rank)
    plan = sharding.read_plan(None, 2, "cpu")
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config_of(fits)).eval()
    quantize(model)
    report["tp1"], ref = greedy_two_prompts(copy.deepcopy(model))
    sharded = sharding.shard_model(model, plan, torch.device("cpu"))
    torch.distributed.barrier()  # every rank has mapped the others' buffers
    unlink_deepspeed_shm(rank)
    rows = [m for m in sharded.modules() if isinstance(m, RowParallelLinear)]
    report["row_parallel"] = sum(getattr(m, f"{kind}_weight")() is not None for m in rows)
    report["quantized_layers"] = fp8.weights_report(sharded)[f"{kind}_modules"]
    report["tp2"], out = greedy_two_prompts(sharded)
    report["rel_err"] = rel_err(out, ref)
    torch.manual_seed(0)
    cut = Qwen3_5ForConditionalGeneration(config_of(cuts)).eval()
    quantize(cut)
    try:
        sharding.shard_model(cut, plan, torch.device("cpu"))
        report["refusal"] = None
    except sharding.ShardingError as exc:
        report["refusal"] = str(exc)
