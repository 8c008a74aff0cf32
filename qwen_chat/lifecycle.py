"""Process lifecycle: the one stopping flag, the stop-signal handlers, and the ways a process leaves.

``STOPPING`` is set by the first stop signal this process handles.  Every handler below checks it first, so a
repeated signal (the DeepSpeed launcher forwards the group's SIGTERM, so each rank gets it twice; an impatient
operator) cannot interrupt the shutdown already under way, and the launcher watchdog
(``qwen_chat.engine.parallel.ranks.start_launcher_watchdog``) stands aside once it is set.

Handlers, each installed by one caller (signal handlers can only be installed from the main thread):

- ``install_sigterm_exit()``: app.py, before the engine starts.  SIGTERM raises ``SystemExit(0)`` in the main
  thread, once, so app.py's ``finally`` ends the open streams and stops the web server gracefully.  Inside a
  ``stop_polled()`` block (a serving loop: the engine's link, the web front) it only sets ``STOPPING``, which
  the loop polls, so that nothing is raised into the loop's own shutdown.
- ``install_rank0_sigterm(close_workers)``: rank 0 of several ranks, once its ``DistributedExecutor`` exists
  (replaces the handler above).  SIGTERM first sends the exit message to every worker rank
  (``close_workers() -> bool``), then raises ``SystemExit(0)``; when a worker was already gone it leaves at once
  with ``FAILURE_EXIT_CODE``.  Inside a ``stop_polled`` block it only sets ``STOPPING``: the serving loop's
  shutdown closes the engine, whose executor sends the exit message.
- ``install_worker_stop_signals(rank)``: every worker rank, entering its worker loop.  SIGTERM and SIGINT are
  held off for ``WORKER_SIGTERM_GRACE_S`` seconds so that rank 0's exit message can arrive; after that the
  worker leaves with 128 + the signal number.

Leaving: ``die(message, code)`` at once (``os._exit``), ``die_unless_stopping(message, grace_s)`` when a peer
vanished, ``exit_process_soon(reason)`` with code 1 after
``FATAL_EXIT_DELAY_S`` seconds, ``leave(code)`` at the end of app.py (the atexit handlers, then ``os._exit``).  Supervisor restarts the service after any non-zero exit
(``deploy/qwen3.5-9b.conf``).  No torch here: app.py uses this module before anything heavy is imported.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Optional

log = logging.getLogger(__name__)


class StopFlag:
    """A flag set once, by a signal handler, and read from any thread (``is_set``).  No lock: a handler runs in
    the main thread between any two bytecodes, also inside a lock that thread holds (a ``threading.Event``'s
    own, or the first handler's while a repeated signal arrives), and taking that lock again would hang."""

    __slots__ = ("_unclaimed",)

    def __init__(self) -> None:
        self._unclaimed = [True]  # popped once: list.pop is atomic, so exactly one caller claims the flag

    def claim(self) -> bool:
        """Set the flag; True only for the first call ever."""
        try:
            self._unclaimed.pop()
        except IndexError:
            return False
        return True

    def is_set(self) -> bool:
        """Whether the flag is set."""
        return not self._unclaimed


#: Set once this process has begun an orderly shutdown (its first stop signal).
STOPPING = StopFlag()

#: Exit code of a process that left because of a failure (Supervisor restarts the service on any non-zero code).
FAILURE_EXIT_CODE = 1

#: Seconds a worker waits, after SIGTERM from the launcher, for rank 0's exit message before it leaves on its
#: own (below the DeepSpeed launcher's 30 s grace before SIGKILL).
WORKER_SIGTERM_GRACE_S = 20.0

#: Seconds between an engine failure and the process exit: the failed streams' last updates reach their
#: clients and the UI saves the interrupted turns first.
FATAL_EXIT_DELAY_S = 2.0


#: The ``on_stop`` callbacks (or None) of the open ``stop_polled`` blocks, innermost last.
_POLLED: list[Optional[Callable[[], None]]] = []


@contextlib.contextmanager
def stop_polled(on_stop: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Within the block, the first stop signal only sets ``STOPPING`` (and calls ``on_stop()``, if given)
    instead of raising ``SystemExit``: for a serving loop that polls ``STOPPING`` and whose own shutdown must
    run to its end.  A ``SystemExit`` raised at an arbitrary line could land inside that shutdown (the front's
    "close" can end the engine's loop a moment before this process's own SIGTERM arrives) and skip closing the
    engine, so that a reply went on until the web server cut its connection.

    ``on_stop`` runs inside the signal handler, in the main thread, between any two bytecodes: it must take no
    lock (not even ``threading.Event.set`` of an event the main thread waits on: the handler may run while the
    main thread holds that event's own lock, and the process would hang).  It may raise ``SystemExit`` (a
    phase that should still be interrupted)."""
    _POLLED.append(on_stop)
    try:
        yield
    finally:
        _POLLED.pop()


def _polled() -> bool:
    """Inside a ``stop_polled`` block: call its ``on_stop`` (if any) and return True; False outside."""
    if not _POLLED:
        return False
    on_stop = _POLLED[-1]
    if on_stop is not None:
        on_stop()
    return True


def install_sigterm_exit() -> None:
    """SIGTERM -> ``SystemExit(0)`` in the main thread (inside a ``stop_polled`` block: only ``STOPPING``), once;
    a repeated SIGTERM is logged and ignored.

    Raises: ValueError when called outside the main thread (``signal.signal``)."""

    def on_sigterm(signum, frame) -> None:
        if not STOPPING.claim():
            log.info("SIGTERM again: already shutting down")
            return
        log.info("SIGTERM: shutting down")
        if not _polled():
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)


def install_rank0_sigterm(close_workers: Callable[[], bool]) -> None:
    """Rank 0 of several: SIGTERM calls ``close_workers()`` (``DistributedExecutor.close``: the exit message to
    every rank; True when it reached them all), then leaves with code 0 (``SystemExit``, so that app.py's
    clean-up still runs), or at once with ``FAILURE_EXIT_CODE`` when a worker was already gone.  A repeated
    SIGTERM does nothing: a second run inside the first one's ``close_workers()`` would deadlock on the
    executor's lock.  Inside a ``stop_polled`` block (serving) it only sets ``STOPPING``: the serving loop's
    shutdown closes the engine and, through it, the worker ranks.  Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, frame) -> None:
        if not STOPPING.claim():
            return
        log.info("rank 0: SIGTERM; stopping all ranks")
        if _polled():  # serving: the loop's shutdown closes the engine, and its executor the worker ranks
            return
        if not close_workers():
            die("rank 0: a worker rank was already gone at shutdown")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)


