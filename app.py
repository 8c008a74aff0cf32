"""Composition root of the Qwen3.5 chat service: config -> (rank 0) the web front process -> the engine.

    python app.py --model tiny                      # CPU demo model with random weights
    python app.py --model Qwen/Qwen3.5-9B --host 0.0.0.0 --users-file users.txt --api-key KEY
    bash start.sh ...                               # the same through the (DeepSpeed) launcher

Rank 0 binds the port before anything heavy is imported and hands it to the web front, a child process
(``qwen_chat.front_process``: uvicorn, Gradio, the API, asyncio) that serves it at once: ``/healthz`` answers
503 ``{"reason": "loading"}`` from then on; the UI and the API follow once Gradio is imported (a few seconds)
and answer "still loading" until the engine has passed its self-check.  Rank 0 itself then loads the model and
becomes replica 0's engine process (``engine/core/link.serve_engine``: the scheduler loop, one message per step
to the front).  Either process exits when the other one is gone (docs/architecture.md, "Processes").  A busy port or a missing checkpoint folder therefore
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
``startsecs`` is retried whatever its code).  Meanwhile ``/healthz`` reports the failure.  Likewise a start-up
that succeeds turns ready (``/healthz`` 200) only once the process has run ``startsecs`` + 1 s: Supervisor has then
counted the start as done, so a crash after the service was healthy is restarted however often (with
``autorestart=unexpected`` there is no limit), never mistaken for a failing start (which ends in FATAL after
``startretries``).  Nothing heavy happens at import time; worker ranks never return from ``start_engine``.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import sys
import time
from typing import Optional, Sequence

from qwen_chat import lifecycle

log = logging.getLogger("qwen_chat")

EXIT_STARTUP_FAILED = 78  # sysexits.h EX_CONFIG; listed in deploy/qwen3.5-9b.conf `exitcodes`
#: Under Supervisor, seconds a failed start-up keeps answering ``/healthz`` 503 "start-up failed: ..." before its
#: exit 78, also when the failure came after ``startsecs`` (a monitor polling every few seconds sees the reason).
FAILED_HEALTH_S = 5.0
#: Environment variable carrying Supervisor's ``startsecs`` (deploy/qwen3.5-9b.conf); unset: exit at once.
STARTSECS_ENV = "QWEN_CHAT_STARTSECS"
_STARTED_AT = time.monotonic()  # this process's start (imports come first)


#: Seconds a busy port is tried again before the start-up fails.  After a crash of the launcher, Supervisor
#: starts the next group at once while the old web front is still leaving (it frees the port 1.5-3 s after the
#: crash on an idle machine, later on a loaded one); a port held by another program still fails well within
#: ``startsecs`` (deploy/qwen3.5-9b.conf), so Supervisor gives up instead of restarting forever.
PORT_BUSY_WAIT_S = 4.0


def _listen(host: str, port: int, busy_wait_s: float = PORT_BUSY_WAIT_S) -> socket.socket:
    """Bind and listen on ``host:port`` now, before anything heavy, so a busy port fails the start-up early.
    A port in use is tried again every 0.2 s for ``busy_wait_s`` seconds.  Raises OSError (the last one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + busy_wait_s
    waited = False
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            break
        except OSError as e:
            sock.close()
            if e.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            if not waited:
                print(f"app.py: port {port} is busy; trying again for {busy_wait_s:.0f} s (a previous instance "
                      "may still be leaving)", file=sys.stderr, flush=True)
                waited = True
            time.sleep(0.2)
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

    # A replica's lead (an engine process) holds the scheduler thread beside the link's input, sender and status
    # threads (core/link.py).  When one of those holds the GIL (a grammar compiled, a step message packed) the
    # scheduler waits up to the switch interval to get it back (Python's default: 5 ms, longer than a decode
    # step); a 1 ms interval lets it launch the next step in time.
    if layout.is_lead:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if layout.rank != 0:  # no web front: a worker rank, or the lead of replica >= 1 (it serves its engine to
        # rank 0's front); neither returns from start_engine
        if layout.is_lead:  # SIGTERM closes its engine as rank 0's does (a worker rank installs its own handler)
            lifecycle.install_sigterm_exit()
        return _start_engine_or_exit(cfg, None)

    try:
        sock = _listen(cfg.host, cfg.port)
    except OSError as e:
        print(f"app.py: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        return 1

    # The web front runs in a process of its own (qwen_chat.front_process: asyncio, no torch), started now so
    # that the port answers from the first second; this process becomes replica 0's engine process.
    from qwen_chat.engine.client.engine_hub import link_address

    link = Link(link_address(_link_host()), secrets.token_hex(16))
    front = _spawn_front(sock, link, layout.replicas, argv)
    sock.close()  # the front holds it now
    log.info("listening on http://%s:%d (503 'loading' until the model is ready); web front pid %d", cfg.host,
             cfg.port, front.pid)
    # SIGTERM (Supervisor's stop) -> SystemExit in the main thread -> the engine closes (its open streams end
    # and their last chunks reach the front) -> the front is stopped.  Under several ranks the engine replaces
    # this handler with one that first sends the exit message to every rank.
    lifecycle.install_sigterm_exit()
    front_exited = lambda: front.poll() is not None  # noqa: E731
    try:
        t0 = time.monotonic()
        from qwen_chat.engine.startup import bootstrap  # torch and the engine's modules: seconds

        try:
            engine = bootstrap.start_engine(cfg, link=link, imports_s=time.monotonic() - t0)
        except bootstrap.StartupError as e:
            _report_failure(link, str(e))
            print(f"app.py: cannot start the engine: {e}", file=sys.stderr)
            _hold_until_started_for_supervisor(front_exited)
            return EXIT_STARTUP_FAILED
        # Ready (the front's /healthz 200) only once Supervisor counts the start as done: a crash after the
        # service was healthy is then always restarted, however often (module docstring).
        _hold_until_started_for_supervisor(front_exited, exit_code=None)
        if front_exited():
            print(f"app.py: the web front exited with code {front.returncode}", file=sys.stderr)
            return 1
        from qwen_chat.engine.core.link import serve_engine

        layout_ranks = list(layout.ranks_of(0)) if layout.replicas > 1 else list(range(layout.world_size))
        clean = serve_engine(engine, link.address, link.token, replica=0, ranks=layout_ranks, host=_link_host(),
                             until=front_exited)
        if not clean:
            print("app.py: a worker rank was already gone at shutdown", file=sys.stderr)
            return lifecycle.FAILURE_EXIT_CODE
        if front_exited() and not lifecycle.STOPPING.is_set():
            print(f"app.py: the web front exited with code {front.returncode}; stopping the engine",
                  file=sys.stderr)
            return 1
        return 0
    finally:
        _stop_front(front)


class Link:
    """The front <-> engine link of this start: ``address`` (``tcp://host:port``, the front's PULL socket) and
    its secret ``token``."""

    def __init__(self, address: str, token: str) -> None:
        self.address, self.token = address, token


def _link_host() -> str:
    """Where the link's sockets bind: ``MASTER_ADDR`` (the launcher's rendezvous host), else loopback."""
    return os.environ.get("MASTER_ADDR") or "127.0.0.1"


def _spawn_front(sock: socket.socket, link: Link, replicas: int, argv: Optional[Sequence[str]], **popen):
    """Start ``qwen_chat.front_process`` with the listening socket and the same command line (``popen``: more
    ``subprocess.Popen`` arguments, e.g. where its output goes)."""
    import subprocess

    from qwen_chat.front_process import FRONT_FD_ENV, LINK_ENV, REPLICAS_ENV, TOKEN_ENV

    env = dict(os.environ, **{FRONT_FD_ENV: str(sock.fileno()), LINK_ENV: link.address, TOKEN_ENV: link.token,
                              REPLICAS_ENV: str(replicas)})
    args = list(sys.argv[1:] if argv is None else argv)
    return subprocess.Popen([sys.executable, "-m", "qwen_chat.front_process", *args], env=env,
                            pass_fds=(sock.fileno(),), cwd=os.getcwd(), **popen)


def _report_failure(link: Link, reason: str) -> None:
    """Tell the front that the engine cannot start (its /healthz then says why)."""
    import zmq

    from qwen_chat.engine import wire

    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(link.address)
    push.send(wire.dumps([0, [["failed", reason]]]))
    push.close()


def _stop_front(front) -> None:
    """SIGTERM the front (it ends its streams and tabs) and wait for it; SIGKILL after 20 s."""
    import subprocess

    if front.poll() is None:
        front.terminate()
    try:
        front.wait(timeout=20)
    except subprocess.TimeoutExpired:
        front.kill()
        front.wait()


def _start_engine_or_exit(cfg, backend) -> int:
    """A rank other than 0: start the engine (workers and the other replicas' leads never return)."""
    from qwen_chat.engine.startup import bootstrap

    try:
        bootstrap.start_engine(cfg)  # worker ranks stay inside and never return
    except bootstrap.StartupError as e:
        print(f"app.py: cannot start the engine: {e}", file=sys.stderr)
        _hold_until_started_for_supervisor()
        return EXIT_STARTUP_FAILED
    return 0


def _hold_until_started_for_supervisor(stop=None, exit_code: Optional[int] = EXIT_STARTUP_FAILED) -> None:
    """Sleep until this process has run ``$QWEN_CHAT_STARTSECS`` + 1 s (nothing when unset or not a number) or
    ``stop()`` turns True.  Before exit code 78 (``exit_code``): Supervisor sees it after its start window and
    treats it as final.  Before serving (``exit_code=None``): the service turns ready only once Supervisor
    counts it as started, so a crash after it was healthy is restarted however often (module docstring)."""
    try:
        startsecs = float(os.environ.get(STARTSECS_ENV) or 0)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; not waiting for it", STARTSECS_ENV,
                    os.environ[STARTSECS_ENV])
        return
    left = startsecs + 1.0 - (time.monotonic() - _STARTED_AT)
    if exit_code is not None:  # /healthz says why for a while, also when the failure came after startsecs
        left = max(left, FAILED_HEALTH_S)
    if startsecs > 0 and left > 0:
        if exit_code is None:
            log.info("ready in %.1f s, after Supervisor's startsecs (%.0f s)", left, startsecs)
        else:
            log.info("exiting with code %d in %.0f s, after Supervisor's startsecs (%.0f s): a start-up that "
                     "cannot succeed is not retried", exit_code, left, startsecs)
        sys.stdout.flush()
        deadline = time.monotonic() + left
        while time.monotonic() < deadline and not (stop is not None and stop()):
            time.sleep(0.2)


if __name__ == "__main__":
    try:
        exit_code = main()
    except SystemExit as stop:  # SIGTERM's (lifecycle), argparse's usage error
        exit_code = stop.code
    lifecycle.leave(exit_code)
