"""What serves the port before and around the full application (qwen_chat.web.front): answers while starting,
``/healthz`` from the pending backend, the attached app's lifespan, the streams ended at shutdown, the quiet
access log."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from qwen_chat.web.front import QuietHealthChecks
from tests.support.servers import front_server
from tests.support.waiting import wait_until


class Engine:
    def health(self):
        return {"ok": True, "reason": "ready"}


def full_app(events: list, stop: asyncio.Event) -> FastAPI:
    """An app with a lifespan (recorded in ``events``), a plain route, its own /healthz and a stream that only
    ends when ``stop`` is set (like Gradio's heartbeat)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.get("/hello")
    def hello():
        return {"hello": "world"}

    @app.get("/healthz")
    def healthz():
        return {"status": "ok", "from": "app"}

    @app.get("/forever")
    async def forever():
        async def lines():
            yield "data: ALIVE\n\n"
            await stop.wait()

        return StreamingResponse(lines(), media_type="text/event-stream")

    return app


@pytest.fixture
def served():
    """(front, server, url, backend) with a WebServer on a free port in a thread; stopped at the end."""
    with front_server() as running:
        yield running


def test_before_the_app_is_attached_every_request_gets_a_clear_503(served):
    front, server, url, backend = served
    r = httpx.get(url + "/healthz")
    assert r.status_code == 503 and r.json() == {"status": "unavailable", "reason": "loading"}
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "not_ready" and "starting" in r.json()["error"]["message"]
    r = httpx.get(url + "/")
    assert r.status_code == 503 and r.headers["content-type"].startswith("text/html")
    assert "http-equiv='refresh'" in r.text and "starting" in r.text
    backend.fail("broken checkpoint")
    assert httpx.get(url + "/healthz").json()["reason"] == "start-up failed: broken checkpoint"


def test_attach_runs_the_lifespan_and_healthz_stays_with_the_front_until_the_engine_is_there(served):
    front, server, url, backend = served
    events: list = []
    app = full_app(events, asyncio.Event())
    front.attach(app)
    assert events == ["startup"]
    assert httpx.get(url + "/hello").json() == {"hello": "world"}
    assert httpx.get(url + "/healthz").json() == {"status": "unavailable", "reason": "loading"}  # not the app's
    backend.attach(Engine())
    assert httpx.get(url + "/healthz").json() == {"status": "ok", "from": "app"}


def test_shutdown_ends_the_open_streams_first_and_shuts_the_app_down(served):
    """A stream that never ends by itself (a tab's heartbeat) ends when the server stops, well before uvicorn's
    graceful-shutdown timeout (5 s here), and the app's lifespan shutdown runs."""
    front, server, url, backend = served
    events: list = []
    stop = asyncio.Event()
    app = full_app(events, stop)
    front.attach(app, end_streams=stop.set)
    got: list = []

    def hold() -> None:
        with httpx.stream("GET", url + "/forever", timeout=30) as r:
            for line in r.iter_lines():
                got.append(line)

    reader = threading.Thread(target=hold, daemon=True)
    reader.start()
    wait_until(lambda: got, 10, "the stream's first line")
    t0 = time.monotonic()
    server.should_exit = True
    reader.join(timeout=10)
    wait_until(lambda: "shutdown" in events, 10, "the app's lifespan shutdown")
    assert time.monotonic() - t0 < 2.0
    assert not reader.is_alive() and got[0] == "data: ALIVE"


@pytest.mark.parametrize("path, kept", [("/healthz", False), ("/metrics", False), ("/healthz?x=1", False),
                                        ("/v1/models", True), ("/", True)])
def test_access_log_drops_health_checks_only(path, kept):
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "GET", path, "1.1", 200), None)
    assert QuietHealthChecks().filter(record) is kept
