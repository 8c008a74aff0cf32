"""How processes of the service leave: ``lifecycle.leave`` (app.py's end) and the launcher watchdog of the ranks
(``ranks.start_launcher_watchdog``), each in a real child process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from qwen_chat.engine.parallel.ranks import LAUNCHER_GONE_GRACE_S, LAUNCHER_WATCH_INTERVAL_S
from tests.support.service_harness import REPO
from tests.support.waiting import wait_until


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, **kwargs)


@pytest.mark.parametrize("code, status, stderr", [(3, 3, ""), (None, 0, ""), ("app.py: bye", 1, "app.py: bye")])
def test_leave_runs_the_atexit_handlers_and_exits_with_the_code(code, status, stderr):
    done = run_python(f"""
        import atexit, logging, sys
        from qwen_chat import lifecycle
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        atexit.register(print, "atexit ran")
        print("buffered", end=" ")  # still written: the streams are flushed
        lifecycle.leave({code!r})
        print("not reached")
        """)
    assert done.returncode == status
    assert done.stdout == "buffered atexit ran\n" and done.stderr.strip() == stderr


def test_a_sigterm_during_a_serving_loops_shutdown_lets_the_shutdown_finish():
    """The engine's link and the web front serve inside ``lifecycle.stop_polled``: the first SIGTERM only sets
    ``STOPPING`` (and calls the block's ``on_stop``), which the serving loop polls, so a signal that arrives
    while the loop waits, or while its shutdown already runs (the front's "close" ended the loop a moment
    earlier), cannot cut the shutdown short or hang it; a repeated signal is ignored.  Outside such a block
    SIGTERM raises SystemExit(0), and an ``on_stop`` that raises (the front still starting) does the same."""
    done = run_python("""
        import os, signal, threading, time
        from qwen_chat import lifecycle
        lifecycle.install_sigterm_exit()
        calls, done = [], threading.Event()
        with lifecycle.stop_polled(lambda: calls.append("on_stop")):
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
            t0 = time.monotonic()
            try:
                while not done.wait(0.0005):  # the serving loop: many short waits, so the signal lands in one
                    if lifecycle.STOPPING.is_set():
                        break
                print("loop ended", round(time.monotonic() - t0) <= 1, calls)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # a repeated signal, during the shutdown: ignored
                steps = []
                for i in range(5):
                    time.sleep(0.05)
                    steps.append(i)
                print("shutdown complete", steps)
        print("left the block; stopping", lifecycle.STOPPING.is_set())
        """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["loop ended True ['on_stop']", "shutdown complete [0, 1, 2, 3, 4]",
                                        "left the block; stopping True"]
    late = run_python("""
        import os, signal, time
        from qwen_chat import lifecycle
        lifecycle.install_sigterm_exit()
        with lifecycle.stop_polled():
            try:
                pass  # the serving loop, ended by the front's "close"
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # this process's own first stop, during the shutdown
                steps = []
                for i in range(5):
                    time.sleep(0.05)
                    steps.append(i)
                print("shutdown complete", steps)
        """)
    assert late.stdout.strip() == "shutdown complete [0, 1, 2, 3, 4]", late.stderr
    for opening in ("if True:", "with lifecycle.stop_polled(still_starting):"):  # outside a block; a raising on_stop
        stopped = run_python(f"""
            import os, signal, time
            from qwen_chat import lifecycle
            lifecycle.install_sigterm_exit()
            def still_starting():
                raise SystemExit(0)
            {opening}
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)
                    print("not interrupted")
                except SystemExit as stop:
                    print("SystemExit", stop.code)
            """)
        assert stopped.stdout.strip() == "SystemExit 0", (opening, stopped.stderr)


def test_a_rank_whose_launcher_was_killed_exits_within_about_a_second(tmp_path):
    """The launcher (here: the leader of a new session, parent of the rank) is killed with SIGKILL; the rank's
    watchdog notices within ``LAUNCHER_WATCH_INTERVAL_S``, waits ``LAUNCHER_GONE_GRACE_S`` and leaves with
    code 1, so an orphaned rank 0 frees the port before Supervisor's respawn binds it."""
    rank_log = tmp_path / "rank.log"
    rank = ("import sys, time; from qwen_chat.engine.parallel.ranks import start_launcher_watchdog; "
            "assert start_launcher_watchdog() is not None; print('watching', flush=True); time.sleep(120)")
    launcher = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {rank!r}], "
                               f"stdout=open({str(rank_log)!r}, 'w'), stderr=subprocess.STDOUT); "
                               f"print(p.pid, flush=True); time.sleep(120)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rank_pid = int(launcher.stdout.readline())
        wait_until(lambda: "watching" in rank_log.read_text(), 60, "the rank's watchdog to start")
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        t0 = time.monotonic()

        def gone() -> bool:
            try:
                return psutil.Process(rank_pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_until(gone, 30, "the orphaned rank to exit", poll_s=0.05)
        gone_s = time.monotonic() - t0
        assert "is gone; exiting" in rank_log.read_text()
        assert gone_s < LAUNCHER_WATCH_INTERVAL_S + LAUNCHER_GONE_GRACE_S + 2.0, gone_s  # margin: a busy machine
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_port_freed_by_a_leaving_instance_is_bound_and_one_held_elsewhere_fails_after_the_wait():
    """app.py's ``_listen``: the port a previous instance frees within the wait is bound (Supervisor's respawn
    after a crash starts at once); a port kept busy fails with the bind error once the wait is over."""
    done = run_python("""
        import socket, threading, time
        import app
        held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen(1)
        port = held.getsockname()[1]
        threading.Timer(0.6, held.close).start()
        t0 = time.monotonic()
        sock = app._listen("127.0.0.1", port, busy_wait_s=4.0)
        print("bound", sock.getsockname()[1] == port, round(time.monotonic() - t0, 1) >= 0.6)
        sock.close()
        busy = socket.socket(); busy.bind(("127.0.0.1", 0)); busy.listen(1)
        t0 = time.monotonic()
        try:
            app._listen("127.0.0.1", busy.getsockname()[1], busy_wait_s=1.0)
        except OSError as e:
            print("failed", e.strerror, 1.0 <= time.monotonic() - t0 < 3.0)
        """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["bound True True", "failed Address already in use True"]
    assert "is busy; trying again" in done.stderr
