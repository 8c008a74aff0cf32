"""When a sequence takes speculative steps: its measured acceptance, and oracle drafts for measurements.

A speculative step costs one verify forward over k + 1 tokens per sequence (a little more than a plain
decode step at small batches, where the weight read dominates) and emits 1 + (accepted drafts) tokens, so it
pays while the acceptance stays above roughly the verify step's extra cost (docs/speculative.md).  Each
sequence keeps an exponentially weighted acceptance rate (``SpecStats``); below ``MIN_ACCEPTANCE`` it decodes
plainly, and after ``PROBE_TOKENS`` plain tokens it tries one speculative step again, so a head that never
agrees (random weights) costs one verify step per ``PROBE_TOKENS`` tokens.  Which steps speculate at all
(batch size, eligibility) is ``batch.Batch``'s rule.

``OracleDrafter`` drafts the target's own recorded continuation with wrong tokens mixed in at a chosen rate:
the benchmark's simulated acceptance (an untrained MTP head has none) and the tests' acceptance patterns.
"""
from __future__ import annotations

import random
#: Acceptance (accepted / drafted, smoothed) below which a sequence stops speculating when the step costs were
#: not measured (``break_even``): a step of one given draft costs about 1.3 plain steps on an H200 (the verify
#: forward, docs/speculative.md), so it breaks even at 0.3 kept drafts per step.
MIN_ACCEPTANCE = 0.3
#: Plain tokens after which a sequence that stopped speculating tries one speculative step again: a head that
#: never agrees then costs one step's extra (about 0.3-0.4 of a plain step) per 64 tokens, well under 1 %.
PROBE_TOKENS = 64
#: Weight of the newest step in the smoothed acceptance (a sequence of rejections turns speculation off
#: after 5 steps from the initial 1.0).
SMOOTHING = 0.25


def break_even(cost_ratio: float, k: int) -> float:
    """The kept share of drafts above which speculating pays: a step of k drafts that costs ``cost_ratio`` plain
    decode steps emits 1 + k * share tokens, so it pays when share > (cost_ratio - 1) / k.  Clamped to
    [0.05, 1.0] (1.0: only a sequence that keeps every draft speculates; probes still run).  Raises ValueError
    for k < 1 or a ratio that is not a positive finite number."""
    if k < 1 or not 0 < cost_ratio < float("inf"):
        raise ValueError(f"break_even needs k >= 1 and a positive cost ratio, got {k}, {cost_ratio}")
    return min(1.0, max(0.05, (cost_ratio - 1.0) / k))


class SpecStats:
    """One sequence's speculation record: ``drafted`` and ``accepted`` tokens, the smoothed acceptance
    ``rate`` (starts at 1: a new sequence speculates), ``plain`` tokens decoded since it stopped, and
    ``min_acceptance``, the rate under which it stops (``break_even`` of the measured step costs, else
    ``MIN_ACCEPTANCE``)."""

    __slots__ = ("drafted", "accepted", "rate", "plain", "min_acceptance")

    def __init__(self, min_acceptance: float = MIN_ACCEPTANCE) -> None:
        self.drafted, self.accepted, self.rate, self.plain = 0, 0, 1.0, 0
        self.min_acceptance = float(min_acceptance)

    def wants(self) -> bool:
        """True when its next step should speculate (acceptance high enough, or a probe is due)."""
        return self.rate >= self.min_acceptance or self.plain >= PROBE_TOKENS

    def spec_step(self, drafted: int, accepted: int) -> None:
        """A speculative step drafted ``drafted`` tokens and kept ``accepted`` of them."""
        self.drafted += drafted
        self.accepted += accepted
        self.rate = (1 - SMOOTHING) * self.rate + SMOOTHING * accepted / max(drafted, 1)
        self.plain = 0

    def plain_step(self) -> None:
        """A plain decode step gave it one token."""
        if self.rate < self.min_acceptance:
            self.plain += 1


class OracleDrafter:
    """Drafts from recorded continuations (the scheduler's ``drafter``: ``drafter(request, k) -> k ids``).

    Args: ``continuations``: {prompt ids (tuple of int): the tokens plain decoding produced after it};
    ``correct``: probability that each draft is the recorded token (else the recorded token + 1, a wrong one),
    or {prompt ids: probability} per prompt (default 1.0 for a prompt not listed); ``seed`` of the draws;
    ``vocab_size`` (wrong tokens wrap around).  A position past the recorded continuation drafts token 0.
    """

    def __init__(self, continuations: dict, correct=1.0, *, seed: int = 0, vocab_size: int = 248320) -> None:
        self.continuations = {tuple(int(t) for t in key): list(v) for key, v in continuations.items()}
        self.correct = correct
        self.vocab_size = int(vocab_size)
        self._rng = random.Random(seed)
        self._keys: dict[int, tuple] = {}

    def _key(self, prompt) -> tuple:
        key = self._keys.get(id(prompt))
        if key is None:
            key = self._keys[id(prompt)] = tuple(int(t) for t in prompt.input_ids.reshape(-1).tolist())
        return key

    def __call__(self, req, k: int) -> list[int]:
        key = self._key(req.prompt)
        cont = self.continuations.get(key, [])
        rate = self.correct.get(key, 1.0) if isinstance(self.correct, dict) else float(self.correct)
        done = len(req.generated)  # the next token to guess is the continuation's entry at this index
        out = []
        for j in range(k):
            t = cont[done + j] if done + j < len(cont) else 0
            out.append(t if self._rng.random() < rate else (t + 1) % self.vocab_size)
        return out

