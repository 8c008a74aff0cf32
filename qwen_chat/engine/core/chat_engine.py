"""``ChatEngine``: the ``ChatBackend`` that the web UI and the OpenAI-compatible API stream from.

Request path: validate the settings -> build the prompt (chat template, images, context policy) -> queue it on
the continuous-batching ``Scheduler`` (its n choices, sharing one prefill) -> turn the sampled ids into
``StreamUpdate``s (``replies.stream_replies``: UTF-8-safe deltas, reasoning split at ``</think>``, the API's
stop strings, log-probabilities).  Every user error is raised by
``stream_chat`` itself, before it returns the update iterator; a failure after the stream started ends it with
``finish_reason == "error"`` and a notice, never with an exception in the middle of a reply.

Start-up: app.py calls ``bootstrap.start_engine(cfg)`` (loading, sharding, process groups), which on rank 0
composes the engine with ``runner_setup.build_engine`` (runner + sampler, the start-up self-check, the executor: a
``LocalExecutor`` or, under several ranks, a ``DistributedExecutor``) and returns it; app.py then attaches it to
the web layer's ``PendingBackend``.  Without bootstrap (tests, one process)::

    loaded = load_model(path, device)
    engine = build_engine(loaded, config)            # runner + sampler + self-check + LocalExecutor + scheduler
    for update in engine.stream_chat(messages, GenerationSettings.preset(True), CancelToken()):
        print(update.answer_delta, end="")
    engine.close()
"""
from __future__ import annotations

import logging
import secrets
import weakref
from dataclasses import replace
from typing import Callable, Iterator, Optional, Sequence

import torch

from qwen_chat.chat_types import (
    CancelToken,
    ChatMessage,
    GenerationSettings,
    InvalidInput,
    ModelInfo,
    NotReady,
    StreamUpdate,
)
from qwen_chat.engine.model.fp8 import weights_report
from qwen_chat.engine.model.paged import BLOCK_TOKENS
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.text.prompt import build_prompt
from qwen_chat.engine.core.constraints import StructuredOutput, reply_constraints
from qwen_chat.engine.output.replies import stream_replies
from qwen_chat.engine.types import PreparedPrompt, SamplingParams
from qwen_chat.engine.core.scheduler import Scheduler
from qwen_chat.engine.core.spec_policy import MIN_ACCEPTANCE, break_even
from qwen_chat.engine.startup.selfcheck import run_self_check

log = logging.getLogger(__name__)

#: A step (one prefill batch + one decode) running longer than this makes ``health()`` report the engine stuck.
#: Generous: ZeRO-3 decodes at 2.7 tok/s on two H200s (docs/facts.md, "Sharding with DeepSpeed: ZeRO-3"), and
#: a long prompt with CPU offload can take minutes, so only a step that hangs far beyond that counts as stuck.
STUCK_AFTER_S = 600.0


def _token_id(tokenizer, token: str) -> int:
    """Id of a special token in ``tokenizer``; ValueError if the vocabulary lacks it."""
    tid = tokenizer.convert_tokens_to_ids(token)
    unk = getattr(tokenizer, "unk_token_id", None)
    if tid is None or (unk is not None and tid == unk):
        raise ValueError(f"the tokenizer has no {token} token; is this a Qwen3.5 checkpoint?")
    return int(tid)


def _tool_ids(tokenizer) -> Optional[tuple[int, int]]:
    """``(<tool_call>, </tool_call>)`` ids (Qwen3.5: 248058, 248059; docs/facts.md, "Tokens"), None without."""
    try:
        return _token_id(tokenizer, "<tool_call>"), _token_id(tokenizer, "</tool_call>")
    except ValueError:
        return None


def _sampler_of(executor):
    """The executor's own ``Sampler`` (rank 0's, inside a ``DistributedExecutor``), or None."""
    return getattr(executor, "sampler", None) or getattr(getattr(executor, "local", None), "sampler", None)


