"""Runs one ``StepPlan`` against the model on this process: free, prefill, one batched decode, sample.

The executor makes no decisions.  Which slots to free, which prompts to prefill, which sequences decode and
which token each feeds in are all fixed in the plan by the rank-0 scheduler, so that worker ranks that only
receive plans (``qwen_chat.engine.parallel.ranks``) run exactly the same forward passes and sample exactly the same
tokens.  Sampling is seeded per sequence (``SamplingParams.seed``), which keeps the sampled ids equal on
every rank.  In one process the scheduler may instead ``launch`` a plan whose decode reads each slot's last
sampled token on the device (``StepPlan.tokens_on_device``) and ``collect`` the previous plan's tokens while
the GPU runs it.

Usage::

    executor = LocalExecutor(runner, sampler)
    tokens = executor.execute(StepPlan(prefills=[PrefillItem(0, prompt, params)]))   # {0: first_token}
    tokens = executor.execute(StepPlan(decode_slots=[0], decode_tokens=[tokens[0]]))  # {0: next_token}
    ahead = executor.launch(StepPlan(decode_slots=[0], tokens_on_device=True))       # queued, not waited for
    tokens = executor.collect(ahead)                                                  # {0: the token after}
"""
from __future__ import annotations

from typing import Protocol

import torch

from qwen_chat.engine.serving.requests import StepPlan

STEP_OPS = ("step", "selfcheck")


class Executor(Protocol):
    """What the scheduler drives: ``LocalExecutor`` here, ``DistributedExecutor`` under several ranks."""

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run ``plan``; return {slot: sampled token id} for every prefilled and every decoded slot."""
        ...


class LocalExecutor:
    """Executes step plans with a ``ModelRunner`` and a ``Sampler`` in this process.

    Args:
        runner: ``qwen_chat.engine.model.runner.ModelRunner`` (``prefill(slot, prompt) -> fp32 [V]``,
            ``decode(slots, tokens int64 [B] | None, token_table=None) -> fp32 [B, V]``, ``free(slot)``,
            ``num_slots``).
        sampler: ``qwen_chat.engine.model.sampling.Sampler`` (``start(slot, params)``,
            ``sample_async(slots, logits [B, V]) -> int64 [B]``, ``last_tokens`` int64 [num_slots]).
    """

    def __init__(self, runner, sampler) -> None:
        self.runner = runner
        self.sampler = sampler
        self._host = None  # two pinned int64 [num_slots] buffers for the sampled tokens (CUDA)
        self._turn = 0

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run one plan and wait for its tokens: ``collect(launch(plan))``.

        Op ``"selfcheck"`` runs like ``"step"`` (the scheduler sends a short real request as the check);
        ``"exit"`` does nothing here (the worker loop in ``dist.py`` acts on it).

        Returns:
            {slot: sampled token id (int)} for every prefilled and decoded slot.
        Raises:
            ValueError: unknown ``plan.op``, mismatched decode lists, or a slot both prefilled and decoded.
            Whatever the runner or sampler raise (the scheduler fails the affected requests).
        """
        if plan.op == "exit":
            return {}
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> "Launched":
        """Queue one plan on the device and return without waiting for its result: free ``plan.free_slots``;
        prefill each ``plan.prefills`` item and sample its first token; then one batched decode over
        ``plan.decode_slots`` and sample.  The decode feeds ``plan.decode_tokens``, or with
        ``plan.tokens_on_device`` the last token sampled for each slot (``Sampler.last_tokens``), so a plan can
        be launched before the previous one's tokens reached the host.  At most two launched plans may await
        ``collect`` at a time (their tokens come back through two pinned buffers).  Prefills do wait for the
        device (they check the prompt's token ids there).

        Raises ValueError for an op other than step/selfcheck, mismatched decode lists, or a slot both prefilled
        and decoded; whatever the runner or sampler raise (before anything of a refused prefill ran).
        """
        if plan.op not in STEP_OPS:
            raise ValueError(f"unknown step op {plan.op!r}; expected one of {STEP_OPS + ('exit',)}")
        if not plan.tokens_on_device and len(plan.decode_slots) != len(plan.decode_tokens):
            raise ValueError(
                f"decode_slots ({len(plan.decode_slots)}) and decode_tokens ({len(plan.decode_tokens)}) differ in length"
            )
        prefill_slots = [item.slot for item in plan.prefills]
        overlap = set(prefill_slots) & set(plan.decode_slots)
        if overlap:
            raise ValueError(f"slots {sorted(overlap)} are both prefilled and decoded in one step")

        for slot in plan.free_slots:
            self.runner.free(slot)

        slots: list[int] = []
        parts: list[torch.Tensor] = []
        with torch.no_grad():
            for item in plan.prefills:
                self.sampler.start(item.slot, item.sampling)
                logits = self.runner.prefill(item.slot, item.prompt)  # fp32 [V]
                parts.append(self.sampler.sample_async([item.slot], logits.view(1, -1)))
                slots.append(item.slot)
            if plan.decode_slots:
                decode_slots = list(plan.decode_slots)
                if plan.tokens_on_device:
                    logits = self.runner.decode(decode_slots, None, token_table=self.sampler.last_tokens)
                else:
                    logits = self.runner.decode(decode_slots, torch.tensor(plan.decode_tokens, dtype=torch.int64))
                parts.append(self.sampler.sample_async(decode_slots, logits))  # fp32 [B, V] -> int64 [B]
                slots.extend(decode_slots)
        if not slots:
            return Launched([], None, None)
        tokens = torch.cat(parts) if len(parts) > 1 else parts[0]
        if tokens.device.type != "cuda":
            return Launched(slots, tokens, None)
        if self._host is None:
            n = self.runner.num_slots
            self._host = [torch.zeros(n, dtype=torch.long, pin_memory=True) for _ in range(2)]
        turn = self._turn
        self._turn ^= 1
        host = self._host[turn][:len(slots)]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(slots, host, done)

    def collect(self, launched: "Launched") -> dict[int, int]:
        """Wait for a launched plan's tokens.  Returns {slot: sampled token id} for every prefilled and decoded
        slot of that plan."""
        if launched.done is not None:
            launched.done.synchronize()
        if launched.tokens is None:
            return {}
        return dict(zip(launched.slots, launched.tokens.tolist()))


class Launched:
    """A plan queued by ``LocalExecutor.launch``: its sampled slots, the tensor their tokens arrive in (int64
    [n], pinned host memory on CUDA), and the CUDA event after which that tensor holds them (None on CPU)."""

    __slots__ = ("slots", "tokens", "done")

    def __init__(self, slots: list[int], tokens, done) -> None:
        self.slots, self.tokens, self.done = slots, tokens, done
