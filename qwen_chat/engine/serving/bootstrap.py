"""Start the engine on every rank: distributed init, sharded loading, start-up report, cross-rank self-check.

``start_engine(cfg)`` is what app.py calls.  It returns the ``ChatEngine`` on rank 0 only; on every other rank
it runs ``dist.worker_loop`` and ends the process (exit 0 after rank 0's exit message, non-zero on failure),
so only rank 0 ever reaches the code that binds the web port.  World size 1 (``python app.py``) goes through
the same steps with no control group and a plain ``LocalExecutor``.

Steps, identical on every rank:
1. rank info from the launcher (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``), the device (``cuda:LOCAL_RANK`` or CPU),
   the sharding plan from ``cfg.ds_config`` (``qwen_chat.engine.parallel.sharding``), process groups (the model's default
   group and the gloo control group with timeout ``cfg.collective_timeout_s``);
2. the checkpoint: rank 0 resolves it first (downloads or builds the tiny model), then the others;
   the TP degree is checked against the model's head counts before any weight is loaded;
3. loading + sharding, then one report line per rank (rank, device, parameters held, GPU memory);
   rank 0 adds the sharding mode and the kernel each Gated DeltaNet op resolved to;
4. runner + sampler (``service.build_runner``), a fixed greedy self-check run on every rank and compared
   across ranks (a mismatch stops the start-up with a non-zero exit before the port opens);
5. rank 0 builds the ``ChatEngine`` around a ``DistributedExecutor``; the others enter the worker loop.
"""
from __future__ import annotations

import atexit
import logging
import math
import signal
import threading
import time
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from qwen_chat.config import ConfigError, ServiceConfig
from qwen_chat.engine.parallel import ranks as qdist
from qwen_chat.engine.parallel import sharding
from qwen_chat.engine.serving.requests import PrefillItem, PreparedPrompt, SamplingParams, StepPlan

log = logging.getLogger(__name__)

#: Fixed prompt of the cross-rank self-check and the number of greedy tokens compared.
SELF_CHECK_TEXT = "Self-check: the capital of France is"
SELF_CHECK_TOKENS = 8

#: Relative tolerance when comparing the self-check's prefill-logit checksums across ranks.  Every rank ends
#: with the same (all-reduced or all-gathered) activations, so they agree to rounding at most.
CHECKSUM_RTOL = 1e-4


class StartupError(RuntimeError):
    """The engine cannot start on this rank (bad sharding config, model not loadable, self-check mismatch).
    The message is meant for the person starting the service."""


