"""The engine's one start-up self-check: a fixed greedy request on every rank, compared across the ranks.

``run_self_check`` greedy-decodes ``SELF_CHECK_TOKENS`` tokens of ``SELF_CHECK_TEXT`` in slot 0 of a
``LocalExecutor`` and sums the prefill logits.  ``build_engine`` runs it once on rank 0 before the engine takes
requests (``ChatEngine.health()`` reports the outcome); under several ranks every worker runs it at the same
time with identical inputs (the sharded layers' collectives line up), and bootstrap compares the ranks' results
with ``compare_self_checks`` before any plan is broadcast: a mismatch stops the start-up.

Usage::

    result = run_self_check(LocalExecutor(runner, sampler), loaded.tokenizer)   # {"tokens": [...], "checksum": x}
    problem = compare_self_checks([result_rank0, result_rank1])                 # None when they agree
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from qwen_chat.engine.types import NONFINITE_TOKEN, PrefillItem, PreparedPrompt, SamplingParams, StepPlan

#: Fixed prompt of the self-check (raw text, no chat template) and the number of greedy tokens it decodes.
SELF_CHECK_TEXT = "Self-check: the capital of France is"
SELF_CHECK_TOKENS = 8

#: A prefill-logit spread (max - min) below this, with every greedy token the same id, is a degenerate
#: distribution: random or trained weights give spreads of several units (the tiny model: about 10).
DEGENERATE_SPREAD = 1e-3


class SelfCheckError(RuntimeError):
    """The self-check's outputs cannot come from working weights (non-finite or degenerate logits); the message
    names the likely cause, for the start-up log."""


#: Relative tolerance when comparing the self-check's prefill-logit checksums across ranks.  Every rank ends
#: with the same (all-reduced or all-gathered) activations, so they agree to rounding at most.
CHECKSUM_RTOL = 1e-4


def run_self_check(local_executor, tokenizer) -> dict:
    """Greedy-decode ``SELF_CHECK_TOKENS`` tokens of ``SELF_CHECK_TEXT`` in slot 0 and free it.

    Drives ``local_executor`` (a ``LocalExecutor``: ``runner`` and ``execute``) directly, outside any scheduler,
    so no request may be using it yet.

    Returns: ``{"tokens": list[int], "checksum": float}`` - the greedy ids and the float64 sum of the fp32
    prefill logits [V].
    Raises: SelfCheckError when the prefill logits or those of a decode step (the executor's
    ``NONFINITE_TOKEN``) are not all finite, or when every greedy token is one id and
    the logits are (nearly) all equal (``DEGENERATE_SPREAD``): the weights are corrupt; RuntimeError when a
    sampled id lies outside the runner's vocabulary (``vocab_size``); whatever the runner or the executor raise.
    """
    ids = torch.tensor(tokenizer.encode(SELF_CHECK_TEXT), dtype=torch.int64)
    prompt = PreparedPrompt(input_ids=ids, max_new_tokens=SELF_CHECK_TOKENS)
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, presence_penalty=0.0, seed=0,
                            max_new_tokens=SELF_CHECK_TOKENS, stop_token_ids=())
    runner = local_executor.runner
    with torch.no_grad():
        logits = runner.prefill(0, prompt).double()
        runner.free(0)
    checksum = float(logits.sum())
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        raise SelfCheckError(f"the start-up self-check got {bad} non-finite logit(s) (NaN or infinity) of "
                             f"{logits.numel()}: the weights are likely corrupt; compare the checkpoint's shards "
                             "with the published ones")
    spread = float(logits.max() - logits.min())
    tokens: list[int] = []
    plan = StepPlan(prefills=[PrefillItem(0, prompt, params)])
    for step in range(SELF_CHECK_TOKENS):
        token = local_executor.execute(plan)[0]
        if token == NONFINITE_TOKEN:  # never fed back: it is no token id
            local_executor.execute(StepPlan(free_slots=[0]))
            raise SelfCheckError(f"the start-up self-check got non-finite logits (NaN or infinity) for its greedy "
                                 f"token {step + 1}: the weights are likely corrupt; compare the checkpoint's "
                                 "shards with the published ones")
        tokens.append(token)
        plan = StepPlan(decode_slots=[0], decode_tokens=[token])
    local_executor.execute(StepPlan(free_slots=[0]))
    if len(set(tokens)) == 1 and spread < DEGENERATE_SPREAD:
        raise SelfCheckError(f"the start-up self-check's logits are all equal (spread {spread:.3g}) and every greedy "
                             f"token is id {tokens[0]}: the weights are likely corrupt (zeroed or overwritten); "
                             "compare the checkpoint's shards with the published ones")
    vocab = getattr(runner, "vocab_size", None)
    if vocab is not None and not all(0 <= t < vocab for t in tokens):
        raise RuntimeError(f"sampled ids outside the vocabulary: {tokens}")
    return {"tokens": tokens, "checksum": checksum}


def compare_self_checks(results: list[dict]) -> Optional[str]:
    """None when every rank's self-check equals rank 0's (tokens exactly, checksum within ``CHECKSUM_RTOL``);
    otherwise a message naming the first rank that differs.  ``results``: one ``run_self_check`` result per
    rank, in rank order."""
    ref = results[0]
    for rank, res in enumerate(results[1:], start=1):
        same_sum = math.isclose(res["checksum"], ref["checksum"], rel_tol=CHECKSUM_RTOL, abs_tol=1e-6)
        if res["tokens"] != ref["tokens"] or not same_sum:
            return (f"rank {rank} disagrees with rank 0 on the self-check: tokens {res['tokens']} vs "
                    f"{ref['tokens']}, logit checksum {res['checksum']:.6g} vs {ref['checksum']:.6g}")
    return None
