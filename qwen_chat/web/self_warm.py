"""The web front's own first requests, sent before ``/healthz`` turns 200, so that a user's first request does
not pay for what the front does only once.

Each kind of request first ran code the engine's warm-up never reaches: FastAPI resolving the route's endpoint
(it reads the endpoint's source lines on first use), modules imported on first use (pyzmq's large-message send,
Pillow's PNG and JPEG plugins), the API image store's first write, the stream's first SSE chunk.  On an H200
(2026-12-04, ``bench/serve_bench.py``) a 1k-token prompt right after ready took 99 ms to its first token against
53 ms later while the engine's own TTFT was 41 ms both times; on the 2-core CPU machine the front's share of the
first 1k prompt was 47 ms against 10-20 ms for the next ones (53 and 55 ms on the H200 with this warm-up).

``warm_up`` sends, through the front's ASGI application in its own event loop (everything a client's request
meets but the socket), one streamed chat completion with a text of ``TEXT_WORDS`` words and one with two small
photos (a PNG and a JPEG) and a question, each ``max_tokens`` 2.  The engine serves them as any request (they
count in ``/metrics``).  A failure is logged and the service becomes ready anyway: the warm-up only moves
work earlier.
"""
from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
from typing import Any, Optional

log = logging.getLogger("qwen_chat.front")

#: Words of the warm-up's text prompt (about one token each): long enough that the prompt travels as a large
#: message, as a real 1k-token prompt does.
TEXT_WORDS = 1000
#: Side (px) of the warm-up's photos: the size of a downscaled phone photo (about 200 visual tokens each).
PHOTO_SIDE = 448
#: Seconds each warm-up request may take before the front gives up on it (a CPU engine is slow).
REQUEST_TIMEOUT_S = 120.0


def _photo(fmt: str) -> str:
    """A ``PHOTO_SIDE`` x ``PHOTO_SIDE`` RGB gradient as a ``data:`` URL in ``fmt`` ("PNG" or "JPEG")."""
    from PIL import Image

    img = Image.linear_gradient("L").resize((PHOTO_SIDE, PHOTO_SIDE)).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def warm_bodies(model: str) -> dict[str, dict]:
    """The request bodies of the warm-up, by kind ("text", "photos"): OpenAI chat completions, streamed."""
    words = " ".join(("river", "stone", "light", "window", "green")[i % 5] for i in range(TEXT_WORDS))
    common = {"model": model, "stream": True, "max_tokens": 2, "temperature": 0}
    photos = [{"type": "image_url", "image_url": {"url": _photo(fmt)}} for fmt in ("PNG", "JPEG")]
    return {"text": {**common, "messages": [{"role": "user", "content": words}]},
            "photos": {**common, "messages": [{"role": "user", "content": [
                *photos, {"type": "text", "text": "What is in these photos?"}]}]}}


async def request(app: Any, path: str, body: dict, *, api_key: Optional[str] = None,
                  state: Optional[dict] = None) -> tuple[int, bytes]:
    """POST ``body`` (JSON) to ``path`` of the ASGI ``app`` as a loopback client would (httpx's
    ``ASGITransport``; each request's scope gets a copy of the lifespan ``state``, as uvicorn gives it); (HTTP
    status, the whole response body).  Must run in the loop that serves ``app``."""
    import httpx

    async def with_state(scope, receive, send):
        await app({**scope, "state": dict(state or {})}, receive, send)

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(with_state), base_url="http://127.0.0.1",
                                 timeout=REQUEST_TIMEOUT_S) as client:
        resp = await client.post(path, json=body, headers=headers)
    return resp.status_code, resp.content


def warm_up(front: Any, model: str, api_key: Optional[str]) -> dict[str, float]:
    """Send the warm-up requests (module docstring) through ``front`` (``web.front.Front``, its application
    attached) from this thread into the front's event loop; {kind: milliseconds}.  Never raises: a failed or
    refused request is logged as a warning."""
    out: dict[str, float] = {}
    for kind, body in warm_bodies(model).items():
        t0 = time.perf_counter()
        try:
            future = asyncio.run_coroutine_threadsafe(
                request(front, "/v1/chat/completions", body, api_key=api_key, state=front.lifespan_state),
                front.loop)
            status, text = future.result(REQUEST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the service becomes ready anyway
            log.warning("front warm-up (%s request) failed: %s: %s", kind, type(exc).__name__, exc)
            continue
        ms = (time.perf_counter() - t0) * 1e3
        if status != 200 or b'"error"' in text:
            log.warning("front warm-up (%s request): HTTP %d: %s", kind, status, text[:300].decode(errors="replace"))
            continue
        out[kind] = round(ms, 1)
    log.info("front warm-up: %s", ", ".join(f"{k} request {v:.0f} ms" for k, v in out.items()) or "none served")
    return out
