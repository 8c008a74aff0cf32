"""Build the runner and sampler the service runs: size them from the memory budget, capture the first graphs.

``build_runner(loaded, config)`` is called on every rank (the sizes are agreed across ranks: each rank measures
its own budget and all take the smallest, so every rank holds the same slots and blocks).  The budget
(``size_memory``): ``--memory-budget-gib`` when given; on CUDA what ``--gpu-memory-utilization`` leaves after the
weights (measured: what the process holds after loading, so FP8 weights count at their size) and the activation
reserve (``memory.gpu_memory``, ``memory.activation_reserve``, plus ``fusion.dequant_bytes`` with FP8); on CPU
``CPU_BUDGET_GIB``.  Its split into state slots, KV blocks and the longest context is ``memory.plan_memory``.
"""
from __future__ import annotations

import gc
import logging
from typing import Callable, Optional

import torch

from qwen_chat.config import ServiceConfig
from qwen_chat.engine.core.chat_engine import ChatEngine
from qwen_chat.engine.core.spec_policy import MIN_ACCEPTANCE
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.startup import compile_stats
from qwen_chat.engine.startup.selfcheck import run_self_check
from qwen_chat.lifecycle import exit_process_soon
from qwen_chat.engine.model import fusion, graphs, kv_quant, memory
from qwen_chat.engine.model.fla_tuning import use_measured_configs
from qwen_chat.engine.model.memory import GIB, MemoryPlan
from qwen_chat.engine.model.mtp import with_mtp_layer
from qwen_chat.engine.model.options import auto_prefill_graphs
from qwen_chat.engine.model.prefill_graph import PREFILL_BUCKETS
from qwen_chat.engine.parallel.sharding import is_zero3_partitioned
from qwen_chat.engine.model.state import Geometry, probe_geometry
from qwen_chat.engine.parallel.tp_decode import is_tensor_parallel

log = logging.getLogger(__name__)

#: Memory budget of the sequences on CPU when ``--memory-budget-gib`` is not given (GiB).
CPU_BUDGET_GIB = 0.25
#: Context buckets (tokens) whose decode graphs are captured, for every batch size, before the service says
#: ready; batch 1 is captured at every context bucket too (about 0.1 s each once the glue is compiled: a lone
#: user's long prompt does not wait for its window's graph, measured 143 ms on an H200 for 8k tokens); the
#: other shapes are captured while the engine is idle, or on first use (``idle_captures``).
READY_CONTEXTS = (512, 1024)
#: Context buckets captured while idle after start-up (up to this many tokens; longer ones on first use).
IDLE_CONTEXT_LIMIT = 4096


