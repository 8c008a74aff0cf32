"""Start the engine on every rank: distributed init, sharded loading, start-up report, cross-rank self-check.

``start_engine(cfg)`` is what app.py calls.  It returns the ``ChatEngine`` on rank 0 only; on every other rank
it runs ``executors.worker_loop`` and ends the process (exit 0 after rank 0's exit message, non-zero on failure),
so only rank 0 ever reaches the code that binds the web port.  World size 1 (``python app.py``) goes through
the same steps with no control group and a plain ``LocalExecutor``.

Steps, identical on every rank:
1. rank info from the launcher (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``), the device (``cuda:LOCAL_RANK`` or CPU),
   the sharding plan from ``cfg.ds_config`` (``qwen_chat.engine.parallel.sharding``), process groups (the model's
   default group and the gloo control group with timeout ``cfg.collective_timeout_s``;
   ``qwen_chat.engine.parallel.ranks``);
2. the checkpoint: rank 0 resolves it first (downloads or builds the tiny model), then the others;
   the TP degree is checked against the model's head counts before any weight is loaded;
3. loading (the checkpoint checked: ``checkpoints.layout``; an FP8 checkpoint keeps its FP8 layers), the
   ``--adapter`` merged into the weights (``checkpoints.adapters``), ``--quantize fp8`` / ``int4``
   (``fp8_loading`` / ``int4_loading``),
   sharding, then one report line per rank (rank, device, parameters held, GPU memory) and which weights are FP8;
   rank 0 adds the sharding mode and the kernel each Gated DeltaNet op resolved to;
4. runner + sampler sized from the memory budget (``runner_setup.build_runner``), the start-up self-check
   (``selfcheck.run_self_check``) run on every rank and compared across ranks (a mismatch stops the start-up: ``StartupError``, exit code 78,
   before the engine answers any request);
5. rank 0 builds the ``ChatEngine`` around a ``DistributedExecutor`` (``runner_setup.build_engine``) and hands
   SIGTERM to ``lifecycle.install_rank0_sigterm``; the others enter the worker loop.

With ``--data-parallel N`` (``docs/replicas.md``) the layout is checked first (``layout.ReplicaLayout``), every
rank joins its replica's own world (``replicas.join``: afterwards ``RANK``/``WORLD_SIZE`` are the rank's place
inside its replica, so the steps above run per replica, "rank 0" meaning the replica's lead), rank 0 logs the
layout and opens the link for the other leads; then each lead builds its engine as above.  Rank 0 returns a
its engine (app.py serves it to the web front process, ``core.link.serve_engine``); every other lead serves
its engine to the same front (the link's address from the launcher's store) and never returns.
"""
from __future__ import annotations

import atexit
import logging
import time
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from qwen_chat.config import ConfigError, ServiceConfig
from qwen_chat.engine.model import kv_quant
from qwen_chat.engine.model.memory import MemoryBudgetError
from qwen_chat.engine.parallel import ranks as qdist
from qwen_chat.engine.parallel import sharding
from qwen_chat.engine.parallel.layout import ReplicaLayout
from qwen_chat.engine.startup.selfcheck import SelfCheckError, compare_self_checks, run_self_check
from qwen_chat.lifecycle import die, install_rank0_sigterm

log = logging.getLogger(__name__)


#: Objects kept for the life of the process (rank 0's ``ReplicaWorld``: its ``TCPStore`` server).
_STORES: list = []


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


def _self_check_across_ranks(local_executor, result: dict, groups: Optional[qdist.Groups],
                             info: qdist.RankInfo) -> None:
    """Compare this rank's self-check ``result`` (``run_self_check``) with every other rank's (all ranks call
    this at the same time); raises StartupError on a mismatch or a runner on the wrong kind of device."""
    runner_device = getattr(local_executor.runner, "device", None)
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    if runner_device is not None and expected is not None and runner_device.type != expected.type:
        raise StartupError(f"rank {info.rank}: the runner was placed on {runner_device}, expected {expected}")
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


class BeforeLoading:
    """Seconds of the start-up's steps before the weights load, for one log line (``describe``): the imports
    of torch and the engine's modules (measured by the caller), the device (CUDA's initialisation), the process
    groups, the modules imported on the way (transformers, the kernels) and the checkpoint (found or built,
    its folder and config checked)."""

    def __init__(self, imports_s: Optional[float] = None) -> None:
        self.parts: list[tuple[str, float]] = [] if imports_s is None else [("imports", imports_s)]
        self._t = time.monotonic()

    def mark(self, step: str) -> None:
        """``step`` ended now: it took the time since the previous mark (or the start)."""
        now = time.monotonic()
        self.parts.append((step, now - self._t))
        self._t = now

    def describe(self) -> str:
        """E.g. ``"9.8 s: imports 6.1 s, device 2.0 s, process groups 0.0 s, ..."``."""
        return f"{sum(s for _, s in self.parts):.1f} s: " + ", ".join(f"{n} {s:.1f} s" for n, s in self.parts)


