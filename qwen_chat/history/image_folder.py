"""One user's image folder: normalised PNGs stored once, named by the SHA-256 of their bytes.

``users/<user_id>/images/<sha256 hex>.png``; conversations refer to images by that name, so an image sent in
several messages (or conversations) of one user is stored once.  Unused images are removed when a
conversation is deleted (``remove_unused``), except ones stored in the last ``IMAGE_GC_GRACE_S`` seconds.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Callable, Optional

from qwen_chat.chat_types import InvalidImage, InvalidInput
from qwen_chat.history.files import LockTable, exclusive_lock, write_atomic
from qwen_chat.history.records import IMAGE_NAME

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Unreferenced images younger than this are kept when a conversation is deleted: they may have been put
#: a moment ago for a message that is about to be appended.
IMAGE_GC_GRACE_S = 600.0


class ImageFolder:
    """The images of one user in ``folder``; ``lock_path`` is the flock file serialising puts and clean-ups.

    Errors: ``InvalidImage`` (not PNG data), ``InvalidInput`` (bad or unknown name); ``OSError`` from the disk
    is left to the caller (the store turns it into ``HistoryUnavailable``).
    """

    def __init__(self, folder: Path, lock_path: Path, locks: LockTable) -> None:
        self.folder = folder
        self._lock_path = lock_path
        self._locks = locks

    def put(self, png_bytes: bytes) -> str:
        """Store a normalised PNG once; return its name ``<sha256 hex of the bytes>.png``.

        Raises:
            InvalidImage: ``png_bytes`` is not PNG data (normalise uploads with ``qwen_chat.images`` first).
            OSError: the file could not be written.
        """
        if not isinstance(png_bytes, (bytes, bytearray)) or not bytes(png_bytes[:8]) == PNG_SIGNATURE:
            raise InvalidImage("only normalised PNG images can be stored")
        data = bytes(png_bytes)
        name = hashlib.sha256(data).hexdigest() + ".png"
        path = self.folder / name
        with exclusive_lock(self._lock_path, self._locks):
            if path.is_file():
                os.utime(path)  # fresh mtime: protects it from a concurrent delete's image cleanup
            else:
                write_atomic(path, data)
        return name

    def path(self, name: str) -> Path:
        """Path of a stored image.

        Raises:
            InvalidInput: malformed name (not ``<64 hex>.png``) or no such image in this folder.
        """
        if not isinstance(name, str) or not IMAGE_NAME.fullmatch(name):
            raise InvalidInput("bad image reference")
        path = self.folder / name
        if not path.is_file():
            raise InvalidInput("image not found")
        return path

    def has(self, name: str) -> bool:
        """True when ``name`` is a file of this folder (the name itself is not checked)."""
        return (self.folder / name).is_file()

    def remove_unused(self, used_names: Callable[[], Optional[set[str]]]) -> None:
        """Delete the images that ``used_names()`` does not list and that are older than ``IMAGE_GC_GRACE_S``.

        ``used_names`` runs under the folder's lock; when it returns None (some conversation could not be read
        and might use any image) nothing is deleted.  Files that vanish or cannot be removed are skipped.
        """
        with exclusive_lock(self._lock_path, self._locks):
            used = used_names()
            if used is None:
                return
            cutoff = time.time() - IMAGE_GC_GRACE_S
            for path in self.folder.glob("*.png"):
                try:
                    if path.name not in used and path.stat().st_mtime < cutoff:
                        path.unlink()
                except OSError:
                    continue
