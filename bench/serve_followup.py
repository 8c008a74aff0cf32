"""The follow-up phase of ``serve_bench.py``: how long a conversation's next turn waits for its first token,
with the conversation cache holding the earlier turn (``cached``) and with nothing shared (``uncached``).

For each history size (8k and 30k tokens): turn 1 sends one user message of that size and takes a short reply;
then ``repeats`` follow-ups send the conversation back (that message, the reply's ``content`` as the assistant
message, a new 20-token user message), one at a time, each timed to its first text chunk; then ``repeats``
times the same follow-up with one word put before the first message (so no prefix is shared and the service
prefills everything: what every follow-up cost before the cache).  ``usage.prompt_tokens_details.cached_tokens``
of each follow-up is kept in the detail, so a run shows whether the cache was hit.
"""
from __future__ import annotations

from typing import Callable, Optional

import serve_http as H


def followups(url: str, model: Optional[str], prompt: Callable[[int], str], sizes: dict, *, repeats: int,
              reply_tokens: int, new_tokens: int) -> tuple[dict, dict]:
    """Run the phase.  ``prompt(tokens)``: a random prompt of about that many tokens; ``sizes``: label ->
    history tokens.  Returns (``followup_ttft_ms``: label -> {"cached": p50 ms, "uncached": p50 ms} or None,
    detail: label -> every TTFT, prompt and cached token count, or the error)."""
    result, detail = {}, {}
    for label, tokens in sizes.items():
        entry = detail[label] = {"target_tokens": tokens, "cached": [], "uncached": [], "cached_tokens": [],
                                 "prompt_tokens": [], "error": None}
        first = prompt(tokens)
        r1 = H.one(url, first, reply_tokens, model)
        if not r1.ok:
            entry["error"] = f"turn 1: {r1.error}"
            result[label] = None
            continue
        for kind in ("cached", "uncached"):
            head = first if kind == "cached" else "Again: " + first
            for _ in range(repeats):
                msgs = [{"role": "user", "content": head}, {"role": "assistant", "content": r1.answer},
                        {"role": "user", "content": prompt(new_tokens)}]
                r = H.one(url, "", 4, model, messages=msgs)
                if not r.ok or r.ttft_s is None:
                    entry["error"] = f"{kind} follow-up: {r.error or 'no text chunk came back'}"
                    break
                entry[kind].append(round(r.ttft_s * 1e3, 1))
                if kind == "cached":
                    entry["cached_tokens"].append(r.cached_tokens)
                entry["prompt_tokens"].append(r.prompt_tokens)
        ok = entry["cached"] and entry["uncached"] and entry["error"] is None
        result[label] = {"cached": H.percentile(entry["cached"], 50),
                         "uncached": H.percentile(entry["uncached"], 50)} if ok else None
    return result, detail
