"""Two phases of ``serve_bench.py`` about what is already prepared when a request comes.

``request_kinds``: the TTFT of one request of each kind a user sends: a 1k-token prompt, an 8k-token prompt, a
photo with a short question, and a burst of 8 streams at once (600-token prompts; the burst's median TTFT).
Run right after ``/healthz`` turns 200 it gives ``first_use_ttft_ms`` (whatever the service compiles or
captures on first use shows here); run again after the other phases it gives ``steady_ttft_ms``.  The
benchmark's own HTTP client path is run once before (``serve_http.warm_client``, a request that reaches no
model), so that its first use in this process is not counted as the service's; each photo request sends a
photo the service has not seen (one pixel changed), as a user's next photo would be.

``shared_system_prompt``: conversations of different users that start with the same long system prompt (4k
tokens of words) and each their own 20-token question: the first one prefills it all; each later one is timed
to its first text chunk, with ``usage.prompt_tokens_details.cached_tokens`` (what the service did not prefill
again).  Then the same with one word of the system prompt changed, which no kept state can serve (the cost of a
full prefill, for comparison; in the detail).
"""
from __future__ import annotations

import asyncio
import base64
import io
import itertools
import time
from pathlib import Path
from typing import Callable, Optional

import serve_http as H
from PIL import Image

IMAGE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "images" / "chelsea.png"
KINDS = ("1k", "8k", "image", "burst8")


_VARIANTS = itertools.count(1)


def _image_message(question: str) -> list:
    """One user message with the test photo, one pixel changed per call: each request's photo is new to the
    service (its API image store keeps normalised photos by content, so the same bytes again would skip the
    normalising a new photo pays)."""
    img = Image.open(IMAGE).convert("RGB")
    img.putpixel((0, 0), (next(_VARIANTS) % 256, 0, 0))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                                         {"type": "text", "text": question}]}]


async def _burst_results(url: str, prompts: list, max_tokens: int, model: Optional[str]) -> list:
    async with H.new_client(len(prompts)) as client:
        return await asyncio.gather(*(H.stream_chat(client, url, p, max_tokens, model) for p in prompts))


def request_kinds(url: str, model: Optional[str], prompt: Callable[[int], str], *, sizes: dict, burst_prompt: int,
                  new_tokens: int) -> tuple[dict, dict]:
    """One request of each kind in ``KINDS`` (``sizes``: {"1k": tokens, "8k": tokens}; ``prompt(tokens)``: a
    random prompt of about that many tokens).  Returns ({kind: TTFT ms or None}, {kind: detail})."""
    out, detail = {}, {"client_warm_ms": round(H.warm_client(url), 1)}  # the client's first use is not timed
    for kind in KINDS:
        t0 = time.perf_counter()
        if kind == "burst8":
            results = asyncio.run(_burst_results(url, [prompt(burst_prompt) for _ in range(8)], new_tokens, model))
            ttfts = [r.ttft_s * 1e3 for r in results if r.ok and r.ttft_s is not None]
            errors = [r.error for r in results if r.error]
            out[kind] = H.percentile(ttfts, 50) if len(ttfts) == len(results) else None
            detail[kind] = {"ttft_ms": [round(x, 1) for x in ttfts], "error": errors[0] if errors else None}
        else:
            if kind == "image":
                r = H.one(url, "", new_tokens, model, messages=_image_message("What is in this photo?"))
            else:
                r = H.one(url, prompt(sizes[kind]), new_tokens, model)
            out[kind] = round(r.ttft_s * 1e3, 1) if r.ok and r.ttft_s is not None else None
            detail[kind] = {"ttft_ms": out[kind], "prompt_tokens": r.prompt_tokens,
                            "error": r.error or (None if out[kind] is not None else "no text chunk came back")}
        detail[kind]["wall_s"] = round(time.perf_counter() - t0, 3)
    return out, detail


def shared_system_prompt(url: str, model: Optional[str], prompt: Callable[[int], str], *, system_tokens: int,
                         question_tokens: int, users: int, new_tokens: int) -> tuple[Optional[dict], dict]:
    """``users`` + 1 conversations with one system prompt of ``system_tokens``, one at a time (the first
    prefills it), then ``users`` with a system prompt one word different.  Returns ({"ttft_ms": p50 of the later
    users, "cached_tokens": their smallest}, or None on an error; detail: every TTFT, cached and prompt token
    count, and the changed system prompt's TTFTs)."""
    system = prompt(system_tokens)
    detail = {"system_tokens": system_tokens, "first": None, "shared": [], "cached_tokens": [],
              "prompt_tokens": [], "changed": [], "changed_cached_tokens": [], "error": None}
    for i in range(users + 1):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": prompt(question_tokens)}]
        r = H.one(url, "", new_tokens, model, messages=msgs)
        if not r.ok or r.ttft_s is None:
            detail["error"] = f"user {i}: {r.error or 'no text chunk came back'}"
            return None, detail
        if i == 0:
            detail["first"] = round(r.ttft_s * 1e3, 1)
            continue
        detail["shared"].append(round(r.ttft_s * 1e3, 1))
        detail["cached_tokens"].append(r.cached_tokens)
        detail["prompt_tokens"].append(r.prompt_tokens)
    changed = "Changed " + system
    for i in range(users):
        msgs = [{"role": "system", "content": changed if i == 0 else f"Changed{i} " + system},
                {"role": "user", "content": prompt(question_tokens)}]
        r = H.one(url, "", new_tokens, model, messages=msgs)
        if r.ok and r.ttft_s is not None:
            detail["changed"].append(round(r.ttft_s * 1e3, 1))
            detail["changed_cached_tokens"].append(r.cached_tokens)
    cached = [c for c in detail["cached_tokens"] if c is not None]
    return {"ttft_ms": H.percentile(detail["shared"], 50), "cached_tokens": min(cached) if cached else None}, detail
