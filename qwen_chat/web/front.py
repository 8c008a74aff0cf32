"""What serves the port from the first second: the ``Front`` ASGI app, the ``WebServer`` around it, and the
health-check filter of the access log.  Imports neither Gradio nor torch (uvicorn only: ~0.1 s).

app.py binds the port and starts ``WebServer(Front(backend))`` at once; only then does it import Gradio and
build the full application (``qwen_chat.web.server.build_app``, ~3 s on 2 CPU cores), ``attach`` it, and load
the engine in its main thread::

    front = Front(backend)                                   # backend: the PendingBackend
    server = WebServer(front, server_config(front))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}).start()
    front.attach(build_app(...), end_streams=...)            # from the main thread

``Front`` answers, in the event loop itself (no worker thread, no lock, nothing the loading thread holds):

- ``GET /healthz`` while the engine is not attached (``backend.engine is None``): 503 ``{"status":
  "unavailable", "reason": "loading"}`` (or the start-up failure), the body of ``health_report``.  Once the
  engine is attached, the full application's route answers (``ops.create_router``);
- any other request before the full application is attached: 503, as ``{"error": {...}}`` (OpenAI's shape)
  for ``/v1/...``, else a small page that reloads itself every 2 s;
- ASGI lifespan: startup completes at once; the full application's own lifespan (Gradio's queue) is started by
  ``attach`` and shut down with the server.

``WebServer`` ends long-lived streams at the start of uvicorn's graceful shutdown: every open browser tab holds
a Gradio heartbeat stream that never ends by itself, so without this each stop waited the whole
``timeout_graceful_shutdown`` and then logged a CancelledError traceback.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any, Callable, Optional

import uvicorn

log = logging.getLogger(__name__)

#: Seconds uvicorn waits for open requests once the shutdown began before it cancels them (a backstop: the
#: engine is closed first, so replies end at once, and ``WebServer`` ends the heartbeat streams).
GRACEFUL_SHUTDOWN_S = 2.0
#: Seconds ``Front.attach`` waits for the server's event loop and for the application's lifespan startup.
ATTACH_TIMEOUT_S = 60.0
#: Request paths whose access-log lines are dropped (polled by health checkers and Prometheus every few s).
QUIET_PATHS = frozenset({"/healthz", "/metrics"})

_STARTING_PAGE = (b"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='2'>"
                  b"<title>Qwen3.5 chat: starting</title></head><body style='font-family:sans-serif'>"
                  b"<p>The chat service is starting; this page reloads by itself.</p></body></html>")


def server_config(app: Any, **options: Any) -> uvicorn.Config:
    """How the service's uvicorn serves ``app`` (``options``: host, port, log level...): graceful shutdown of
    ``GRACEFUL_SHUTDOWN_S``, and the TCP peer as the client address (``proxy_headers=False``: an
    ``X-Forwarded-For`` sent by a local client must not change the address the login limit counts;
    ``web.login_guard``), on uvloop's event loop with httptools' HTTP parser (uvicorn's "standard" choice: the
    front's CPU per streamed token 98 -> 84 us at 32 streams and 74 -> 66 us at 128 against asyncio's loop and
    h11, ``bench/front_bench.py`` on the 2-core CPU machine, 2026-12-03)."""
    options = {"loop": "uvloop", "http": "httptools", **options}
    return uvicorn.Config(app, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, proxy_headers=False, **options)


def health_report(backend: Any) -> tuple[int, dict]:
    """(HTTP status, JSON body) of ``/healthz`` for ``backend``: 200 ``{"status": "ok", ...}`` when
    ``backend.health()["ok"]``, else 503 ``{"status": "unavailable", "reason": ...}``.  Extra keys of
    ``health()`` (ranks, mode...) are passed through when JSON-simple; a ``health()`` that raises gives 503 with
    the exception's class name (logged with its traceback, none sent)."""
    try:
        report = dict(backend.health())
    except Exception as exc:  # noqa: BLE001 - reported as unhealthy
        log.exception("backend.health() failed")
        return 503, {"status": "unavailable", "reason": f"health check failed: {type(exc).__name__}"}
    ok = bool(report.pop("ok", False))
    reason = str(report.pop("reason", "") or ("" if ok else "engine not ready"))
    body = {"status": "ok" if ok else "unavailable"}
    if reason:
        body["reason"] = reason
    body.update({k: v for k, v in report.items() if k not in body and _json_simple(v)})
    return (200 if ok else 503), body


