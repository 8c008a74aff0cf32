"""The API's view of a reply's choices: collecting them (n >= 1), ``usage``, and OpenAI's ``logprobs`` shape.

A request with ``n`` choices gets ``StreamUpdate``s whose ``index`` says the choice; each choice ends with
its own last update.  ``collect_choices`` runs a stream to its end for a non-streaming reply; ``usage`` counts
the prompt once and the completion tokens of every choice (as OpenAI does for n > 1); ``logprobs_body`` is
``choices[].logprobs`` (``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence

from qwen_chat.chat_types import StreamUpdate, TokenLogprob


@dataclass
class ChoiceResult:
    """One choice of a finished non-streaming reply: its last update (None if it produced none) and the
    log-probabilities of all its answer tokens."""

    last: Optional[StreamUpdate] = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def collect_choices(updates: AsyncIterator[StreamUpdate], n: int) -> list[ChoiceResult]:
    """Run a stream to its end: the n choices' results, by index.  Raises what the stream raises."""
    results = [ChoiceResult() for _ in range(n)]
    async for update in updates:
        result = results[update.index]
        result.last = update
        result.logprobs.extend(update.logprobs)
    return results


def usage(lasts: Sequence[Optional[StreamUpdate]]) -> dict:
    """OpenAI ``usage`` of the choices' last updates: ``prompt_tokens`` and
    ``prompt_tokens_details.cached_tokens`` (prompt tokens the conversation cache held, as OpenAI and vLLM
    report them; once), ``completion_tokens`` and ``completion_tokens_details.reasoning_tokens`` (summed over
    the choices), ``total_tokens``; zeros without updates."""
    known = [u for u in lasts if u is not None]
    prompt = known[0].prompt_tokens if known else 0
    cached = known[0].cached_tokens if known else 0
    completion = sum(u.completion_tokens for u in known)
    reasoning = sum(u.reasoning_tokens for u in known)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def dropped_messages(lasts: Sequence[Optional[StreamUpdate]]) -> int:
    """Messages the context policy left out of the prompt (the same for every choice; 0 without updates)."""
    return next((u.dropped_messages for u in lasts if u is not None), 0)


def logprobs_body(entries: Sequence[TokenLogprob]) -> dict:
    """OpenAI's ``logprobs`` object of a choice (or of one chunk's tokens when streaming)."""
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in e.top]}
        for e in entries
    ]}
