"""Per-slot rules of the ``Sampler`` beyond the draw itself: frequency penalty, thinking budget, log-probabilities.

Each rule runs only for batches that hold a slot using it (a host-side check on the slot's parameters), so
requests that use none of them pay nothing: no extra kernel and no copy to the host.

- ``FrequencyCounts``: OpenAI's frequency penalty, ``logit - frequency_penalty * count``, where ``count`` is
  how often the token was already sampled in this reply (a float32 [slots, V] table on the device).
- ``ThinkingBudget``: a per-slot counter on the device; once a slot has drawn its budget of reasoning tokens,
  its next draw is replaced by ``</think>`` (a ``</think>`` it draws itself ends the budget).  The counter
  is updated from the recorded token (after ``Sampler.token_sync``), so every tensor-parallel rank forces
  the same step, also when steps are launched ahead.
- ``logprobs_of``: log-softmax of the model's raw logits (before penalties, temperature, top-k/top-p: the
  model's own distribution, as vLLM reports by default) at the sampled ids, and the k most likely ids.
- ``mark_nonfinite``: the draw as the host sees it, with ``types.NONFINITE_TOKEN`` in the rows whose raw
  logits hold a NaN or an infinity (one reduction over the logits per draw, read back with the tokens: no
  extra host wait).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from qwen_chat.engine.types import NONFINITE_TOKEN, SampledLogprob


class FrequencyCounts:
    """Occurrence counts of each token in each slot's reply and the slot's ``frequency_penalty``.

    Memory: float32 [num_slots, V] (8 slots x 248,320 ids = 7.9 MB).  Counts of a slot without a penalty
    are never read (they may be stale); ``start`` clears them for a slot with one.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.float32, device=device)
        self.penalty = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self._on = [False] * num_slots
        self._one = torch.ones((), dtype=torch.float32, device=device)

    def start(self, slot: int, penalty: float) -> None:
        """A new reply in ``slot`` with this ``frequency_penalty`` (0 turns the rule off for the slot)."""
        self._on[slot] = penalty != 0
        self.penalty[slot] = float(penalty)
        if penalty != 0:
            self.counts[slot] = 0

    def active(self, slots: Sequence[int]) -> bool:
        """True when a slot of the batch has a non-zero penalty."""
        return any(self._on[s] for s in slots)

    def apply(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """float32 [B, V]: ``logits`` [B, V] minus each row's penalty times its slot's counts (idx: int64 [B])."""
        return logits.float() - self.penalty[idx][:, None] * self.counts[idx]

    def record(self, idx: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's sampled token (idx, tokens: int64 [B]; distinct slots)."""
        self.counts.index_put_((idx, tokens), self._one, accumulate=True)


class ThinkingBudget:
    """Reasoning tokens each slot may still draw before ``</think>`` is forced (-1: no budget, or closed)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.left = torch.full((num_slots,), -1, dtype=torch.long, device=device)
        self.end_id = torch.zeros(num_slots, dtype=torch.long, device=device)
        self._on = [False] * num_slots

    def start(self, slot: int, budget: Optional[int], end_id: int) -> None:
        """A new reply in ``slot``: ``budget`` reasoning tokens (None: no budget) before ``end_id``."""
        self._on[slot] = budget is not None
        self.left[slot] = -1 if budget is None else int(budget)
        self.end_id[slot] = int(end_id)

    def active(self, slots: Sequence[int]) -> bool:
        """True when a slot of the batch started with a budget (it may have closed on the device since)."""
        return any(self._on[s] for s in slots)

    def force(self, idx: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [B]: ``tokens``, with ``</think>`` in the rows whose budget is used up."""
        return torch.where(self.left[idx] == 0, self.end_id[idx], tokens)

    def record(self, idx: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count down after the step's tokens (int64 [B]) are final; a ``</think>`` closes the budget."""
        left = self.left[idx]
        closed = (left <= 0) | (tokens == self.end_id[idx])
        self.left[idx] = torch.where(closed, torch.full_like(left, -1), left - 1)


@dataclass
class LogprobRows:
    """Log-probabilities of some rows of one draw, on the device (``Sampler.logprobs_async``).

    ``slots``: the rows' slots; ``ks``: each row's k; ``chosen``: float32 [R] (the sampled ids);
    ``top_values``/``top_ids``: float32 / int64 [R, max(ks)], most likely first.
    """

    slots: list[int]
    ks: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self) -> "LogprobRows":
        """The same rows with the tensors copied to (pinned) host memory without waiting (CUDA); the caller
        waits for an event recorded after this before reading them."""
        move = (lambda t: t.to("cpu", non_blocking=True)) if self.chosen.device.type == "cuda" else (lambda t: t)
        return LogprobRows(self.slots, self.ks, move(self.chosen), move(self.top_values), move(self.top_ids))

    def by_slot(self) -> dict[int, SampledLogprob]:
        """{slot: ``SampledLogprob``} with each row's own k alternatives (reads the tensors: host or waited for)."""
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        return {slot: SampledLogprob(chosen[r], tuple(ids[r][:k]), tuple(values[r][:k]))
                for r, (slot, k) in enumerate(zip(self.slots, self.ks))}


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(chosen float32 [B], top values float32 [B, k], top ids int64 [B, k]): log-softmax of ``logits``
    (float [B, V]) at ``tokens`` (int64 [B]) and its k largest entries, sorted descending."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).view(-1)
    values, ids = torch.topk(lp, k, dim=-1) if k > 0 else (lp[:, :0], tokens.view(-1, 1)[:, :0])
    return chosen, values, ids


def mark_nonfinite(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """int64 [B]: ``tokens`` (int64 [B], a draw from ``logits``) with ``NONFINITE_TOKEN`` in each row whose
    ``logits`` (float [B, V], the model's raw logits, before grammar masks) are not all finite.

    One row sum in float32 per row: a sum is NaN or infinite when any entry is NaN or infinite (IEEE 754
    arithmetic), and finite logits overflow it only beyond 3.4e38 / V (1.4e33 for Qwen3.5's 248,320 ids),
    themselves a numerical fault.  Queued on the device; the result is meant for the host copy only (the
    device keeps ``tokens``, always valid ids, so the next step's embedding lookup stays in range).
    """
    finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
    return torch.where(finite, tokens, NONFINITE_TOKEN)
