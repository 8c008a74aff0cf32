"""In-process servers for the web tests: a real uvicorn server in a background thread on a free loopback port.

Public API::

    free_port() -> int                                   # a TCP port free on 127.0.0.1 a moment ago
    RunningServer(app) as server: server.url             # http://127.0.0.1:PORT (no trailing slash)
    api_app(backend, cfg) -> (FastAPI, InstrumentedBackend)  # the /v1 API + /healthz + /metrics of the server
    hang_up_after(stream, content_chunks)                 # an openai client leaving a streamed reply mid-way
    with serve_engine(loaded, cfg) as (url, engine): ...  # the real engine of a loaded model behind the API
"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import httpx
from fastapi import FastAPI

from qwen_chat.config import ServiceConfig
from qwen_chat.web import api, ops


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it; a tiny race remains)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """Serve an ASGI app (FastAPI, or Gradio mounted on FastAPI) with uvicorn in a background thread.

    Context manager.  ``url`` is ``http://127.0.0.1:PORT`` without a trailing slash; ``port`` is ``port`` or a
    free one.  Start-up polls ``GET /healthz`` until it answers 200 or 503 (bounded by ``timeout_s`` seconds,
    else TimeoutError); exit asks uvicorn to shut down and joins the thread (at most 15 s).
    """

    def __init__(self, app, port: Optional[int] = None, timeout_s: float = 30.0):
        import uvicorn  # noqa: PLC0415 (only in-process servers need it)

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._timeout_s = timeout_s

    def __enter__(self) -> "RunningServer":
        self._thread.start()
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code in (200, 503):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server on port {self.port} did not answer within {self._timeout_s} s")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


def api_app(backend, cfg: ServiceConfig) -> tuple[FastAPI, ops.InstrumentedBackend]:
    """The API + ops part of the real server for ``backend`` under ``cfg``: the backend
    wrapped by ``ops.instrument``, the ``/v1`` routes, ``/healthz`` and ``/metrics``.

    Returns (the FastAPI app, the instrumented backend).
    """
    instrumented = ops.instrument(backend)
    app = FastAPI()
    app.include_router(api.create_router(instrumented, cfg))
    app.include_router(ops.create_router(instrumented))
    return app, instrumented


@contextmanager
def serve_engine(loaded, cfg: ServiceConfig) -> Iterator[tuple[str, object]]:
    """``build_engine(loaded, cfg)`` behind ``api_app`` on a ``RunningServer``: yields (url, engine); the engine
    is closed at the end."""
    from qwen_chat.engine.serving.chat_engine import build_engine  # noqa: PLC0415 (engine tests only)

    engine = build_engine(loaded, cfg)
    app, _ = api_app(engine, cfg)
    try:
        with RunningServer(app) as server:
            yield server.url, engine
    finally:
        engine.close()


def hang_up_after(stream, content_chunks: int) -> None:
    """Read an ``openai`` chat-completion ``stream`` until ``content_chunks`` chunks carried answer text, then
    close it: the client hangs up mid-way (the server should cancel the generation)."""
    received = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
        if received == content_chunks:
            break
    stream.close()