def _json_simple(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_simple(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_simple(v) for k, v in value.items())
    return False


async def _respond(send, status: int, body: bytes, content_type: bytes, extra=()) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Front:
    """The ASGI app given to uvicorn (see the module docstring for what it answers itself).

    ``backend``: the ``PendingBackend`` (``.engine`` is None until the engine is attached; ``health()`` takes no
    lock).  Thread-safe: ``attach`` is called from app.py's main thread while the event loop runs in uvicorn's.
    """

    def __init__(self, backend: Any):
        self.backend = backend
        self.app: Optional[Callable] = None
        self._end_streams: Optional[Callable[[], None]] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_ready = threading.Event()
        self._state: dict = {}
        self._inbox: Optional[asyncio.Queue] = None
        self._inner_done: Optional[asyncio.Future] = None

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        app = self.app
        if kind == "http" and scope["path"] == "/healthz" and (app is None or self.backend.engine is None):
            status, body = health_report(self.backend)
            await _respond(send, status, json.dumps(body).encode(), b"application/json")
        elif app is not None:
            await app(scope, receive, send)
        elif kind == "http":
            await self._starting(scope, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1013})  # try again later

    @staticmethod
    async def _starting(scope, send) -> None:
        retry = [(b"retry-after", b"2")]
        if scope["path"].startswith("/v1/"):
            error = {"message": "the service is starting; try again in a moment", "type": "not_ready",
                     "param": None, "code": "not_ready"}
            await _respond(send, 503, json.dumps({"error": error}).encode(), b"application/json", retry)
        else:
            await _respond(send, 503, _STARTING_PAGE, b"text/html; charset=utf-8", retry)

    async def _lifespan(self, scope, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._state = scope.setdefault("state", {})
                self._loop = asyncio.get_running_loop()
                self._loop_ready.set()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self._stop_inner()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the server runs this app in (set at its lifespan startup).  Raises RuntimeError
        before that."""
        if self._loop is None:
            raise RuntimeError("the web server's event loop has not started")
        return self._loop

    @property
    def lifespan_state(self) -> dict:
        """The lifespan state uvicorn gives each request's scope (a request built here gets a copy)."""
        return self._state

    def attach(self, app: Callable, end_streams: Optional[Callable[[], None]] = None) -> None:
        """Serve every request (but ``/healthz`` while loading) with ``app`` (the FastAPI app of
        ``server.build_app``) from now on, after running its lifespan startup in the server's event loop.
        ``end_streams()`` is called in that loop when the server begins to shut down.

        Raises TimeoutError when the server's loop did not start or the startup took over ``ATTACH_TIMEOUT_S``
        seconds, RuntimeError when the application's lifespan startup failed."""
        if not self._loop_ready.wait(ATTACH_TIMEOUT_S):
            raise TimeoutError(f"the web server did not start within {ATTACH_TIMEOUT_S:.0f} s")
        future = asyncio.run_coroutine_threadsafe(self._start_inner(app), self._loop)
        future.result(ATTACH_TIMEOUT_S)
        self._end_streams = end_streams
        self.app = app

    async def _start_inner(self, app: Callable) -> None:
        """Drive ``app``'s ASGI lifespan protocol up to ``startup.complete`` (its task lives on until shutdown)."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        started = loop.create_future()
        done = loop.create_future()

        async def send(message) -> None:
            kind = message["type"]
            if kind == "lifespan.startup.complete":
                started.set_result(None)
            elif kind == "lifespan.startup.failed":
                started.set_exception(RuntimeError(f"application start-up failed: {message.get('message', '')}"))
            elif kind.startswith("lifespan.shutdown.") and not done.done():
                done.set_result(None)

        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self._state}
        task = loop.create_task(app(scope, inbox.get, send))
        task.add_done_callback(lambda t: done.done() or done.set_result(None))
        await inbox.put({"type": "lifespan.startup"})
        await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            task.result()  # raises what the lifespan raised
            raise RuntimeError("the application's lifespan ended before its start-up completed")
        started.result()
        self._inbox, self._inner_done = inbox, done

    async def _stop_inner(self) -> None:
        if self._inbox is None:
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(self._inner_done, ATTACH_TIMEOUT_S)

    def end_streams(self) -> None:
        """Run the ``end_streams`` callback given to ``attach`` (in the event loop; errors are logged)."""
        if self._end_streams is None:
            return
        try:
            self._end_streams()
        except Exception:  # noqa: BLE001 - the shutdown goes on; uvicorn's backstop cancels what is left
            log.exception("ending the open streams failed")


class WebServer(uvicorn.Server):
    """``uvicorn.Server`` for a ``Front``: ends the long-lived streams first when its shutdown begins, and drops
    the access-log lines of ``QUIET_PATHS`` (``QuietHealthChecks``).  Installs no signal handlers when run
    outside the main thread (uvicorn's rule), so app.py's SIGTERM handler stays in charge."""

    def __init__(self, front: Front, config: uvicorn.Config):
        super().__init__(config)
        self.front = front
        access = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, QuietHealthChecks) for f in access.filters):
            access.addFilter(QuietHealthChecks())

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def stop_accepting(self) -> None:
        """Close the listening sockets now, from any thread, while the open connections go on (the shutdown
        that follows waits for them).  For a front whose engine is gone: the port is free for the group that
        Supervisor starts next without waiting out the last replies.  No-op before start-up or after the loop
        closed."""
        loop = getattr(self, "_loop", None)
        if loop is None or loop.is_closed():
            return

        def close() -> None:
            for server in self.servers:
                server.close()

        try:
            loop.call_soon_threadsafe(close)
        except RuntimeError:  # the loop closed meanwhile: its sockets are closed with it
            pass

    async def shutdown(self, sockets=None) -> None:
        self.front.end_streams()
        await super().shutdown(sockets=sockets)


class QuietHealthChecks(logging.Filter):
    """Drops uvicorn access-log records of requests to ``QUIET_PATHS`` (every other line is kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in QUIET_PATHS
        return True