def resolve_device(cfg: ServiceConfig, info: qdist.RankInfo) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is requested or available (``--device``), else CPU.

    Raises: StartupError when ``--device cuda`` is asked for but no GPU (or too few GPUs) is visible.
    """
    want = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise StartupError("--device cuda was given but no CUDA GPU is visible")
    if info.local_rank >= torch.cuda.device_count():
        raise StartupError(f"local rank {info.local_rank} has no GPU: only {torch.cuda.device_count()} visible "
                           "(lower NUM_GPUS)")
    device = torch.device("cuda", info.local_rank)
    torch.cuda.set_device(device)
    return device


def _resolve_checkpoint_in_order(cfg: ServiceConfig, info: qdist.RankInfo, groups: Optional[qdist.Groups]):
    """Rank 0 resolves (download / tiny build) first; the others follow once it succeeded (same cache)."""
    from qwen_chat.engine.checkpoints.loading import resolve_checkpoint

    if groups is None:
        return resolve_checkpoint(cfg.model, cfg.cache_dir)
    outcome = [None]
    path = None
    if info.is_main:
        try:
            path = resolve_checkpoint(cfg.model, cfg.cache_dir)
            outcome = ["ok"]
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            outcome = [f"{type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(outcome, src=0, group=groups.startup)
    if outcome[0] != "ok":
        raise StartupError(f"cannot resolve model {cfg.model!r}: {outcome[0]}")
    return path if info.is_main else resolve_checkpoint(cfg.model, cfg.cache_dir)


def _memory_report(device: torch.device) -> str:
    if device.type != "cuda":
        return "GPU memory n/a (CPU)"
    gib = 1024 ** 3
    return (f"GPU memory {torch.cuda.memory_allocated(device) / gib:.2f} GiB allocated, "
            f"{torch.cuda.max_memory_allocated(device) / gib:.2f} GiB peak")


def run_self_check(local_executor, tokenizer) -> dict:
    """Greedy-decode ``SELF_CHECK_TOKENS`` tokens of ``SELF_CHECK_TEXT`` in slot 0 and free it.

    Every rank calls this at the same time with identical inputs (collectives inside the sharded layers).

    Returns: ``{"tokens": list[int], "checksum": float}`` - the greedy ids and the float64 sum of the fp32
    prefill logits [V].
    """
    ids = torch.tensor(tokenizer.encode(SELF_CHECK_TEXT), dtype=torch.int64)
    prompt = PreparedPrompt(input_ids=ids, max_new_tokens=SELF_CHECK_TOKENS)
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, presence_penalty=0.0, seed=0,
                            max_new_tokens=SELF_CHECK_TOKENS, stop_token_ids=())
    runner = local_executor.runner
    with torch.no_grad():
        checksum = float(runner.prefill(0, prompt).double().sum())
        runner.free(0)
    tokens = [local_executor.execute(StepPlan(op="selfcheck", prefills=[PrefillItem(0, prompt, params)]))[0]]
    for _ in range(SELF_CHECK_TOKENS - 1):
        tokens.append(local_executor.execute(StepPlan(op="selfcheck", decode_slots=[0],
                                                      decode_tokens=[tokens[-1]]))[0])
    local_executor.execute(StepPlan(op="selfcheck", free_slots=[0]))
    return {"tokens": tokens, "checksum": checksum}


def compare_self_checks(results: list[dict]) -> Optional[str]:
    """None when every rank's self-check equals rank 0's (tokens exactly, checksum within ``CHECKSUM_RTOL``);
    otherwise a message naming the first rank that differs."""
    ref = results[0]
    for rank, res in enumerate(results[1:], start=1):
        same_sum = math.isclose(res["checksum"], ref["checksum"], rel_tol=CHECKSUM_RTOL, abs_tol=1e-6)
        if res["tokens"] != ref["tokens"] or not same_sum:
            return (f"rank {rank} disagrees with rank 0 on the self-check: tokens {res['tokens']} vs "
                    f"{ref['tokens']}, logit checksum {res['checksum']:.6g} vs {ref['checksum']:.6g}")
    return None


def _self_check_across_ranks(local_executor, tokenizer, groups: Optional[qdist.Groups],
                             info: qdist.RankInfo) -> None:
    runner_device = getattr(local_executor.runner, "device", None)
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    if runner_device is not None and expected is not None and runner_device.type != expected.type:
        raise StartupError(f"rank {info.rank}: the runner was placed on {runner_device}, expected {expected}")
    result = run_self_check(local_executor, tokenizer)
    if groups is None:
        results = [result]
    else:
        results = [None] * info.world_size
        dist.all_gather_object(results, result, group=groups.startup)
    problem = compare_self_checks(results)
    if problem:
        raise StartupError(f"sharding self-check failed: {problem}")
    if info.is_main:
        log.info("self-check passed on %d rank(s): greedy tokens %s, logit checksum %.6g", info.world_size,
                 result["tokens"], result["checksum"])


def _install_sigterm(executor) -> None:
    """Rank 0: SIGTERM sends the exit message to the workers, then leaves with code 0 (SystemExit, so that
    app.py's cleanup still runs), or at once with code 1 when a worker was already gone.  uvicorn captures
    SIGTERM while serving and re-raises it here after its graceful shutdown."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, frame):
        # The launcher forwards the group's SIGTERM, so it arrives twice: a second run of this handler inside
        # the first one's executor.close() would deadlock on the executor's lock.
        if qdist.STOPPING.is_set():
            return
        qdist.STOPPING.set()
        log.info("rank 0: SIGTERM; stopping all ranks")
        if not executor.close():
            qdist.die("rank 0: a worker rank was already gone at shutdown")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)