def install_worker_stop_signals(rank: int) -> None:
    """A worker rank: SIGTERM / SIGINT start one timer of ``WORKER_SIGTERM_GRACE_S`` seconds, after which the
    process leaves with 128 + the signal number unless rank 0's exit message ended it first (the launcher
    forwards the group's signal, and Ctrl-C in a terminal reaches every rank at once: rank 0 leads the
    shutdown).  Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_stop_signal(signum, frame) -> None:
        if not STOPPING.claim():  # one grace timer is enough
            return
        name = signal.Signals(signum).name
        log.info("rank %d: %s; waiting up to %.0f s for rank 0's exit message", rank, name, WORKER_SIGTERM_GRACE_S)
        timer = threading.Timer(WORKER_SIGTERM_GRACE_S, die,
                                args=(f"rank {rank}: no exit message after {name}", 128 + signum))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_stop_signal)
    signal.signal(signal.SIGINT, on_stop_signal)


def die(message: str, code: int = FAILURE_EXIT_CODE) -> None:
    """Log ``message`` (with the current exception, if any) and leave the process at once with ``code``.

    ``os._exit`` skips atexit handlers and thread joins, which could block forever on a broken collective.
    """
    if code == 0:
        log.info(message)
    elif sys.exc_info()[0] is not None:
        log.critical(message, exc_info=True)
    else:
        log.critical(message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    logging.shutdown()
    os._exit(code)


def die_unless_stopping(message: str, grace_s: float) -> None:
    """After ``grace_s`` seconds, ``die(message)`` (code 1) unless this process began its own orderly shutdown
    meanwhile (``STOPPING``).  For a peer that vanished: a SIGTERM to the whole group (Supervisor's stop) ends
    the peers at about the same time, and this process's own stop must win that race.  Blocks the calling
    thread for ``grace_s`` seconds; returns only when stopping."""
    time.sleep(grace_s)
    if not STOPPING.is_set():
        die(message)


def leave(code) -> None:
    """End the process with ``code`` (what ``sys.exit`` takes: an int, None for 0, a message for 1) once
    app.py's ``main`` has shut everything down: the atexit handlers run (the executor's exit message to the
    ranks, log flushing), the standard streams are flushed, then ``os._exit``.  That skips the interpreter's
    teardown of every module and object, which after a clean stop took 1.6 s of CPU with Gradio, transformers
    and torch loaded (measured: docs/performance.md) and made every stop and restart that much slower."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    os._exit(code)


def exit_process_soon(reason: str, delay_s: float = FATAL_EXIT_DELAY_S) -> None:
    """Log ``reason`` and end the process with exit code 1 after ``delay_s`` seconds (``os._exit``: the web
    server's threads and a possibly wedged device cannot block it), so that Supervisor restarts the service:
    an engine failure must make the process exit non-zero."""
    log.critical("engine failure, exiting with code 1 in %.1f s so that Supervisor restarts the service: %s",
                 delay_s, reason)
    timer = threading.Timer(delay_s, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
