"""Runs one ``StepPlan`` against the model on this process: free, prefill, one batched decode, sample.

The executor makes no decisions.  Which slots to free, which prompts to prefill, which sequences decode and
which token each feeds in are all fixed in the plan by the rank-0 scheduler, so that worker ranks that only
receive plans (``qwen_chat.engine.dist``) run exactly the same forward passes and sample exactly the same
tokens.  Sampling is seeded per sequence (``SamplingParams.seed``), which keeps the sampled ids equal on
every rank.

Usage::

    executor = LocalExecutor(runner, sampler)
    tokens = executor.execute(StepPlan(prefills=[PrefillItem(0, prompt, params)]))   # {0: first_token}
    tokens = executor.execute(StepPlan(decode_slots=[0], decode_tokens=[tokens[0]]))  # {0: next_token}
"""
from __future__ import annotations

from typing import Protocol

import torch

from qwen_chat.engine.requests import StepPlan

STEP_OPS = ("step", "selfcheck")


class Executor(Protocol):
    """What the scheduler drives: ``LocalExecutor`` here, ``DistributedExecutor`` under several ranks."""

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run ``plan``; return {slot: sampled token id} for every prefilled and every decoded slot."""
        ...


class LocalExecutor:
    """Executes step plans with a ``ModelRunner`` and a ``Sampler`` in this process.

    Args:
        runner: ``qwen_chat.engine.runner.ModelRunner`` (``prefill(slot, prompt) -> fp32 [V]``,
            ``decode(slots, tokens int64 [B]) -> fp32 [B, V]``, ``free(slot)``).
        sampler: ``qwen_chat.engine.sampling.Sampler`` (``start(slot, params)``,
            ``sample(slots, logits [B, V]) -> list[int]``).
    """

    def __init__(self, runner, sampler) -> None:
        self.runner = runner
        self.sampler = sampler

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run one plan: free ``plan.free_slots``; prefill each ``plan.prefills`` item and sample its first
        token; then one batched decode over ``plan.decode_slots`` fed with ``plan.decode_tokens`` and sample.

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
        if plan.op not in STEP_OPS:
            raise ValueError(f"unknown step op {plan.op!r}; expected one of {STEP_OPS + ('exit',)}")
        if len(plan.decode_slots) != len(plan.decode_tokens):
            raise ValueError(
                f"decode_slots ({len(plan.decode_slots)}) and decode_tokens ({len(plan.decode_tokens)}) differ in length"
            )
        prefill_slots = [item.slot for item in plan.prefills]
        overlap = set(prefill_slots) & set(plan.decode_slots)
        if overlap:
            raise ValueError(f"slots {sorted(overlap)} are both prefilled and decoded in one step")

        for slot in plan.free_slots:
            self.runner.free(slot)

        out: dict[int, int] = {}
        with torch.no_grad():
            for item in plan.prefills:
                self.sampler.start(item.slot, item.sampling)
                logits = self.runner.prefill(item.slot, item.prompt)  # fp32 [V]
                out[item.slot] = int(self.sampler.sample([item.slot], logits.view(1, -1))[0])
            if plan.decode_slots:
                tokens = torch.tensor(plan.decode_tokens, dtype=torch.int64)
                logits = self.runner.decode(list(plan.decode_slots), tokens)  # fp32 [B, V]
                sampled = self.sampler.sample(list(plan.decode_slots), logits)
                for slot, token in zip(plan.decode_slots, sampled):
                    out[slot] = int(token)
        return out
