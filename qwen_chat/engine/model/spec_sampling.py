"""Which draft tokens a speculative step keeps, drawn so that the output has the target model's distribution.

For each sequence the verify forward gives the target's logits at T = k + 1 positions (after its last token
and after each of its k drafts d_1..d_k).  Position j's distribution p_j is the plain sampler's (presence and
frequency penalties counting d_1..d_j as already emitted, temperature, top-k, top-p: ``sampling.scaled_logits``
and ``sampling.nucleus_probs``, the same functions).

- Greedy rows (temperature 0): the target token at j is argmax p_j; draft d_{j+1} is kept while it equals it.
  The kept tokens are exactly those plain greedy decoding would produce.
- Sampled rows: speculative sampling (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers
  via Speculative Decoding", algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
  Speculative Sampling") with a deterministic drafter, whose proposal q is one-hot on its draft: d_{j+1} is
  kept with probability min(1, p_j(d) / q(d)) = p_j(d); at the first rejection the token is drawn from the
  residual max(0, p_j - q) / Z = p_j with d removed, renormalised; when all k are kept one more token is drawn
  from p_k.  Each emitted token then has exactly the distribution p of plain sampling.

Every row uses 2 T uniforms of its own slot's stream per step (``Sampler.uniforms``: T acceptance tests, T
draws), whatever was accepted, so a seed gives the same text whatever else shares the batch.
"""
from __future__ import annotations

from typing import Sequence

import torch

from qwen_chat.engine.model.sampling import (TOPK_FAST_LIMIT, Sampler, inverse_cdf, is_greedy, nucleus_probs,
                                             scaled_logits)
from qwen_chat.engine.model.speculative import device_ints


def eligible(params) -> bool:
    """True when a sequence with these ``SamplingParams`` can take speculative steps: no log-probabilities and
    no thinking budget (those draws stay plain)."""
    return params.logprobs is None and params.reasoning_budget is None


def penalised(sampler: Sampler, slots: Sequence[int], logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Presence and frequency penalties, then temperature, of each verified position: fp32 [B * T, V].

    Position j of a row follows the emitted tokens and its drafts d_1 .. d_j (all kept when position j is
    reached), so its presence flags and counts are the slot's plus those drafts'; otherwise the formulas of
    ``sampling.scaled_logits`` and ``sampling_rules.FrequencyCounts.apply``."""
    B, T, V = logits.shape
    dev = logits.device
    idx = device_ints([int(s) for s in slots], dev)
    seen = torch.zeros(B, T, V, dtype=torch.float32, device=dev)
    for j in range(1, T):
        seen[:, j] = seen[:, j - 1]
        seen[:, j].scatter_add_(1, drafts[:, j - 1:j], torch.ones(B, 1, device=dev))
    x = logits.float()
    if sampler.frequency.active(slots):
        x = x - sampler.frequency.penalty[idx][:, None, None] * (sampler.frequency.counts[idx][:, None] + seen)
    present = (sampler.presence[idx][:, None] | (seen > 0)).reshape(B * T, V)
    rows = idx.repeat_interleave(T)
    every = torch.arange(B * T, device=dev)
    return scaled_logits(x.reshape(B * T, V), present, sampler._penalty[rows], sampler._temperature[rows], every)


@torch.no_grad()
def accept_drafts(sampler: Sampler, slots: Sequence[int], logits: torch.Tensor,
                  drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide each row's kept drafts and its next token (see the module docstring).

    slots: B distinct slots, each started on the sampler with ``eligible`` parameters; logits: fp32 [B, T, V]
    (``speculative.Verifier.verify``); drafts: int64 [B, T - 1] on the device.  Returns (tokens int64 [B, T],
    counts int64 [B]): row b emits ``tokens[b, :counts[b]]`` (its kept drafts, then the corrected or extra
    token); counts in 1..T.  Records each row's last emitted token in ``sampler.last_tokens`` and marks the
    emitted tokens present; under tensor parallelism every rank takes rank 0's result (``sampler.token_sync``).
    Raises ValueError for mismatched shapes or a slot without parameters.
    """
    slots = [int(s) for s in slots]
    B, T, V = logits.shape
    if drafts.shape != (B, T - 1) or V != sampler.vocab_size:
        raise ValueError(f"drafts {tuple(drafts.shape)} do not match logits {tuple(logits.shape)}")
    for s in slots:
        if not 0 <= s < sampler.num_slots or sampler.params[s] is None:
            raise ValueError(f"slot {s} has no sampling parameters (call start first)")
    dev = logits.device
    drafts = drafts.to(dev, torch.long)
    flat = logits.reshape(B * T, V)
    greedy = flat.argmax(dim=-1).view(B, T)
    if all(is_greedy(sampler.params[s].temperature) for s in slots):
        tokens, keep = greedy, drafts == greedy[:, :-1]
    else:
        u = sampler.uniforms(slots, 2 * T)                                              # [B, 2T]
        idx = device_ints([s for s in slots for _ in range(T)], dev)
        x = penalised(sampler, slots, logits, drafts)
        ks = [sampler.params[s].top_k if 0 < sampler.params[s].top_k < V else 0 for s in slots]
        if min(ks) > 0 and max(ks) <= TOPK_FAST_LIMIT:
            vals, ids = torch.topk(x, max(ks), dim=-1)
        else:
            vals, ids = torch.sort(x, dim=-1, descending=True)
        probs = nucleus_probs(vals, sampler._top_k[idx], sampler._top_p[idx])              # [B*T, n]
        checked = torch.cat([drafts, torch.full((B, 1), -1, dtype=torch.long, device=dev)], dim=1).view(-1)
        hit = ids == checked[:, None]                                                    # no hit at j = T - 1
        p_draft = (probs * hit).sum(dim=-1).view(B, T)
        residual = probs.masked_fill(hit, 0.0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
        drawn = inverse_cdf(residual, ids, u[:, T:].reshape(-1)).view(B, T)
        keep = u[:, :T - 1] < p_draft[:, :-1]
        hot = sampler._temperature[idx].view(B, T)[:, 0] > 0
        tokens = torch.where(hot[:, None], drawn, greedy)
        keep = torch.where(hot[:, None], keep, drafts == greedy[:, :-1])
    accepted = torch.cumprod(keep.long(), dim=1).sum(dim=1)                               # [B] in 0..T-1
    j = torch.arange(T, device=dev)[None, :]
    tokens = torch.where(j < accepted[:, None], torch.cat([drafts, tokens[:, -1:]], dim=1), tokens)
    packed = torch.cat([tokens.reshape(-1), accepted + 1])
    if sampler.token_sync is not None:
        packed = sampler.token_sync(packed)
    tokens, counts = packed[:B * T].view(B, T), packed[B * T:]
    slot_t = device_ints(slots, dev)
    sampler.last_tokens[slot_t] = tokens.gather(1, (counts - 1)[:, None])[:, 0]
    emitted = j < counts[:, None]
    rows = slot_t[:, None].expand(B, T)
    # no boolean indexing (it would wait for the device): positions not emitted repeat the first emitted token
    sampler.presence.index_put_((rows, torch.where(emitted, tokens, tokens[:, :1])), sampler._true)
    if sampler.frequency.active(slots):
        sampler.frequency.counts.index_put_((rows, tokens), emitted.float(), accumulate=True)
    return tokens, counts