def _agree(value: int) -> int:
    """The smallest ``value`` over every rank (the identity without several ranks)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _largest_gathered_parameter(model) -> int:
    """Bytes of the largest parameter that ZeRO-3 gathers onto the GPU for a forward (its full size; 0 when
    nothing is partitioned): transient memory the budget must leave free."""
    sizes = [int(p.ds_numel) * p.element_size() for p in model.parameters() if hasattr(p, "ds_numel")]
    return max(sizes, default=0)


def size_memory(loaded, config: ServiceConfig, device: torch.device,
                mtp: bool = False) -> tuple[MemoryPlan, int, str, Geometry]:
    """(the memory plan, prefill tokens per step, how the budget was found, the model's probed geometry, which
    the runner is built with) for ``loaded`` on ``device``.

    Collective under several ranks (all call it together).  Raises ``memory.MemoryBudgetError`` (one line) when
    the budget cannot hold one sequence.  ``mtp``: speculative decoding with the MTP head: its KV cache is
    planned too (``mtp.with_mtp_layer``) and the verify step's state snapshots are taken off the budget first.
    """
    model = loaded.model
    tc = model.config.text_config
    lm = model.model.language_model
    dtype = lm.embed_tokens.weight.dtype
    geometry = probe_geometry(list(lm.layers), hidden_size=tc.hidden_size, device=device, dtype=dtype,
                              kv_dtype=kv_quant.storage_dtype(config.kv_cache_dtype, dtype))
    chunk = config.prefill_chunk_tokens
    if config.memory_budget_gib is not None:
        budget, how = int(config.memory_budget_gib * GIB), "--memory-budget-gib"
        chunk = chunk or memory.CHUNK_CHOICES[0]
    elif device.type == "cuda":
        usable, held, how = memory.gpu_memory(device, utilization=config.gpu_memory_utilization)
        chunk = chunk or memory.prefill_chunk(tc, geometry, free_after_weights=usable - held)
        slots = max(1, memory.state_slots(geometry, usable - held, config.max_batch))
        gathered = _largest_gathered_parameter(model)
        zero3 = is_zero3_partitioned(model)
        graph_tokens = PREFILL_BUCKETS[-1] if auto_prefill_graphs(
            cuda=True, zero3=zero3, tensor_parallel=is_tensor_parallel(model, zero3)) else 0
        reserve = memory.activation_reserve(tc, geometry, prefill_tokens=chunk, max_slots=slots,
                                            graph_prefill_tokens=graph_tokens)
        dequant = fusion.dequant_bytes(model, dtype)
        if graph_tokens:  # the prefill graphs' own pool holds a dequantised FP8 / 4-bit weight too
            dequant *= 2
        budget = usable - held - reserve - gathered - dequant
        how += (f" - {held / GIB:.2f} GiB held (weights) - {reserve / GIB:.2f} GiB activation reserve"
                + (f" - {gathered / GIB:.2f} GiB for the largest parameter ZeRO-3 gathers" if gathered else "")
                + (f" - {dequant / GIB:.2f} GiB for the largest FP8 weight a prefill dequantises (twice with prefill "
                   "graphs)" if dequant else ""))
    else:
        budget, how = int(CPU_BUDGET_GIB * GIB), f"CPU default ({CPU_BUDGET_GIB} GiB)"
        chunk = chunk or memory.CHUNK_CHOICES[0]
    if mtp:  # the verify step's Gated DeltaNet snapshots (``speculative.SpecBuffers``)
        rows = config.speculative_tokens * graphs.graph_batch_sizes(config.speculative_max_batch)[-1]
        budget -= rows * geometry.slot_bytes()
        how += f" - {rows * geometry.slot_bytes() / GIB:.2f} GiB of speculative decoding's state snapshots"
    budget = _agree(budget)
    model_context = int(loaded.info.context_length)
    if config.max_context is not None and config.max_context > model_context:
        log.warning("--max-context %d is above the model's own %d tokens: capped there", config.max_context,
                    model_context)
    advice = memory.GPU_ADVICE if device.type == "cuda" else memory.CPU_ADVICE
    if mtp:
        geometry = with_mtp_layer(geometry)
    plan = memory.plan_memory(geometry, budget_bytes=budget, model_context=model_context,
                              max_slots=config.max_batch, max_context=config.max_context, advice=advice)
    return plan, _agree(int(min(chunk, plan.max_context))), how, geometry


def idle_captures(runner) -> list[tuple[int, int]]:
    """(batch, context) decode graphs still to capture while idle (empty without CUDA graphs): one sequence
    at every context bucket not held yet, shortest first (``build_runner`` captures them before ready), then
    every batch size up to ``IDLE_CONTEXT_LIMIT`` tokens, shortest context first (longer windows of larger
    batches are captured on first use)."""
    if not runner.use_cuda_graphs:
        return []
    held = set(runner.graphs.decode_shapes())
    buckets, sizes = runner.context_buckets(), runner.graph_batch_sizes()
    lone = [(sizes[0], c) for c in buckets]
    rest = [(b, c) for c in buckets if c <= IDLE_CONTEXT_LIMIT for b in sizes]
    return [shape for shape in dict.fromkeys(lone + rest) if shape not in held]


def build_runner(loaded, config: ServiceConfig):
    """The ``ModelRunner`` and ``Sampler`` for ``loaded`` as ``config`` asks (every rank builds the same).

    Sizes: ``size_memory``.  Device: the device of the model's parameters.  Implementation:
    production's ``RunnerOptions`` with the tensor-parallel all-reduce of ``config.tp_allreduce`` and
    ``config.tp_fused``.  With CUDA graphs, the decode graphs of ``READY_CONTEXTS`` are captured for every batch
    size before this returns, and the prefill's kernels are compiled (``warmup.warm_up_prefill``).  With
    ``--speculative-tokens`` the checkpoint's MTP head is loaded and attached (``spec_step.attach``; its verify
    graphs captured too); a checkpoint without a readable head logs why and runs without speculation.

    Returns: ``(runner, sampler, plan, prefill tokens per step)``.  Raises ``memory.MemoryBudgetError``.
    """
    from qwen_chat.engine.model.mtp import load_mtp_head
    from qwen_chat.engine.model.options import RunnerOptions
    from qwen_chat.engine.model.spec_step import attach
    from qwen_chat.engine.model.runner import ModelRunner
    from qwen_chat.engine.model.sampling import Sampler
    from qwen_chat.engine.parallel.collectives import broadcast_from_rank0
    from qwen_chat.engine.startup.warmup import warm_up_prefill

    device = next(loaded.model.parameters()).device
    tuning = use_measured_configs(device)  # before any prefill: fla's kernels skip autotuning on a known GPU
    if tuning:
        log.info("%s", tuning)
    head = None
    if config.speculative_tokens:  # loaded before the budget is measured, so that it counts the head's weights
        try:
            head = load_mtp_head(loaded.checkpoint, loaded.model.config.text_config, device=device,
                                 dtype=loaded.model.model.language_model.embed_tokens.weight.dtype)
        except ValueError as exc:
            log.warning("speculative decoding is off: %s", exc)
        else:
            if head is None:
                log.warning("speculative decoding is off: %s has no MTP head (mtp.* tensors)", loaded.checkpoint)
    plan, chunk, how, geometry = size_memory(loaded, config, device, mtp=head is not None)
    log.info("%s (budget: %s; KV cache %s)", plan.describe(), how,
             "FP8 e4m3, a scale per position and KV head" if kv_quant.is_quantized(geometry.kv_storage)
             else str(geometry.kv_storage).replace("torch.", ""))
    options = RunnerOptions(tp_allreduce=config.tp_allreduce, tp_fused=config.tp_fused)
    runner = ModelRunner(loaded.model, num_slots=plan.num_slots, max_context=plan.max_context,
                         num_blocks=plan.num_blocks, block_tokens=plan.block_tokens, device=device, options=options,
                         geometry=geometry)
    if head is not None:
        attach(runner, head, k=config.speculative_tokens, max_batch=config.speculative_max_batch)
    sampler = Sampler(plan.num_slots, runner.vocab_size, device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # every rank records rank 0's tokens on its device, so steps can be launched ahead on every rank
        sampler.token_sync = broadcast_from_rank0
    tally = compile_stats.shared()
    if runner.use_cuda_graphs:
        mark = tally.mark()
        ready = [c for c in runner.context_buckets() if c in READY_CONTEXTS] or runner.context_buckets()[:1]
        runner.capture_all(context_buckets=ready)
        held = runner.capture_all(batch_sizes=runner.graph_batch_sizes()[:1])  # one sequence, every window
        if runner.spec is not None:
            try:
                held += runner.spec.capture(ready)
            except torch.OutOfMemoryError:
                # Measured on one H200 (2026-12-02, K = 3, --gpu-memory-utilization 0.85): warming a verify
                # graph up asked for 4.8 GiB more after the decode graphs' pool; serve without speculation
                # rather than not at all (the log line says what to lower).
                runner.spec = None
                torch.cuda.empty_cache()
                log.warning("speculative decoding is off: capturing its verify and drafting graphs ran out of GPU "
                            "memory; lower --gpu-memory-utilization (or --speculative-max-batch) to use it")
        log.info("captured %d decode graphs in %s (the rest while idle or on first use); slowest: %s", held,
                 tally.describe(mark), runner.graphs.slowest_captures())
        mark, before = tally.mark(), torch.cuda.memory_reserved(device)
        try:
            held = runner.capture_prefill()
        except torch.OutOfMemoryError:  # serve with the eager prefill rather than not at all
            held = -1
        if held < 0:  # outside the handler (whose traceback holds them): the graphs and their own pool are freed
            runner.drop_prefill_graphs()
            held = 0
            gc.collect()
            torch.cuda.empty_cache()
            log.warning("prefill graphs are off: capturing them ran out of GPU memory; lower "
                        "--gpu-memory-utilization to use them")
        if held:
            log.info("captured %d prefill graphs (%d pieces x buckets %s tokens), %.2f GiB, in %s", held,
                     held // len(runner.graph_prefill.buckets), list(runner.graph_prefill.buckets),
                     (torch.cuda.memory_reserved(device) - before) / 2**30, tally.describe(mark))
    mark = tally.mark()
    sampler.warm_up()  # compiles the fused top-k sampler on CUDA (also without graphs, e.g. ZeRO-3); CPU: nothing
    if sampler.device.type == "cuda":
        log.info("compiled the sampler in %s", tally.describe(mark))
    if runner.spec is not None and runner.spec.drafter is not None:  # where speculating pays on this machine
        try:
            ratio = runner.spec.calibrate(sampler)
            log.info("speculative decoding: a step of %d draft(s) from the MTP head costs %.2f plain decode "
                     "steps", runner.spec.k, ratio)
        except Exception as exc:  # noqa: BLE001 - the policy's default threshold still serves
            log.warning("speculative decoding: measuring its step cost failed (%r); a sequence speculates while "
                        "it keeps %.0f %% of its drafts", exc, 100 * MIN_ACCEPTANCE)
    log.info("prefill: up to %d prompt tokens per step", chunk)
    mark = tally.mark()
    if warm_up_prefill(runner, loaded, chunk, config.image_token_budget):  # CUDA: no first-use stalls after ready
        log.info("warm-up compilation: %s; slowest Triton kernels to compile since start: %s", tally.describe(mark),
                 tally.top())
        log.info("torch.compile's slowest steps since start (nested steps overlap): %s",
                 compile_stats.torch_compile_steps())
    return runner, sampler, plan, chunk


def build_engine(
    loaded,
    config: ServiceConfig,
    executor_factory: Optional[Callable] = None,
    *,
    exit_on_failure: bool = True,
) -> ChatEngine:
    """Compose the engine app.py serves: runner + sampler sized from the memory budget
    (``runner_setup.build_runner``), a ``LocalExecutor``, the start-up
    self-check on it (``selfcheck.run_self_check``), the executor the scheduler drives
    (``executor_factory(local_executor, self_check_result)``, default the ``LocalExecutor`` itself; bootstrap's
    compares the result across ranks and wraps the executor in a ``DistributedExecutor``), then the
    ``ChatEngine``, whose ``health()`` reports the self-check.

    With ``exit_on_failure`` (default) an engine failure ends the process with code 1
    (``lifecycle.exit_process_soon``).  Raises whatever the self-check or the factory raise.
    """
    runner, sampler, plan, chunk = build_runner(loaded, config)
    local = LocalExecutor(runner, sampler)
    result = run_self_check(local, loaded.tokenizer)
    executor = executor_factory(local, result) if executor_factory is not None else local
    engine = ChatEngine(
        loaded, runner, executor, image_token_budget=config.image_token_budget,
        max_context=runner.max_context, max_queue=config.max_queue, num_slots=runner.num_slots,
        on_fatal=exit_process_soon if exit_on_failure else None, memory=plan, prefill_chunk_tokens=chunk,
        idle_captures=idle_captures(runner), conversation_cache=config.conversation_cache,
        speculative_tokens=config.speculative_tokens, speculative_max_batch=config.speculative_max_batch,
    )
    engine.self_check(result)
    return engine
