"""The web front's own first requests before ready (qwen_chat.web.self_warm) and the backend's warming state:
the requests go through the whole ASGI application as a client's would (headers, key, streamed body), a
failing one does not stop the service from becoming ready, and /healthz says "warming up" until they end."""
from __future__ import annotations

import base64
import io
import json
import logging

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from qwen_chat.web import self_warm
from qwen_chat.web.front import health_report
from tests.support.servers import front_server


class Engine:
    def health(self):
        return {"ok": True, "reason": "ready"}


def chat_app(seen: list, backend=None, status: int = 200) -> FastAPI:
    """A stand-in for the service's application: /healthz from ``backend`` as the service's; records each chat
    request (headers, body) and streams two SSE chunks, or answers ``status`` with an OpenAI error body."""
    app = FastAPI()

    @app.get("/healthz")
    def healthz():
        code, body = health_report(backend)
        return JSONResponse(body, status_code=code)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append({"authorization": request.headers.get("authorization"), "body": body,
                     "client": request.client.host})
        if status != 200:
            return JSONResponse({"error": {"message": "broken", "code": "x"}}, status_code=status)

        async def events():
            yield 'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def served():
    with front_server() as (front, server, url, backend):
        yield front, url, backend


def test_warm_up_sends_a_long_text_and_two_photos_through_the_app_with_the_key(served):
    front, url, backend = served
    seen: list = []
    front.attach(chat_app(seen, backend))
    backend.attach(Engine(), warming=True)
    assert httpx.get(url + "/healthz").status_code == 503
    assert httpx.get(url + "/healthz").json() == {"status": "unavailable", "reason": "warming up"}
    took = self_warm.warm_up(front, "tiny", "sk-local")
    assert set(took) == {"text", "photos"} and all(ms > 0 for ms in took.values())
    assert [s["authorization"] for s in seen] == ["Bearer sk-local"] * 2
    assert all(s["client"] == "127.0.0.1" and s["body"]["stream"] and s["body"]["model"] == "tiny" for s in seen)
    text = seen[0]["body"]["messages"][0]["content"]
    assert len(text.split()) == self_warm.TEXT_WORDS
    parts = seen[1]["body"]["messages"][0]["content"]
    formats = []
    for part in parts[:2]:
        head, data = part["image_url"]["url"].split(",", 1)
        img = Image.open(io.BytesIO(base64.b64decode(data)))
        formats.append((head, img.format, img.size))
    side = self_warm.PHOTO_SIDE
    assert formats == [("data:image/png;base64", "PNG", (side, side)), ("data:image/jpeg;base64", "JPEG", (side, side))]
    assert parts[2] == {"type": "text", "text": "What is in these photos?"}
    backend.warmed()
    assert httpx.get(url + "/healthz").json() == {"status": "ok", "reason": "ready"}


def test_a_refused_warm_up_is_logged_and_nothing_is_raised(served, caplog):
    front, url, backend = served
    seen: list = []
    front.attach(chat_app(seen, backend, status=500))
    with caplog.at_level(logging.INFO, logger="qwen_chat.front"):
        assert self_warm.warm_up(front, "tiny", None) == {}
    assert len(seen) == 2 and seen[0]["authorization"] is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("HTTP 500" in w and "broken" in w for w in warnings)
    assert any("front warm-up: none served" in r.getMessage() for r in caplog.records)


def test_request_returns_the_status_and_the_whole_streamed_body(served):
    front, url, backend = served
    front.attach(chat_app([], backend))
    import asyncio

    status, body = asyncio.run_coroutine_threadsafe(
        self_warm.request(front, "/v1/chat/completions", {"model": "tiny", "messages": []}), front.loop).result(10)
    assert status == 200
    events = [line[len("data: "):] for line in body.decode().split("\n\n") if line]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "hi" and events[1] == "[DONE]"
