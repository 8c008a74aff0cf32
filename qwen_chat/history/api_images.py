"""The API's image store: images of OpenAI-style requests, normalised and kept as files, apart from any user's
conversations.

API clients resend every image on every turn and their conversations are not stored, so API images go to
``<history_dir>/api_images/`` (``ApiImageStore``), named by the SHA-256 of the uploaded bytes: the same upload
is normalised once.  Files unused for ``IMAGE_MAX_AGE_S`` seconds (a day) are deleted.  No torch.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from pathlib import Path

from qwen_chat.history.errors import unavailable
from qwen_chat.history.files import TEMP_SUFFIX, write_atomic
from qwen_chat.images import ImageLimits, normalize_image

log = logging.getLogger(__name__)

IMAGE_MAX_AGE_S = 24 * 3600.0  # API image files unused this long are deleted
IMAGE_PRUNE_EVERY_S = 600.0  # seconds between two prunes of the folder


class ApiImageStore:
    """Normalises API images and keeps them as PNG files named by the SHA-256 of the uploaded bytes.

    ``directory``: folder for the files (created on demand).  ``limits``: ``qwen_chat.images.ImageLimits``.
    The same upload sent again (clients resend every image on every turn) reuses the file without decoding.
    """

    def __init__(self, directory: Path, limits: ImageLimits, max_age_s: float = IMAGE_MAX_AGE_S):
        self.directory = Path(directory)
        self.limits = limits
        self.max_age_s = max_age_s
        self._last_prune = 0.0
        self._lock = threading.Lock()
        # Normalised output depends on the limits: keep caches of different limits apart.
        self._suffix = hashlib.sha256(repr(limits).encode()).hexdigest()[:8]

    def put(self, data: bytes) -> str:
        """Return the path (str) of the normalised PNG of ``data``.

        Raises:
            InvalidImage: from ``normalize_image`` (not an image, unsupported format, too big...).
            HistoryUnavailable: the file could not be written ("Could not store the image: ...", no path).
        """
        name = f"{hashlib.sha256(data).hexdigest()}-{self._suffix}.png"
        path = self.directory / name
        if path.exists():
            try:
                os.utime(path)
                return str(path)
            except FileNotFoundError:  # pruned in between: normalise again
                pass
        png = normalize_image(data, self.limits).png
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(path, png)
        except OSError as e:
            log.warning("API image %s: cannot store it: %s", path, e)
            raise unavailable("store the image", e) from None
        self._maybe_prune()
        return str(path)

    def _maybe_prune(self) -> None:
        """At most every ``IMAGE_PRUNE_EVERY_S`` seconds, delete files unused for ``max_age_s`` seconds."""
        now = time.time()
        with self._lock:
            if now - self._last_prune < IMAGE_PRUNE_EVERY_S:
                return
            self._last_prune = now
        # Temp files of a write killed half-way are pruned by the same age rule.
        for entry in itertools.chain(self.directory.glob("*.png"), self.directory.glob(f".*{TEMP_SUFFIX}")):
            try:
                if now - entry.stat().st_mtime > self.max_age_s:
                    entry.unlink()
            except FileNotFoundError:
                pass
