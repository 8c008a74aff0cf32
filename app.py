"""Composition root of the Qwen3.5 chat service: config -> (rank 0) web server -> engine.

    python app.py --model tiny                      # CPU demo model with random weights
    python app.py --model Qwen/Qwen3.5-9B --host 0.0.0.0 --users-file users.txt --api-key KEY
    bash start.sh ...                               # the same through the (DeepSpeed) launcher

Rank 0 binds the port and serves it before anything heavy is imported (``qwen_chat.web.front``): ``/healthz``
answers 503 ``{"reason": "loading"}`` from then on, without waiting on the loading (the main thread); the UI
and the API follow once Gradio is imported and the application is built (a few seconds), and answer "still
loading" until the engine has passed its self-check.  A busy port or a missing checkpoint folder therefore
fails in about a second, well inside Supervisor's ``startsecs`` (it then gives up with FATAL instead of
restarting forever).

Exit codes: 0 after a clean shutdown; 2 for a bad command line, environment variable, history folder or users
file, or a launcher world that does not split into ``--data-parallel`` replicas (argparse's usage and
``app.py: error: ...``, or one ``app.py: configuration error: ...`` line from ``ServiceConfig.validate`` or
``ReplicaLayout.from_env``, before anything is loaded); 1 for a fast start-up failure (port busy, no checkpoint
folder) and for a crash while serving
(Supervisor restarts it); 78 (EX_CONFIG, ``EXIT_STARTUP_FAILED``) when ``bootstrap.start_engine`` raises
``StartupError`` after loading began (out of memory, broken checkpoint, bad sharding config).  Under
Supervisor (``$QWEN_CHAT_STARTSECS``, set by deploy/qwen3.5-9b.conf to its ``startsecs``) that exit waits until
the process has run ``startsecs`` + 1 s: Supervisor then counts the start as done and, 78 being listed in
``exitcodes``, leaves the program EXITED instead of retrying a start-up that cannot succeed (an exit inside
``startsecs`` is retried whatever its code).  Meanwhile ``/healthz`` reports the failure.  Nothing heavy happens
at import time; worker ranks never return from ``start_engine``.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import Optional, Sequence

from qwen_chat import lifecycle

log = logging.getLogger("qwen_chat")

EXIT_STARTUP_FAILED = 78  # sysexits.h EX_CONFIG; listed in deploy/qwen3.5-9b.conf `exitcodes`
#: Environment variable carrying Supervisor's ``startsecs`` (deploy/qwen3.5-9b.conf); unset: exit at once.
STARTSECS_ENV = "QWEN_CHAT_STARTSECS"
_STARTED_AT = time.monotonic()  # this process's start (imports come first)


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen on ``host:port`` now, so a busy port fails the start-up at once (OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


#: Seconds between the interpreter's thread switches on each replica's lead (``sys.setswitchinterval``; see ``main``).
GIL_SWITCH_INTERVAL_S = 0.001


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse and validate the command line, serve the UI + API on ``cfg.host:cfg.port`` (rank 0) and start the
    engine.  Returns the process exit code (module docstring); worker ranks do not return."""
    from qwen_chat.config import ConfigError, ServiceConfig, local_checkpoint_problem

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = ServiceConfig.from_argv(sys.argv[1:] if argv is None else argv).validate()
    except ConfigError as e:
        print(f"app.py: configuration error: {e}", file=sys.stderr)
        return 2
    from qwen_chat.engine.parallel.layout import LayoutError, ReplicaLayout  # no torch

    try:  # --data-parallel against the launcher's world: before the heavy imports, one line (on rank 0)
        layout = ReplicaLayout.from_env(cfg.data_parallel, cfg.ds_config)
    except LayoutError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # the other ranks leave quietly: one line in the log
            print(f"app.py: configuration error: {e}", file=sys.stderr)
        return 2
    problem = local_checkpoint_problem(cfg.model)  # before the heavy imports: fails within startsecs
    if problem:
        print(f"app.py: cannot start the engine: {problem}", file=sys.stderr)
        return 1

    # A replica's lead holds its engine's scheduler thread and every stream's thread (web threads on rank 0, the
    # replica link's on the other leads).  Under load those keep the GIL busy, and the scheduler waits up to the
    # switch interval each time it wants it back (Python's default: 5 ms, longer than a decode step); a 1 ms
    # interval lets it launch the next step in time.
    if layout.is_lead:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if layout.rank != 0:  # no web server: a worker rank, or the lead of replica >= 1 (it serves its engine to
        # rank 0's front); neither returns from start_engine
        return _start_engine_or_exit(cfg, None)

    try:
        sock = _listen(cfg.host, cfg.port)
    except OSError as e:
        print(f"app.py: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        return 1

    import uvicorn

    from qwen_chat.pending import PendingBackend, provisional_info
    from qwen_chat.web.front import GRACEFUL_SHUTDOWN_S, Front, WebServer

    backend = PendingBackend(provisional_info(cfg.model))
    front = Front(backend)
    server = WebServer(front, uvicorn.Config(front, log_level="info",
                                             timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    # Not the main thread: uvicorn installs no signal handlers there; the engine's SIGTERM handler (rank 0
    # broadcasts the exit message to the workers) stays in charge, and the finally below stops the server.
    # The main thread waits on an Event, not on web.join(): a signal handler that raises inside Thread.join()
    # makes CPython 3.11 release the running thread's state lock, so is_alive() turns False and the final join
    # returns at once, ending the process in the middle of open responses (bpo-45274's handling).
    web_done = threading.Event()

    def serve() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            web_done.set()

    web = threading.Thread(target=serve, name="uvicorn", daemon=True)
    web.start()
    log.info("listening on http://%s:%d (503 'loading' until the model is ready)", cfg.host, cfg.port)
    # SIGTERM (Supervisor's stop) -> SystemExit in the main thread -> the finally below shuts the server down
    # gracefully.  Under several ranks the engine replaces this handler with one that first sends the exit
    # message to every rank.
    lifecycle.install_sigterm_exit()  # once; a repeated SIGTERM cannot interrupt the clean-up
    try:
        from qwen_chat.history.store import HistoryStore
        from qwen_chat.web import server as web_app  # Gradio: seconds of imports, while /healthz answers

        app = web_app.build_app(cfg, backend, HistoryStore(cfg.history_dir))
        front.attach(app, end_streams=lambda: web_app.end_streams(app))
        code = _start_engine_or_exit(cfg, backend)
        if code:
            return code
        log.info("serving http://%s:%d (model %s)", cfg.host, cfg.port, backend.info.name)
        while not web_done.wait(timeout=1.0):  # short waits keep the main thread responsive to signals
            pass
        # Only a signal (SystemExit from the handler, through the finally) stops the server on purpose; a web
        # thread that ended by itself failed, and Supervisor should restart the service.
        print("app.py: the web server stopped unexpectedly", file=sys.stderr)
        return 1
    finally:
        # The engine first: its open streams end ("cancelled", saved by the UI as interrupted), so each HTTP
        # response still sends its last chunk (finish_reason, [DONE]) before the server stops; the server then
        # ends the tabs' heartbeat streams itself (WebServer.shutdown).
        backend.close()
        server.should_exit = True
        web_done.wait(timeout=15)


def _start_engine_or_exit(cfg, backend) -> int:
    """Start the engine on this rank; on rank 0 attach it to ``backend``.  Returns an exit code (0 = started)."""
    from qwen_chat.engine.serving import bootstrap

    try:
        engine = bootstrap.start_engine(cfg)  # worker ranks stay inside and never return
    except bootstrap.StartupError as e:
        if backend is not None:
            backend.fail(str(e))
        print(f"app.py: cannot start the engine: {e}", file=sys.stderr)
        _hold_until_started_for_supervisor()
        return EXIT_STARTUP_FAILED
    backend.attach(engine)
    return 0


def _hold_until_started_for_supervisor() -> None:
    """Sleep until this process has run ``$QWEN_CHAT_STARTSECS`` + 1 s (nothing when unset or not a number), so
    that Supervisor sees exit code 78 after its start window and treats it as final (module docstring)."""
    try:
        startsecs = float(os.environ.get(STARTSECS_ENV) or 0)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; exiting at once", STARTSECS_ENV, os.environ[STARTSECS_ENV])
        return
    left = startsecs + 1.0 - (time.monotonic() - _STARTED_AT)
    if startsecs > 0 and left > 0:
        log.info("exiting with code %d in %.0f s, after Supervisor's startsecs (%.0f s): a start-up that cannot "
                 "succeed is not retried", EXIT_STARTUP_FAILED, left, startsecs)
        sys.stdout.flush()
        time.sleep(left)


if __name__ == "__main__":
    try:
        exit_code = main()
    except SystemExit as stop:  # SIGTERM's (lifecycle), argparse's usage error
        exit_code = stop.code
    lifecycle.leave(exit_code)
