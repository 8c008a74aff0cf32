"""Crash-safe file primitives: atomic replace, exclusive locks, setting bad files aside.

``write_atomic`` is the one way the service writes a file it keeps (history, users file, API images, the
UI's image copies).  Why: a plain ``open(path, "w").write(...)`` killed half-way leaves an empty or cut-off
file.  ``write_atomic`` writes a temp file in the same folder, fsyncs it, renames it over the target with
``os.replace`` (atomic on POSIX) and fsyncs the folder, so after ``kill -9`` or a power cut the target is
either the old or the new version.  ``exclusive_lock`` serialises read-modify-write cycles between threads
(``threading.Lock``) and processes (``fcntl.flock`` on a lock file).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"


def fsync_dir(folder: Path) -> None:
    """fsync a directory so that a rename inside it survives a power cut (POSIX; no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file in the same folder, flush, fsync, ``os.replace``,
    fsync of the folder.  The temp file is named ``.<name>.<random>.tmp`` and removed on failure.  The file
    gets mode 0600 (``tempfile.mkstemp``'s), whatever ``path`` had before.

    Raises:
        OSError: when writing or renaming fails; ``path`` is then unchanged.
    """
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)


class LockTable:
    """One ``threading.Lock`` per lock-file path, so threads of one process queue before ``flock``."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def get(self, path: Path) -> threading.Lock:
        """The thread lock of ``path`` (made on first use, kept for the life of the table)."""
        key = str(path)
        with self._guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
            return lock


@contextlib.contextmanager
def exclusive_lock(path: Path, table: LockTable) -> Iterator[None]:
    """Hold the thread lock for ``path`` and an exclusive ``flock`` on ``path`` (created if missing).

    Lock files are never deleted: removing one while another process waits on it would let two writers
    hold "the" lock at once.
    """
    with table.get(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def set_aside(path: Path, corrupt_dir: Path, reason: str) -> Path | None:
    """Move an unreadable file into ``corrupt_dir`` (as ``<name>.<UTC time>.bad``) and log a warning.

    Returns the new path, or None when the file was already gone.  Never raises for a vanished file.
    """
    corrupt_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    target = corrupt_dir / f"{path.name}.{stamp}.bad"
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None
    fsync_dir(path.parent)
    log.warning("history file %s is unreadable (%s); moved aside to %s", path, reason, target)
    return target