def start_engine(cfg: ServiceConfig, link=None, imports_s: Optional[float] = None):
    """Bring up the engine on this rank (see the module docstring for the steps).  ``imports_s``: seconds the
    caller took to import this module (torch and the engine's modules), for the start-up log.

    Returns:
        the ``ChatEngine`` (``qwen_chat.engine.core.chat_engine``) on rank 0, or with several data-parallel
        replicas replica 0's (the web front routes over all of them).  Other ranks never return: they serve plans until their lead's
        exit message (a replica's lead: its engine to rank 0, until rank 0's close) and then leave the process
        with code 0.
    Raises:
        StartupError: on any rank, for anything that stops the start-up (bad ds_config or TP degree, model not
        loadable, self-check mismatch); app.py turns it into exit code 78 (``EXIT_STARTUP_FAILED``).
    """
    try:
        layout = ReplicaLayout.from_env(cfg.data_parallel, cfg.ds_config)
        if layout.world_size > 1:
            qdist.start_launcher_watchdog()
    except (ValueError, ConfigError) as exc:
        raise StartupError(str(exc)) from exc
    steps = BeforeLoading(imports_s)
    world = _join_replicas(layout)
    try:
        info = qdist.RankInfo.from_env(local_rank_arg=cfg.local_rank)  # inside this rank's replica
        device = resolve_device(cfg, info)
        if device.type == "cuda":
            torch.zeros(1, device=device)  # CUDA's context now, so that the log says what it took
        steps.mark("device")
        kv_quant.check_device(cfg.kv_cache_dtype, device)
        if world is not None:
            world.announce(device)
        plan = sharding.read_plan(cfg.ds_config, info.world_size, device.type)
    except (ValueError, ConfigError) as exc:
        raise StartupError(str(exc)) from exc
    try:
        groups = qdist.init_process_groups(info, device, cfg.collective_timeout_s,
                                           need_default_group=plan.uses_deepspeed,
                                           store=world.replica_store if world is not None else None)
        if world is not None and layout.rank == 0:
            world.publish_link(link.address, link.token)
        steps.mark("process groups")
        engine_or_none = _start(cfg, info, device, plan, groups, steps)
    except (MemoryBudgetError, SelfCheckError) as exc:  # one line that says what to change or check
        log.error("rank %d: start-up failed: %s", info.rank, exc)
        raise StartupError(str(exc)) from None
    except StartupError as exc:  # its message says what to change: no traceback in the way
        log.error("rank %d: start-up failed: %s", info.rank, exc)
        raise
    except Exception as exc:  # noqa: BLE001 - turned into a start-up error with the cause in the log
        log.error("rank %d: start-up failed", info.rank, exc_info=True)
        raise StartupError(f"rank {info.rank}: {type(exc).__name__}: {exc}") from exc
    if engine_or_none is None:  # a worker rank after the exit message
        die(f"rank {info.rank}: worker stopped cleanly", code=0)
    if world is not None and layout.rank == 0:
        # rank 0 hosts the launcher-wide store: it must outlive start_engine, for the other leads still reading
        # the link's address from it
        _STORES.append(world)
    if world is None or layout.rank == 0:
        return engine_or_none
    return _serve_replica(engine_or_none, world)


def _join_replicas(layout: ReplicaLayout):
    """``replicas.join`` when there are several replicas (else None); StartupError when the ranks cannot meet."""
    if layout.replicas == 1:
        return None
    from qwen_chat.engine.parallel import replicas

    try:
        return replicas.join(layout)
    except Exception as exc:  # noqa: BLE001 - TCPStore: port busy, rank 0 never came
        raise StartupError(f"rank {layout.rank}: the ranks cannot meet at MASTER_ADDR:MASTER_PORT: {exc}") from exc


def _serve_replica(engine, world):
    """The lead of a replica >= 1 with its engine started: serve it to the web front (the link's address and
    secret from the launcher's store) and leave the process (code 0 after the front's orderly close or this
    process's SIGTERM)."""
    from qwen_chat.engine.core.link import serve_engine

    layout = world.layout
    try:
        address, token = world.link()
    except Exception as exc:  # noqa: BLE001 - store timeout
        raise StartupError(f"replica {layout.replica}: cannot find the web front's link: {exc}") from exc
    if serve_engine(engine, address, token, layout.replica, list(layout.ranks_of(layout.replica)),
                    host=world.engine_host()):
        die(f"replica {layout.replica}: lead stopped cleanly", code=0)
    die(f"replica {layout.replica}: a worker rank was already gone at shutdown")


