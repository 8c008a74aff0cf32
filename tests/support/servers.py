"""In-process servers for the web tests: a real uvicorn server in a background thread on a free loopback port.

Public API::

    free_port() -> int                                   # a TCP port free on 127.0.0.1 a moment ago
    RunningServer(app) as server: server.url             # http://127.0.0.1:PORT (no trailing slash)
    api_app(backend, cfg) -> (FastAPI, InstrumentedBackend)  # the /v1 API + /healthz + /metrics of the server
    hang_up_after(stream, content_chunks)                 # an openai client leaving a streamed reply mid-way
    with serve_engine(loaded, cfg) as (url, engine): ...  # the real engine of a loaded model behind the API
    with engine_link(engine) as client: ...              # an engine over the real link, as the front sees it
    with front_server() as (front, server, url, backend): ...  # web.front's Front (pending backend) on a port
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

        from qwen_chat.web.front import server_config

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(server_config(app, host="127.0.0.1", port=self.port, log_level="warning"))
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
    api.install(app, instrumented, cfg)
    app.include_router(ops.create_router(instrumented))
    return app, instrumented


@contextmanager
def engine_link(engine, stream_interval: int = 1, prompt_workers: int = 1) -> Iterator[object]:
    """Serve ``engine`` (a ``ChatEngine``) over the real engine link, as the service does between its engine
    process and its web front, with both ends in this process: ``core.link.serve_engine`` in a thread and an
    ``EngineHub``.  Yields the front's ``EngineClient``; at the end the engine is closed through the link."""
    from qwen_chat.engine.core.link import serve_engine as serve_over_link  # noqa: PLC0415
    from qwen_chat.engine.client.engine_hub import EngineHub, link_address  # noqa: PLC0415

    address, stop = link_address("127.0.0.1"), threading.Event()
    hub = EngineHub(address, "secret", replicas=1, stream_interval=stream_interval, prompt_workers=prompt_workers)
    served = threading.Thread(target=serve_over_link, args=(engine, address, "secret", 0, [0], "127.0.0.1"),
                              kwargs={"until": stop.is_set}, daemon=True, name="engine-link")
    served.start()
    try:
        client, = hub.wait_ready(60)
        yield client
    finally:
        stop.set()
        served.join(20)
        hub.close()


@contextmanager
def serve_engine(loaded, cfg: ServiceConfig) -> Iterator[tuple[str, object]]:
    """``build_engine(loaded, cfg)`` served over the engine link (``engine_link``) behind ``api_app`` on a
    ``RunningServer``, as the service runs it: yields (url, engine); the engine is closed at the end."""
    from qwen_chat.engine.startup.runner_setup import build_engine  # noqa: PLC0415 (engine tests only)

    engine = build_engine(loaded, cfg)
    try:
        with engine_link(engine, cfg.stream_interval) as client:
            app, _ = api_app(client, cfg)
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


@contextmanager
def front_server() -> Iterator[tuple]:
    """(front, server, url, backend): a ``web.front.Front`` over a new ``PendingBackend`` (the tiny model's
    provisional info) served by a ``WebServer`` on a free loopback port in a thread; stopped at the end."""
    import uvicorn

    from qwen_chat.chat_types import ModelInfo
    from qwen_chat.pending import PendingBackend
    from qwen_chat.web.front import Front, WebServer
    from tests.support.waiting import wait_until

    backend = PendingBackend(ModelInfo(name="tiny", demo=True, context_length=0))
    front = Front(backend)
    port = free_port()
    server = WebServer(front, uvicorn.Config(front, host="127.0.0.1", port=port, log_level="warning",
                                             timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, "the server to start")
    try:
        yield front, server, f"http://127.0.0.1:{port}", backend
    finally:
        server.should_exit = True
        thread.join(timeout=15)