class ChatEngine:
    """Implements ``qwen_chat.chat_types.ChatBackend`` over a model runner, an executor and a ``Scheduler``.

    Args:
        loaded: ``qwen_chat.engine.checkpoints.loading.LoadedModel`` (``processor``, ``tokenizer``, ``info``...).
        runner: the ``ModelRunner`` the executor drives (used for ``max_context``/``vocab_size``; may be None
            when the executor runs the model elsewhere).
        executor: ``LocalExecutor`` or ``DistributedExecutor`` (``qwen_chat.engine.parallel.executors``).
        image_token_budget: visual tokens per image (``--image-token-budget``).
        max_context: tokens per sequence, prompt + reply (must not exceed the runner's).
        max_queue: requests that may wait for a slot before ``Busy``.
        num_slots: sequences decoded together (the runner's ``num_slots``).
        info: what the UI shows; default ``loaded.info`` with ``context_length = max_context``.
        on_fatal: called with the reason after an engine failure (see ``Scheduler``); ``build_engine`` passes
            ``lifecycle.exit_process_soon`` so that Supervisor restarts a broken engine.  None: stay up, unhealthy.
        memory: the ``memory.MemoryPlan`` the runner was sized by (reported by ``stats`` and ``memory_report``),
            or None.  prefill_chunk_tokens: prompt tokens per step (``Scheduler`` ``prefill_token_budget``).
        idle_captures: decode graphs to capture while idle (``Scheduler``).
        conversation_cache: keep prefix states for the next turns of conversations (``Scheduler``).
        speculative_tokens, speculative_max_batch, drafter: speculative decoding (``Scheduler``); on only when
            the runner has its ``spec`` (``model.spec_step.attach``); its ``cost_ratio`` (measured at start-up,
            ``Speculation.calibrate``) sets where each sequence stops speculating (``spec_policy.break_even``).
        overlap: launch each step before the previous one's tokens are back (``Scheduler`` ``overlap``);
            None = on for a ``LocalExecutor`` (one process) and for a ``DistributedExecutor`` whose ranks share rank
            0's sampled tokens on the device (its ``tokens_on_device``: ``build_runner`` sets the sampler's
            ``token_sync`` whenever several ranks run).

    Stop ids: ``<|endoftext|>`` and ``<|im_end|>``; thinking ids ``<think>``/``</think>``; all looked up in
    the loaded tokenizer (Qwen3.5: 248044, 248046, 248068, 248069; docs/facts.md, "Tokens"); tool-call ids
    ``<tool_call>``/``</tool_call>`` (248058, 248059) when the tokenizer has them.  Structured output
    (``constraints.StructuredOutput``) masks through the executor's own sampler (``Sampler.constraints``);
    without one, requests that need it are refused.
    """

    def __init__(
        self,
        loaded,
        runner,
        executor,
        *,
        image_token_budget: int,
        max_context: int,
        max_queue: int,
        num_slots: int,
        info: Optional[ModelInfo] = None,
        on_fatal: Optional[Callable[[str], None]] = None,
        overlap: Optional[bool] = None,
        memory=None,
        prefill_chunk_tokens: int = 4096,
        idle_captures: Optional[list] = None,
        conversation_cache: bool = True,
        speculative_tokens: int = 0,
        speculative_max_batch: int = 8,
        drafter=None,
    ) -> None:
        if runner is not None and max_context > runner.max_context:
            raise ValueError(f"max_context {max_context} exceeds the runner's {runner.max_context}")
        self.loaded = loaded
        self.runner = runner
        self.executor = executor
        self.image_token_budget = int(image_token_budget)
        self.max_context = int(max_context)
        base = info if info is not None else loaded.info
        self.info = replace(base, context_length=min(base.context_length, self.max_context))
        tok = loaded.tokenizer
        self.eos_ids = (_token_id(tok, "<|endoftext|>"), _token_id(tok, "<|im_end|>"))
        self.think_ids = (_token_id(tok, "<think>"), _token_id(tok, "</think>"))
        self.tool_ids = _tool_ids(tok)
        self.control_tokens = tuple(tok.get_added_vocab())
        sampler = _sampler_of(executor)
        self.structure: Optional[StructuredOutput] = None
        if sampler is not None and hasattr(sampler, "constraints"):
            self.structure = StructuredOutput(tok, vocab_size=sampler.vocab_size, device=sampler.device,
                                              num_slots=sampler.num_slots, stop_ids=self.eos_ids,
                                              think_end_id=self.think_ids[1], tool_ids=self.tool_ids)
            sampler.constraints = self.structure.table
        if overlap is None:
            overlap = isinstance(executor, LocalExecutor) or bool(getattr(executor, "tokens_on_device", False))
        self.memory = memory
        self.conversation_cache = bool(conversation_cache)
        model = getattr(loaded, "model", None)
        self.weights = weights_report(model) if hasattr(model, "get_input_embeddings") else None
        ratio = getattr(getattr(runner, "spec", None), "cost_ratio", None)  # measured at start-up, or None
        spec_min = break_even(ratio, speculative_tokens) if ratio and speculative_tokens else MIN_ACCEPTANCE
        if ratio and speculative_tokens:
            log.info("speculative decoding: a sequence speculates while it keeps more than %.0f %% of its drafts "
                     "(a step costs %.2f plain steps here)", 100 * spec_min, ratio)
        self.scheduler = Scheduler(executor, num_slots=num_slots, max_queue=max_queue, eos_ids=self.eos_ids,
                                   max_context=self.max_context, on_fatal=on_fatal, overlap=overlap,
                                   constraints=self.structure.table if self.structure is not None else None,
                                   prefill_token_budget=prefill_chunk_tokens,
                                   num_blocks=getattr(runner, "num_blocks", None),
                                   block_tokens=getattr(runner, "block_tokens", BLOCK_TOKENS),
                                   idle_captures=idle_captures, conversation_cache=conversation_cache,
                                   speculative_tokens=speculative_tokens if getattr(runner, "spec", None) else 0,
                                   speculative_max_batch=speculative_max_batch, drafter=drafter,
                                   speculative_min_acceptance=spec_min)
        log.info("scheduler: %s", "steps launched ahead (overlap)" if overlap else "each step waited for")
        self.stuck_after_s = STUCK_AFTER_S
        self._self_check: Optional[str] = None  # None: not run; "": passed; else the failure
        self._closed = False

    # ---- ChatBackend -------------------------------------------------------------------------------------
    def stream_chat(
        self, messages: Sequence[ChatMessage], settings: GenerationSettings, cancel: CancelToken
    ) -> Iterator[StreamUpdate]:
        """Validate, build the prompt, queue it and return the iterator of updates.

        Each update carries the deltas since the previous one and the full texts so far; ``thinking`` is True
        while the reply is inside its reasoning; the last update has ``finish_reason`` ('stop', 'length',
        'cancelled', 'error'), the usage (``prompt_tokens``, ``completion_tokens``) and ``ttft_s`` (seconds
        from the call to the first sampled token).  ``notice`` carries the context policy's remark and, on
        the last update, why the reply ended early (token limit while thinking, engine error).

        ``settings.stop`` strings end the reply where one appears (cut before it, finish_reason 'stop');
        text that may be the start of a stop string is held back until it is decided.  Closing the iterator,
        dropping it, or cancelling ``cancel`` removes the request from the batch within one decode step.

        Raises (before returning, never mid-stream): InvalidInput / InvalidImage / ContextTooLong (bad
        request), Busy (queue full), NotReady (engine closed, or its self-check failed).
        """
        handles, prompt = self.submit(messages, settings, cancel)
        updates = stream_replies(handles, prompt, settings, tokenizer=self.loaded.tokenizer,
                                 think_ids=self.think_ids, eos_ids=self.eos_ids, tool_ids=self.tool_ids)
        # A returned iterator that is dropped without ever being started would not run its finally block.
        for handle in handles:
            weakref.finalize(updates, handle.close)
        return updates

    def submit(self, messages: Sequence[ChatMessage], settings: GenerationSettings, cancel: CancelToken,
               sink=None) -> tuple[list, PreparedPrompt]:
        """Validate, build the prompt and queue its ``settings.n`` choices: ``(handles, prompt)``
        (``submit_prepared``).  ``stream_chat`` reads the handles in this process.  Raises like
        ``stream_chat``."""
        self._check_open()
        settings.validate()  # before the prompt is built from them (submit_prepared checks again: its own boundary)
        prompt = self.prepare(messages, settings)
        return self.submit_prepared(prompt, settings, cancel, sink), prompt

    def submit_prepared(self, prompt: PreparedPrompt, settings: GenerationSettings, cancel: CancelToken,
                        sink=None) -> list:
        """Queue the ``settings.n`` choices of a prompt already built (by ``prepare`` here, or by the front's
        prompt workers: ``core.link``): the handles (``handles.RequestHandle``, index 0 .. n-1) pushing to
        ``sink`` (any object with ``put``; default one queue of their own).  Compiles the structured-output
        grammar.  Raises InvalidInput (bad settings), Busy, NotReady, ContextTooLong."""
        self._check_open()
        settings.validate()
        if settings.tools and settings.tool_choice != "none" and self.tool_ids is None:
            raise InvalidInput("tools: this model's tokenizer has no <tool_call> token", param="tools")
        constraints = reply_constraints(self.structure, settings)
        samplings = [self.sampling_params(settings, prompt, index) for index in range(settings.n)]
        return self.scheduler.submit_choices(prompt, samplings, cancel, constraints, sink)

    def _check_open(self) -> None:
        if self._closed:
            raise NotReady("the engine is shutting down")
        if self._self_check:
            raise NotReady("the engine failed its start-up self-check; see the server log")

    def health(self) -> dict:
        """``{"ok", "reason", "mode", "world_size", "active", "queued", "self_check"}`` for /healthz.

        Not ok while the self-check has not passed, after an engine step failed, once closed, while one step
        has been running for more than ``stuck_after_s`` seconds, or when the executor reports itself
        unhealthy (``executor.health()``, e.g. a worker rank gone).
        """
        stats = self.scheduler.stats()
        reasons = []
        if self._closed:
            reasons.append("engine closed")
        if self._self_check is None:
            reasons.append("self-check not run yet")
        elif self._self_check:
            reasons.append(f"self-check failed: {self._self_check}")
        if not self.scheduler.healthy:
            reasons.append(stats["reason"] or "scheduler thread stopped")
        if stats["step_running_s"] > self.stuck_after_s:
            reasons.append(f"engine stuck: one step has been running for {stats['step_running_s']:.0f} s")
        executor_health = getattr(self.executor, "health", None)
        if callable(executor_health):
            eh = executor_health()
            if not eh.get("ok", True):
                reasons.append(eh.get("reason", "executor unhealthy"))
        return {
            "ok": not reasons,
            "reason": "; ".join(reasons) if reasons else "ready",
            "mode": self.info.mode,
            "world_size": self.info.world_size,
            "active": stats["active"],
            "queued": stats["queued"],
            "self_check": "passed" if self._self_check == "" else (self._self_check or "not run"),
        }

    def stats(self) -> dict:
        """Flat numbers for /metrics (``qwen_chat.web.ops`` reads them at scrape time).

        Keys: ``queue_depth`` and ``running`` (requests now), ``num_slots`` (state slots: the most concurrent
        sequences), ``max_queue``, ``kv_blocks``/``kv_blocks_used``/``kv_blocks_cached``/``kv_block_tokens``/
        ``kv_tokens`` (the paged KV cache: blocks, blocks running sequences hold now, blocks only kept conversation
        states hold (evictable), tokens per block, tokens in all), ``max_context`` (the longest
        context), ``*_total`` counters since start (requests, rejected_busy, prompt_tokens, generated_tokens,
        decode_steps, step_seconds: wall seconds the engine spent inside steps, preemptions, prefill_chunks,
        nonfinite_logits: replies ended because their logits held a NaN or an infinity, and finished_<reason>;
        speculative decoding: spec_steps, spec_drafted and spec_accepted draft tokens),
        ``spec_acceptance_rate`` (accepted / drafted since start, 0 before any), ``max_decode_batch``
        (largest decode batch seen), ``step_running_s`` (seconds the step in progress has been running, 0 when
        idle), ``gpu_memory_bytes`` (list with this process's allocated CUDA bytes; only on CUDA), and with the
        conversation cache on ``prefix_cache_entries`` (kept prefixes now), ``prefix_cache_queries_total``
        (prompts admitted), ``prefix_cache_hits_total``, ``prefix_cache_cached_tokens_total`` (prompt tokens not
        prefilled thanks to a hit), ``prefix_cache_system_hits_total`` (hits on a system block's state another
        conversation kept), ``prefix_cache_hit_rate`` (hits / queries since start, 0 before any).
        """
        s = self.scheduler.stats()
        t = s["totals"]
        out = {"queue_depth": s["queued"], "running": s["active"], "num_slots": s["num_slots"],
               "max_queue": s["max_queue"], "kv_blocks": s["kv_blocks"], "kv_blocks_used": s["kv_blocks_used"],
               "kv_blocks_cached": s["kv_blocks_cached"],
               "kv_block_tokens": s["block_tokens"], "kv_tokens": s["kv_blocks"] * s["block_tokens"],
               "max_context": self.max_context}
        for key in ("requests", "rejected_busy", "prompt_tokens", "generated_tokens", "decode_steps", "step_seconds",
                    "preemptions", "prefill_chunks", "spec_steps", "spec_drafted", "spec_accepted",
                    "nonfinite_logits"):
            out[f"{key}_total"] = t[key]
        out["spec_acceptance_rate"] = t["spec_accepted"] / t["spec_drafted"] if t["spec_drafted"] else 0.0
        out.update(max_decode_batch=t["max_decode_batch"], step_running_s=s["step_running_s"])
        for reason, n in t["finished"].items():
            out[f"finished_{reason}_total"] = n
        cache = s["cache"]
        if cache is not None:
            out["prefix_cache_entries"] = cache["entries"]
            for key in ("queries", "hits", "cached_tokens", "system_hits"):
                out[f"prefix_cache_{key}_total"] = cache[key]
            out["prefix_cache_hit_rate"] = cache["hits"] / cache["queries"] if cache["queries"] else 0.0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["gpu_memory_bytes"] = [torch.cuda.memory_allocated()]
        return out

    def memory_report(self) -> dict:
        """What the memory budget holds, for ``/v1/models``: ``state_slots`` (= ``max_concurrent_sequences``),
        ``kv_blocks``, ``kv_block_tokens``, ``kv_tokens`` (tokens of KV cache in all), ``max_context`` (tokens),
        ``memory_budget_gib``, ``conversation_cache`` (bool), ``kv_cache_dtype`` (the KV cache's element type:
        "bfloat16", "float8_e4m3fn" with ``--kv-cache-dtype fp8``...) and ``weights`` (``fp8.weights_report``:
        which weights are FP8); {} when the engine was built without a memory plan."""
        plan = self.memory
        if plan is None:
            return {}
        caches = getattr(self.runner, "k_cache", None) or {}
        report = {"state_slots": plan.num_slots, "max_concurrent_sequences": plan.num_slots,
                  "kv_blocks": plan.num_blocks, "kv_block_tokens": plan.block_tokens, "kv_tokens": plan.kv_tokens,
                  "max_context": self.max_context, "memory_budget_gib": round(plan.budget_bytes / 2 ** 30, 3),
                  "conversation_cache": self.conversation_cache,
                  "kv_cache_dtype": str(next(iter(caches.values())).dtype).replace("torch.", "") if caches else None}
        if self.weights is not None:
            report["weights"] = self.weights
        return report

    # ---- building blocks (public for the API layer and tests) ----------------------------------------------
    def prepare(self, messages: Sequence[ChatMessage], settings: GenerationSettings) -> PreparedPrompt:
        """The model-ready prompt for ``messages`` (template, images, context policy; see ``prompt.build_prompt``).

        Raises: InvalidInput / InvalidImage / ContextTooLong.
        """
        return build_prompt(
            self.loaded, messages, enable_thinking=settings.enable_thinking,
            image_token_budget=self.image_token_budget, context_length=self.max_context,
            max_new_tokens=settings.max_new_tokens,
            tools=settings.tools if settings.tool_choice != "none" else (), control_tokens=self.control_tokens,
        )

    def sampling_params(self, settings: GenerationSettings, prompt: PreparedPrompt,
                        index: int = 0) -> SamplingParams:
        """Sampling parameters of choice ``index`` (0 .. n-1): seed ``settings.seed + index`` (mod 2**63), or a
        fresh 63-bit seed when ``settings.seed`` is None, so that every rank samples from the same generator
        state; the thinking budget only with thinking on."""
        seed = (settings.seed + index) % 2**63 if settings.seed is not None else secrets.randbits(63)
        budget = settings.thinking_token_budget if settings.enable_thinking else None
        return SamplingParams(
            temperature=float(settings.temperature), top_p=float(settings.top_p), top_k=int(settings.top_k),
            presence_penalty=float(settings.presence_penalty), seed=int(seed),
            max_new_tokens=int(prompt.max_new_tokens), stop_token_ids=self.eos_ids,
            frequency_penalty=float(settings.frequency_penalty), logprobs=settings.top_logprobs,
            reasoning_budget=budget, think_end_id=self.think_ids[1],
        )

    def self_check(self, result: Optional[dict] = None) -> bool:
        """Record the start-up self-check (``selfcheck.run_self_check``) that ``health()`` reports and
        ``stream_chat`` requires.

        ``result``: the check's result when the caller ran it (``build_engine`` does, on the ``LocalExecutor``
        before the executor factory wraps it).  None: run it now on this engine's executor, which must then be
        a ``LocalExecutor`` that no request uses yet (the check drives it directly, in slot 0).  Returns True on
        pass; a failure is logged, ``health()`` reports it and ``stream_chat`` raises ``NotReady``.
        """
        try:
            if result is None:
                result = run_self_check(self.executor, self.loaded.tokenizer)
            self._self_check = ""
            log.info("engine self-check passed (%d greedy tokens, logit checksum %.6g)", len(result["tokens"]),
                     result["checksum"])
        except Exception as exc:  # noqa: BLE001 - reported through health(), the service keeps starting up
            log.exception("engine self-check failed")
            self._self_check = f"{type(exc).__name__}: {exc}"
        return self._self_check == ""

    def close(self) -> bool:
        """Cancel everything queued or running, stop the scheduler thread, then close the executor if it has a
        ``close`` (``DistributedExecutor`` sends the worker ranks their exit).  Idempotent.  Returns False when
        a worker rank was already gone (its exit message could not be sent), else True."""
        self._closed = True
        self.scheduler.shutdown()
        executor_close = getattr(self.executor, "close", None)
        return (executor_close() is not False) if callable(executor_close) else True

    def __enter__(self) -> "ChatEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
