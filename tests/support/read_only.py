"""``ReadOnlyFolder``: a folder made unwritable for this process, as ``chmod -R a-w`` does for a normal user.

The tests run as root, for whom ``chmod`` blocks nothing, so the file-system calls that write are refused in
Python instead: while ``on`` is set, ``os.open`` with a writing or creating flag, ``os.replace``, ``os.rename``,
``os.unlink`` and ``os.mkdir`` of a missing folder (an existing one is ``FileExistsError``, as the kernel checks
that first) on a path under the folder raise ``PermissionError`` (errno 13, with the path, as the kernel's
refusal reads).  Reading stays possible, and so does ``os.utime`` (an owner may set the times of a read-only
file).  Install it with ``monkeypatch``
(undone at the test's end)::

    folder = ReadOnlyFolder(tmp_path, monkeypatch)
    folder.on = True    # writes under tmp_path now fail
    folder.on = False   # writable again
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class ReadOnlyFolder:
    """Refuses writes under ``root`` while ``on`` (see the module docstring); ``refused`` counts the refusals."""

    def __init__(self, root: Path, monkeypatch) -> None:
        self.root = os.path.realpath(root)
        self.on = False
        self.refused = 0
        real_open = os.open

        def guarded_open(path, flags, *args, **kwargs):
            if flags & WRITING:
                self._check(path, kwargs.get("dir_fd"))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", guarded_open)
        for name in ("replace", "rename", "unlink", "mkdir"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._guard(real, name == "mkdir"))

    def _guard(self, real, mkdir: bool):
        def guarded(path, *args, **kwargs):
            if not (mkdir and os.path.exists(path)):
                self._check(path, None)
            return real(path, *args, **kwargs)
        return guarded

    def _check(self, path, dir_fd) -> None:
        if not self.on or dir_fd is not None or isinstance(path, int):
            return
        full = os.path.realpath(os.fsdecode(path))
        if full == self.root or full.startswith(self.root + os.sep):
            self.refused += 1
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
