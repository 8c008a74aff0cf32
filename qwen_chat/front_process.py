"""The web front process: the port (UI + OpenAI API + /healthz + /metrics), history and login, asyncio, over
the engine processes.  Never imports torch or initialises CUDA.

app.py (rank 0) binds the port, starts this process with the listening socket inherited (``FRONT_FD_ENV``)
and the same command line, and then becomes the engine process of replica 0.  Here:

1. the port is served at once (``web.front``: 503 ``loading`` until the engines are ready);
2. ``EngineHub`` binds the link address (``LINK_ENV``) that every engine process pushes to; Gradio and the
   full application are built meanwhile, and with ``--model`` a local folder the prompt workers load its
   processor beside the engine (else at the engine's hello, which names the folder it loaded);
3. once all ``REPLICAS_ENV`` engine processes said hello, the backend is their ``EngineClient`` (one replica)
   or a ``Router`` over them (several): the same client for replica 0 as for the others.

Lifetimes: the front leaves with code 1 within about a second when its parent (the engine process of replica
0) is gone or an engine process went silent (``wire.ENGINE_SILENT_S``: stopped, or hung in every thread), after
answering 503 and ending the open streams with an error; a silent engine process of replica 0 is killed first
(it would not notice the front's exit, and Supervisor restarts the group only once it is gone); SIGTERM closes the engines first (open replies end "cancelled" and their last
chunks go out), then the server.

    python -m qwen_chat.front_process ARGS...     # only as app.py starts it (the environment carries the rest)
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional, Sequence

from qwen_chat import lifecycle

log = logging.getLogger("qwen_chat.front")

#: Environment: the inherited listening socket's file descriptor.
FRONT_FD_ENV = "QWEN_CHAT_FRONT_FD"
#: Environment: the address the front's ``EngineHub`` binds (``tcp://host:port``).
LINK_ENV = "QWEN_CHAT_ENGINE_LINK"
#: Environment: the link's secret (engines that do not know it are ignored).
TOKEN_ENV = "QWEN_CHAT_LINK_TOKEN"
#: Environment: how many engine processes (data-parallel replicas) to wait for.
REPLICAS_ENV = "QWEN_CHAT_REPLICAS"
#: Seconds the front waits for the engines' hello (the model load included: minutes for the 9B, ZeRO-3 more).
ENGINE_READY_TIMEOUT_S = 7 * 24 * 3600.0
#: Seconds the front waits for its prompt workers to load the processor before it reports ready anyway.
PROMPT_WARM_TIMEOUT_S = 120.0
#: Seconds between the front's checks that its parent process is alive.
PARENT_POLL_S = 0.25


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Serve the front until SIGTERM (0) or until an engine process is gone (1).  Module docstring."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [front] %(name)s: %(message)s")
    from qwen_chat.config import ConfigError, ServiceConfig

    try:
        cfg = ServiceConfig.from_argv(sys.argv[1:] if argv is None else argv).validate()
    except ConfigError as e:  # app.py validated the same line already
        print(f"front: configuration error: {e}", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(os.environ[FRONT_FD_ENV]))
    address, token = os.environ[LINK_ENV], os.environ[TOKEN_ENV]
    replicas = int(os.environ.get(REPLICAS_ENV) or 1)

    from qwen_chat.engine.checkpoints.folders import cached_checkpoint
    from qwen_chat.engine.client.engine_hub import EngineHub, parent_watch
    from qwen_chat.pending import PendingBackend, provisional_info
    from qwen_chat.web.front import Front, WebServer, server_config

    parent_gone = parent_watch()
    backend = PendingBackend(provisional_info(cfg.model))
    front = Front(backend)
    server = WebServer(front, server_config(front, log_level="info"))
    web_done = threading.Event()

    def serve() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            web_done.set()

    threading.Thread(target=serve, name="uvicorn", daemon=True).start()
    lifecycle.install_sigterm_exit()
    gone: list[str] = []
    serving = [False]  # a plain flag: read inside the signal handler, which must take no lock

    def on_stop() -> None:  # the first SIGTERM (lifecycle.stop_polled); the serving loop polls STOPPING
        if not serving[0]:
            raise SystemExit(0)  # still starting: leave through the clean-up below

    def engine_gone(reason: str) -> None:
        if hub.failure is not None and not hub.ready.is_set():  # a start-up failure: app.py reports and exits
            backend.fail(hub.failure)
            return
        gone.append(reason)

    hub = EngineHub(address, token, replicas, stream_interval=cfg.stream_interval, on_engine_gone=engine_gone,
                    prompt_workers=cfg.prompt_worker_count)
    folder = cached_checkpoint(cfg.model, cfg.cache_dir)
    if folder is not None:  # on this machine already: its processor loads while the engine loads
        hub.start_prompts(folder, cfg.image_token_budget)
    with lifecycle.stop_polled(on_stop):
        try:
            from qwen_chat.history.store import HistoryStore
            from qwen_chat.web import server as web_app  # Gradio: seconds of imports, while /healthz answers

            app = web_app.build_app(cfg, backend, HistoryStore(cfg.history_dir))
            front.attach(app, end_streams=lambda: web_app.end_streams(app))
            from qwen_chat.web import file_access

            file_access.start_sweeper()  # the temporary copies an earlier run left, then old ones hourly
            try:
                clients = hub.wait_ready(ENGINE_READY_TIMEOUT_S, stop=parent_gone)
            except (RuntimeError, TimeoutError) as exc:
                backend.fail(str(exc))
                while not parent_gone() and not web_done.wait(PARENT_POLL_S):
                    pass
                return 0 if hub.failure else 1
            if not hub.prompts.wait_warm(PROMPT_WARM_TIMEOUT_S):  # /healthz 200 only once prompts can be built
                log.warning("front: the prompt workers are still loading after %.0f s", PROMPT_WARM_TIMEOUT_S)
            backend.attach(_backend_over(clients), warming=True)
            from qwen_chat.web import self_warm
            from qwen_chat.web.api.routes import model_id_of

            self_warm.warm_up(front, model_id_of(cfg), cfg.api_keys[0] if cfg.api_keys else None)
            backend.warmed()
            if len(clients) > 1:
                log.info("data parallel: all %d replicas ready behind the web front", len(clients))
            serving[0] = True
            while not web_done.wait(PARENT_POLL_S) and not lifecycle.STOPPING.is_set():
                if parent_gone():
                    gone.append("the engine process of replica 0 exited")
                if gone:
                    server.stop_accepting()  # the port is free for the next group at once
                    hub.lose_all(gone[0])  # open streams end with an error; /healthz turns 503
                    print(f"front: {gone[0]}; exiting so that the whole group restarts", file=sys.stderr)
                    if 0 in hub.silent and not parent_gone():
                        # replica 0's engine process is there but silent (stopped, or every thread hung): it would
                        # not notice this exit, and Supervisor restarts only once it is gone
                        print("front: ending the silent engine process of replica 0", file=sys.stderr)
                        os.kill(os.getppid(), signal.SIGKILL)
                    time.sleep(1.0)
                    return 1
            if lifecycle.STOPPING.is_set():
                return 0
            print("front: the web server stopped unexpectedly", file=sys.stderr)
            return 1
        finally:
            serving[0] = True  # from here on a first stop signal must not cut this clean-up short
            # The port is free at once, before the engines' replies end: when the group's launcher was killed
            # (launch.py then SIGTERMs rank 0, which stops this front), Supervisor's next group binds it while this
            # one still closes (a CI run saw its first respawn fail with "Address already in use").  The open
            # connections go on.
            server.stop_accepting()
            if not gone:
                backend.close()  # engines first: their open replies end and their last chunks go out
            server.should_exit = True
            web_done.wait(timeout=15)
            hub.close()


def _backend_over(clients: list):
    """One engine's ``EngineClient`` itself, or a ``Router`` over several (data parallel)."""
    if len(clients) == 1:
        return clients[0]
    from qwen_chat.engine.client.router import Router

    ranks = [c.ranks for c in clients]
    return Router(clients, ranks=ranks, world_size=sum(len(r) for r in ranks))


if __name__ == "__main__":
    try:
        exit_code = main()
    except SystemExit as stop:  # SIGTERM's (lifecycle)
        exit_code = stop.code
    lifecycle.leave(exit_code)