def _start(cfg: ServiceConfig, info: qdist.RankInfo, device: torch.device, plan: sharding.ShardingPlan,
           groups: Optional[qdist.Groups], steps: BeforeLoading):
    from transformers import AutoConfig

    from qwen_chat.engine.parallel.executors import DistributedExecutor, LocalExecutor, worker_loop
    from qwen_chat.engine.checkpoints.adapters import describe_merge, merge_adapter, read_adapter
    from qwen_chat.engine.checkpoints import fp8_loading, int4_loading
    from qwen_chat.engine.model.fp8 import describe_weights
    from qwen_chat.engine.checkpoints.layout import CheckpointError, inspect_checkpoint
    from qwen_chat.engine.checkpoints.loading import describe_kernels, load_model
    from qwen_chat.engine.startup.runner_setup import build_engine
    from qwen_chat.engine.startup.runner_setup import build_runner

    steps.mark("engine modules")
    path = _resolve_checkpoint_in_order(cfg, info, groups)
    try:  # the folder and the adapter are checked before any weight loads; each refusal is one line
        report = inspect_checkpoint(path)
        if plan.is_zero3 and (report.fp8 is not None or cfg.quantize == "fp8"):
            raise sharding.ShardingError(sharding.ZERO3_FP8_REFUSAL)
        if plan.is_zero3 and (report.int4 is not None or cfg.quantize == "int4"):
            raise sharding.ShardingError(sharding.ZERO3_INT4_REFUSAL)
        adapter = read_adapter(cfg.adapter, zero3=plan.is_zero3) if cfg.adapter else None
        sharding.check_tp_degree(AutoConfig.from_pretrained(path).get_text_config(), plan.tp_size)
    except (CheckpointError, sharding.ShardingError) as exc:
        raise StartupError(str(exc)) from exc
    steps.mark("checkpoint")
    if info.is_main:
        log.info("before loading the weights: %s", steps.describe())
    t0 = time.monotonic()
    log.info("rank %d: loading %s (%s)", info.rank, path, plan.mode)
    sharding.prepare_loading(plan)
    quantize = cfg.quantize if cfg.quantize in ("fp8", "int4") else None
    try:  # load -> merge the adapter -> quantise -> shard
        # with --quantize the bf16 weights stay on the host: each layer is quantised on the device, where only
        # its FP8 copy stays (the budget then measures the FP8 weights)
        loaded = load_model(path, str(device), dtype=plan.dtype,
                            place_on_device=not plan.uses_deepspeed and not quantize, report=report)
        if adapter is not None:
            merged = merge_adapter(loaded.model, adapter)
            if info.is_main:
                log.info("%s", describe_merge(adapter, merged))
        if quantize:
            (fp8_loading if quantize == "fp8" else int4_loading).quantize_model(loaded.model, device=device)
    except CheckpointError as exc:
        raise StartupError(str(exc)) from exc
    t1 = time.monotonic()
    try:
        loaded.model = sharding.shard_model(loaded.model, plan, device)
    except sharding.ShardingError as exc:
        raise StartupError(str(exc)) from exc
    t2 = time.monotonic()
    mode = plan.mode if plan.uses_deepspeed else "single"
    loaded.info = replace(loaded.info, world_size=info.world_size, mode=mode)
    log.info("rank %d/%d: device %s, parameters held %.4g M, %s, load %.1f s + shard %.1f s", info.rank,
             info.world_size, device, sharding.local_parameter_count(loaded.model) / 1e6, _memory_report(device),
             t1 - t0, t2 - t1)
    if info.is_main:
        source = " + ".join(([] if report.fp8 is None and report.int4 is None else ["checkpoint"])
                            + ([f"--quantize {quantize}"] if quantize else []))
        log.info("%s", describe_weights(loaded.model, source))
        log.info("sharding: %s", plan.describe())
        for op, impl in describe_kernels().items():
            log.info("kernel: %s -> %s", op, impl)

    if not info.is_main:
        local = LocalExecutor(*build_runner(loaded, cfg)[:2])
        _self_check_across_ranks(local, run_self_check(local, loaded.tokenizer), groups, info)
        qdist.unlink_deepspeed_shm(info.rank)
        log.info("rank %d: ready, waiting for plans from rank 0", info.rank)
        worker_loop(local, groups.control)
        log.info("rank %d: stopping; %s", info.rank, _memory_report(device))
        return None

    def executor_factory(local, self_check: dict):
        log.info("runner implementation: %s", local.runner.impl)
        _self_check_across_ranks(local, self_check, groups, info)
        if groups is None:
            return local
        qdist.unlink_deepspeed_shm(info.rank)
        executor = DistributedExecutor(local, groups.control, cfg.collective_timeout_s)
        atexit.register(executor.close)
        install_rank0_sigterm(executor.close)
        return executor

    return build_engine(loaded, cfg, executor_factory=executor_factory)
