"""The one polling wait of the tests: ``wait_until(predicate, timeout_s, what)``.

Liveness waits with a generous deadline, never speed assertions: a condition that holds returns at once, one
that never comes fails with a message naming what was awaited.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

T = TypeVar("T")
FIRST_POLL_S = 0.01


def log_tail(log: Optional[Path], lines: int = 60) -> str:
    """The last ``lines`` lines of the text file ``log`` ("" when it is None or missing)."""
    if log is None or not Path(log).exists():
        return ""
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])


def wait_until(predicate: Callable[[], T], timeout_s: float = 60.0, what: str = "the condition",
               poll_s: float = 0.25, process: Optional[subprocess.Popen] = None,
               log: Optional[Path] = None) -> T:
    """Call ``predicate()`` until it returns something truthy; return that value.

    Polls after 10 ms, then twice as long each time up to ``poll_s`` seconds between calls.  ``process``: stop
    waiting when it exits first.  ``log``: a file whose last 60 lines are added to the error message.

    Raises:
        TimeoutError: nothing truthy within ``timeout_s`` seconds (the message names ``what``).
        RuntimeError: ``process`` exited before the predicate held (with its exit status).
    """
    deadline = time.monotonic() + timeout_s
    pause = min(FIRST_POLL_S, poll_s)
    while True:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited ({process.returncode}) before {what}{_tail_note(log)}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}{_tail_note(log)}")
        time.sleep(pause)
        pause = min(2 * pause, poll_s)


def _tail_note(log: Optional[Path]) -> str:
    tail = log_tail(log)
    return f":\n{tail}" if tail else ""