def start_engine(cfg: ServiceConfig):
    """Bring up the engine on this rank (see the module docstring for the steps).

    Returns:
        the ``ChatEngine`` (``qwen_chat.engine.serving.chat_engine``) on rank 0.  Other ranks never return: they serve
        plans until rank 0's exit message and then leave the process with code 0.
    Raises:
        StartupError: on any rank, for anything that stops the start-up (bad ds_config or TP degree, model not
        loadable, self-check mismatch); app.py turns it into exit code 1.
    """
    try:
        info = qdist.RankInfo.from_env(local_rank_arg=cfg.local_rank)
        if info.world_size > 1:
            qdist.start_launcher_watchdog()
        device = resolve_device(cfg, info)
        plan = sharding.read_plan(cfg.ds_config, info.world_size, device.type)
    except (ValueError, ConfigError) as exc:
        raise StartupError(str(exc)) from exc
    try:
        groups = qdist.init_process_groups(info, device, cfg.collective_timeout_s,
                                           need_default_group=plan.uses_deepspeed)
        engine_or_none = _start(cfg, info, device, plan, groups)
    except StartupError:
        log.error("rank %d: start-up failed", info.rank, exc_info=True)
        raise
    except Exception as exc:  # noqa: BLE001 - turned into a start-up error with the cause in the log
        log.error("rank %d: start-up failed", info.rank, exc_info=True)
        raise StartupError(f"rank {info.rank}: {type(exc).__name__}: {exc}") from exc
    if engine_or_none is None:  # a worker rank after the exit message
        qdist.die(f"rank {info.rank}: worker stopped cleanly", code=0)
    return engine_or_none


def _start(cfg: ServiceConfig, info: qdist.RankInfo, device: torch.device, plan: sharding.ShardingPlan,
           groups: Optional[qdist.Groups]):
    from transformers import AutoConfig

    from qwen_chat.engine.parallel.executors import LocalExecutor
    from qwen_chat.engine.checkpoints.loading import describe_kernels, load_model
    from qwen_chat.engine.serving.chat_engine import build_engine, build_runner

    path = _resolve_checkpoint_in_order(cfg, info, groups)
    try:
        sharding.check_tp_degree(AutoConfig.from_pretrained(path).get_text_config(), plan.tp_size)
    except sharding.ShardingError as exc:
        raise StartupError(str(exc)) from exc
    t0 = time.monotonic()
    log.info("rank %d: loading %s (%s)", info.rank, path, plan.mode)
    sharding.prepare_loading(plan)
    loaded = load_model(path, str(device), dtype=plan.dtype, place_on_device=not plan.uses_deepspeed)
    t1 = time.monotonic()
    loaded.model = sharding.shard_model(loaded.model, plan, device)
    t2 = time.monotonic()
    mode = plan.mode if plan.uses_deepspeed else "single"
    loaded.info = replace(loaded.info, world_size=info.world_size, mode=mode)
    log.info("rank %d/%d: device %s, parameters held %.4g M, %s, load %.1f s + shard %.1f s", info.rank,
             info.world_size, device, sharding.local_parameter_count(loaded.model) / 1e6, _memory_report(device),
             t1 - t0, t2 - t1)
    if info.is_main:
        log.info("sharding: %s", plan.describe())
        for op, impl in describe_kernels().items():
            log.info("kernel: %s -> %s", op, impl)

    if not info.is_main:
        runner, sampler = build_runner(loaded, cfg)
        local = LocalExecutor(runner, sampler)
        _self_check_across_ranks(local, loaded.tokenizer, groups, info)
        qdist.unlink_deepspeed_shm(info.rank)
        log.info("rank %d: ready, waiting for plans from rank 0", info.rank)
        qdist.worker_loop(local, groups.control)
        log.info("rank %d: stopping; %s", info.rank, _memory_report(device))
        return None

    def executor_factory(runner, sampler):
        local = LocalExecutor(runner, sampler)
        log.info("runner implementation: %s", runner.impl)
        _self_check_across_ranks(local, loaded.tokenizer, groups, info)
        if groups is None:
            return local
        qdist.unlink_deepspeed_shm(info.rank)
        executor = qdist.DistributedExecutor(local, groups.control, cfg.collective_timeout_s)
        atexit.register(executor.close)
        _install_sigterm(executor)
        return executor

    return build_engine(loaded, cfg, executor_factory=executor_factory)
