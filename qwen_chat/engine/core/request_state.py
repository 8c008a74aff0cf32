"""``Request``: one request as the scheduler tracks it, from the queue to its last token (``batch.Batch``)."""
from __future__ import annotations

from typing import Optional

import torch

from qwen_chat.engine.core.handles import RequestHandle
from qwen_chat.engine.core.spec_policy import MIN_ACCEPTANCE, SpecStats
from qwen_chat.engine.types import PreparedPrompt, SamplingParams


class Request:
    """One submitted request as the scheduler tracks it: its handle, prompt, sampling, stop ids (int), the slot it
    holds (None while waiting or after it finished), the last token sampled for it, ``siblings``: the later
    choices of the same request (n > 1), which may share its prefill, and ``constraint``: its grammar state
    (``constraints.Constraint``) or None.

    Progress: ``order`` (admission order: the newest is preempted first), ``target`` (the prompt being prefilled:
    the prompt, or after a preemption the prompt and the tokens it was fed; None while preempted), ``cached``
    (tokens planned into its cache so far), ``generated`` (every token delivered), ``resume`` (the target
    recomputes a preempted sequence).  Conversation cache: ``key`` (``conv_cache.PromptKey`` of the prompt, or
    None with the cache off), ``kept`` (the ``conv_cache.Entry`` of each keep point it made).  Speculative
    decoding: ``spec`` (``spec_policy.SpecStats``: its drafted and accepted tokens, whether it speculates: above
    ``spec_min``, the acceptance at which speculating pays).
    """

    __slots__ = ("handle", "prompt", "sampling", "stop_ids", "slot", "last_token", "siblings", "constraint",
                 "order", "target", "cached", "generated", "resume", "key", "kept", "spec")

    def __init__(self, handle: RequestHandle, prompt: PreparedPrompt, sampling: SamplingParams, stop_ids,
                 constraint=None, key=None, spec_min: float = MIN_ACCEPTANCE):
        self.handle = handle
        self.prompt = prompt
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.slot: Optional[int] = None
        self.last_token: Optional[int] = None
        self.siblings: list["Request"] = []
        self.constraint = constraint
        self.order = 0
        self.target: Optional[PreparedPrompt] = None
        self.cached = 0
        self.generated: list[int] = []
        self.resume = False
        self.key = key
        self.kept: list = []
        self.spec = SpecStats(spec_min)

    @property
    def prefilling(self) -> bool:
        """Admitted and its target prompt not fully planned yet."""
        return self.target is not None and self.cached < self.target.num_tokens

    @property
    def decoding(self) -> bool:
        """Its prompt (or recomputation) is planned through: it decodes from now on."""
        return self.target is not None and self.cached >= self.target.num_tokens

    def recompute_prompt(self) -> PreparedPrompt:
        """The prompt and every token fed to the model so far (all generated but the last, which is fed next):
        what a preempted sequence prefills to get its cache back."""
        fed = self.generated[:-1]
        if not fed:
            return self.prompt
        p = self.prompt
        extra = torch.tensor(fed, dtype=p.input_ids.dtype)
        mm = p.mm_token_type_ids
        if mm is not None:
            mm = torch.cat([mm.reshape(-1), torch.zeros(len(fed), dtype=mm.dtype)])
        return PreparedPrompt(input_ids=torch.cat([p.input_ids.reshape(-1), extra]), pixel_values=p.pixel_values,
                              image_grid_thw=p.image_grid_thw, mm_token_type_ids=mm,
                              max_new_tokens=p.max_new_tokens)
