"""Prefill kernels compiled before the service says ready, so that no first request waits for them.

On CUDA the prefill's Triton kernels (fla's chunked and recurrent delta rule, the l2 norm) are compiled, and
autotuned, the first time a shape bucket meets them, and cuDNN and the vision tower's kernels pick their
algorithms on first use: measured through HTTP right after ``/healthz`` turned 200 (one H200,
docs/performance.md, "First use after ready"), a 1k-token prompt waited 1.29 s (153 ms later on), an 8k one 4.4 s
(386 ms) and a photo 2.8 s (229 ms).  ``warm_up_prefill`` runs each kind of prefill a request can take once,
on random token ids, before the engine serves: a short prompt with two keep points (a system block's end, a
turn's end: the chunked and the token-by-token delta rule), a follow-up restored from a kept state, a full
prompt chunk and a later chunk of the same prompt (attention over cached keys), a burst of 8 prompts packed in
one step whose last prompt is cut and continued in a second step beside a new prompt (an odd token count),
and a photo.  Every rank runs the same calls (``build_runner``), so the sharded layers' collectives
line up.  Start-up's compile caches (start.sh) keep what was compiled for the next start.  On CPU nothing is
compiled on first use: nothing runs.
"""
from __future__ import annotations

import logging
import time

import torch

from qwen_chat.engine.text.prompt import photo_prompt
from qwen_chat.engine.types import PrefillItem, PreparedPrompt

log = logging.getLogger(__name__)

#: Token counts of the warm-up prompts: a short prompt as most chat turns send, and the prompts of a burst.
SHORT_TOKENS = 1000
BURST_PROMPTS, BURST_TOKENS = 8, 600
#: Side of the warm-up photo (pixels): a few hundred visual tokens, as a phone photo under the default budget.
PHOTO_PIXELS = 448


def _ids(gen: torch.Generator, n: int, vocab: int) -> PreparedPrompt:
    return PreparedPrompt(input_ids=torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int64),
                          max_new_tokens=1)


@torch.no_grad()
def warm_up_prefill(runner, loaded, chunk_tokens: int, image_token_budget: int,
                    device_types: tuple[str, ...] = ("cuda",)) -> float:
    """Run the warm-up prefills (module docstring) on ``runner`` (idle: no request may be using it) and free
    every slot they used.  ``chunk_tokens``: the scheduler's prompt tokens per step; ``loaded``: the
    ``LoadedModel`` (its processor builds the photo prompt; None: no photo); ``device_types``: where it runs
    (the tests run it on CPU too).  Returns the seconds it took (0.0 on other devices, where nothing runs).
    Raises whatever the runner raises."""
    if runner.device.type not in device_types:
        return 0.0
    t0 = time.monotonic()
    gen = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    top = runner.max_context - 1
    slots = runner.num_slots
    try:
        if slots >= 4 and top >= 64:  # a prompt keeping two states, then a follow-up restored from the second
            n = min(SHORT_TOKENS, top)
            p = _ids(gen, n, vocab)
            runner.prefill_batch([PrefillItem(0, p, keeps=((n // 2, 1), (n - 3, 2)))])
            runner.restore(2, 3)
            follow = PreparedPrompt(input_ids=torch.cat([p.input_ids[:n - 3], _ids(gen, 20, vocab).input_ids]),
                                    max_new_tokens=1)
            runner.prefill_batch([PrefillItem(3, follow, start=n - 3)])
        n = min(chunk_tokens + chunk_tokens // 2, top)  # a full chunk, then a later chunk of the same prompt
        long = _ids(gen, n, vocab)
        runner.prefill_batch([PrefillItem(0, long, start=0, end=min(chunk_tokens, n - 1))])
        runner.prefill_batch([PrefillItem(0, long, start=min(chunk_tokens, n - 1))])
        k = min(BURST_PROMPTS, slots)
        each = max(1, min(BURST_TOKENS, chunk_tokens // k, top - 3))
        burst = [_ids(gen, each, vocab) for _ in range(k)]
        if k < 2 or each < 4:
            runner.prefill_batch([PrefillItem(s, p) for s, p in enumerate(burst)])
        else:  # a burst as the scheduler cuts it: the last prompt cut at the step's end, then continued beside
            cut = each - 2  # a new prompt in a step of an odd token count (kernels specialise on multiples of 16)
            runner.prefill_batch([PrefillItem(s, p) for s, p in enumerate(burst[:-1])]
                                 + [PrefillItem(k - 1, burst[-1], end=cut)])
            for s in range(k - 1):
                runner.free(s)
            runner.prefill_batch([PrefillItem(k - 1, burst[-1], start=cut),
                                  PrefillItem(0, _ids(gen, each + 1 - each % 2, vocab))])
        if loaded is not None and getattr(loaded, "processor", None) is not None:
            photo = photo_prompt(loaded, side=PHOTO_PIXELS, image_token_budget=image_token_budget,
                                 context_length=runner.max_context)
            runner.prefill_batch([PrefillItem(0, photo)])
    finally:
        for s in range(slots):
            runner.free(s)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    seconds = time.monotonic() - t0
    log.info("warmed up the prefill kernels (short, kept and restored, long, burst, photo) in %.1f s", seconds)
    return seconds
