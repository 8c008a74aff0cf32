"""The noisy-neighbour phase of ``serve_bench.py``: does one huge request stall the streams of everyone else?

``noisy_neighbour`` starts ``streams`` streamed chat completions at once (the burst prompts, ``max_tokens`` out),
waits until every one has received its first text chunk (or ended), then sends, from a thread of its own (so the
client's event loop keeps reading the streams), one non-streamed request whose single user message is
``body_chars`` characters of random words (``big_max_tokens`` out; the JSON body is encoded before the clock
starts).  It records the big request's HTTP status and seconds from sending to the whole answer, and, for each
stream, the arrival time of every chunk carrying text.  ``max_gap_ms`` is the longest time between two
consecutive text chunks of one stream among the gaps that overlap the window [send, answer]; a stall the big
request causes in the service (its body read, JSON-parsed, tokenized or refused in the front's event loop or the
engine's step loop) shows there.  ``baseline_max_gap_ms`` is the same over the gaps outside the window (the
streams' ordinary rhythm, for comparison).  A stream that ended before the answer contributes only its gaps up
to its end (``streams_after_answer``: how many still sent text after the answer).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Optional, Sequence

import httpx

import serve_http as H


def max_gap_ms(arrivals: Sequence[Sequence[float]], t0: float, t1: float, overlapping: bool = True) -> Optional[float]:
    """The longest gap (ms) between consecutive arrival times (seconds) of one stream, over all streams, among
    the gaps (a, b) that overlap the window [t0, t1] (``b >= t0 and a <= t1``), or, ``overlapping=False``, among
    those that do not.  None when there is no such gap."""
    best = None
    for times in arrivals:
        ts = sorted(times)
        for a, b in zip(ts, ts[1:]):
            if (b >= t0 and a <= t1) == overlapping:
                best = (b - a) if best is None else max(best, b - a)
    return None if best is None else best * 1e3


def big_text(chars: int, rng: random.Random) -> str:
    """``chars`` characters of random words of ``serve_http.WORDS`` (space-separated; the last one cut)."""
    words, n = [], 0
    while n <= chars:  # n counts a space after every word: the joined text is n - 1 characters
        w = rng.choice(H.WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:chars]


def _post(base_url: str, body: bytes, timeout_s: float) -> tuple[float, float, int, Optional[str]]:
    """POST the encoded body; (sent at, answered at (perf_counter), status (0: no answer), error message)."""
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        t0 = time.perf_counter()
        try:
            resp = client.post(base_url + "/v1/chat/completions", content=body,
                               headers={"Content-Type": "application/json"})
            t1 = time.perf_counter()
            return t0, t1, resp.status_code, None if resp.status_code == 200 else H._error_message(resp.text)
        except httpx.HTTPError as exc:
            return t0, time.perf_counter(), 0, f"{type(exc).__name__}: {exc}"[:400]


async def _run(base_url: str, prompts: Sequence[str], max_tokens: int, model: Optional[str], body: bytes,
               wait_s: float, timeout_s: float) -> dict:
    arrivals: list[list[float]] = [[] for _ in prompts]
    async with H.new_client(len(prompts), timeout_s) as client:
        tasks = [asyncio.create_task(H.stream_chat(client, base_url, p, max_tokens, model, on_text=arrivals[i].append))
                 for i, p in enumerate(prompts)]
        deadline = time.perf_counter() + wait_s
        while time.perf_counter() < deadline and not all(arrivals[i] or t.done() for i, t in enumerate(tasks)):
            await asyncio.sleep(0.005)
        streaming = sum(bool(arrivals[i]) and not t.done() for i, t in enumerate(tasks))
        t0, t1, status, error = await asyncio.to_thread(_post, base_url, body, timeout_s)
        results = await asyncio.gather(*tasks)
    return {"arrivals": arrivals, "t0": t0, "t1": t1, "status": status, "error": error, "streaming": streaming,
            "results": results}


def noisy_neighbour(base_url: str, prompts: Sequence[str], max_tokens: int, model: Optional[str], *, body_chars: int,
                    big_max_tokens: int, rng: random.Random, wait_s: float = 600.0,
                    timeout_s: float = 600.0) -> tuple[dict, dict]:
    """Run the phase.  Returns (the published summary {"max_gap_ms", "status", "big_request_s", "streams"},
    the detail: body size, streams streaming when it was sent, the big request's error message, the baseline
    gap, how many streams sent text after the answer, and the streams' ``serve_http.summarize``)."""
    message = big_text(body_chars, rng)
    body = {"messages": [{"role": "user", "content": message}], "max_tokens": big_max_tokens, "stream": False}
    if model:
        body["model"] = model
    encoded = json.dumps(body).encode()
    del message, body
    t_start = time.perf_counter()
    r = asyncio.run(_run(base_url, prompts, max_tokens, model, encoded, wait_s, timeout_s))
    arrivals, t0, t1 = r["arrivals"], r["t0"], r["t1"]
    gap = max_gap_ms(arrivals, t0, t1)
    summary = {"max_gap_ms": None if gap is None else round(gap, 1), "status": r["status"],
               "big_request_s": round(t1 - t0, 3), "streams": len(prompts)}
    base = max_gap_ms(arrivals, t0, t1, overlapping=False)
    detail = {"body_chars": body_chars, "body_bytes": len(encoded), "big_max_tokens": big_max_tokens,
              "stream_max_tokens": max_tokens, "streaming_when_sent": r["streaming"],
              "sent_after_s": round(t0 - t_start, 3), "big_request_error": r["error"],
              "baseline_max_gap_ms": None if base is None else round(base, 1),
              "streams_after_answer": sum(bool(a) and a[-1] > t1 for a in arrivals),
              "streams_summary": H.summarize(r["results"], time.perf_counter() - t_start)}
    return summary, detail
