"""One user's conversation files: bytes <-> ``Conversation``, locked crash-safe read-modify-write, bad files set aside.

``ConversationFolder`` owns ``users/<user_id>/conversations/`` (one ``<conversation id>.json`` each) with its
lock files and its ``corrupt/`` folder; ``store.UserHistory`` builds every operation on it.

A reply is saved with status ``streaming`` while it is written, together with the id of the writing process
(``writer_id``).  When a file is read, a ``streaming`` message of another writer (a process that is gone,
e.g. after ``kill -9`` or a restart) reads back as ``interrupted``; the next write stores it that way.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from qwen_chat.chat_types import InvalidInput
from qwen_chat.history.errors import ConversationNotFound, unavailable
from qwen_chat.history.files import TEMP_SUFFIX, LockTable, exclusive_lock, set_aside, write_atomic
from qwen_chat.history.records import CONVERSATION_ID, INTERRUPTED, SCHEMA_VERSION, STREAMING, Conversation, now_iso

log = logging.getLogger(__name__)

#: Temp files older than this are leftovers of a crash between write and rename; ``list()`` removes them.
STALE_TEMP_S = 3600.0

# Identifies this process in messages saved as "streaming": a streaming message written by another (dead)
# process reads back as "interrupted".  The pid part changes in a forked child.
_BOOT = secrets.token_hex(6)


def writer_id() -> str:
    """``"<pid>-<random per import>"``: the id stored with the ``streaming`` messages this process writes."""
    return f"{os.getpid()}-{_BOOT}"


class NewerSchema(Exception):
    """A file written by a newer schema: left in place, not treated as corrupt."""


def parse(raw: bytes) -> Conversation:
    """bytes -> Conversation; a ``streaming`` message of another (dead) process becomes ``interrupted``.

    Raises:
        ValueError / InvalidInput: malformed content (not UTF-8, not JSON, not the schema).
        NewerSchema: ``schema_version`` above ``SCHEMA_VERSION``.
    """
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8: {e}") from None
    if isinstance(data, dict):
        version = data.get("schema_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            raise NewerSchema(f"schema_version {version} is newer than {SCHEMA_VERSION}")
        me = writer_id()
        for message in _message_dicts(data):
            if message.get("status") == STREAMING and message.get("writer") != me:
                message["status"] = INTERRUPTED
    return Conversation.from_dict(data)


def _message_dicts(data: dict) -> list[dict]:
    """The message objects of a conversation's JSON: the visible path's and the kept versions' (``branches``)."""
    messages = data.get("messages")
    found = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    kept = data.get("branches")
    if isinstance(kept, list):
        found += [h["message"] for h in kept if isinstance(h, dict) and isinstance(h.get("message"), dict)]
    return found


def encode(conv: Conversation) -> bytes:
    """The file's bytes: ``conv.to_dict()`` as UTF-8 JSON, each ``streaming`` message tagged with ``writer_id``."""
    data = conv.to_dict()
    writer = writer_id()
    for message in _message_dicts(data):
        if message["status"] == STREAMING:
            message["writer"] = writer
    return encode_json(data)


def encode_json(data: dict) -> bytes:
    """``data`` as indented UTF-8 JSON (no ``\\u`` escapes), the form every history file is saved in."""
    return json.dumps(data, ensure_ascii=False, indent=1).encode("utf-8")


def json_settings(settings: Any) -> dict:
    """A copy of ``settings`` holding plain JSON values only.

    Raises:
        InvalidInput: not a dict, or a value JSON cannot hold (NaN, objects...).
    """
    if not isinstance(settings, dict):
        raise InvalidInput("settings must be a dict")
    try:
        return json.loads(json.dumps(settings, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"settings must be plain JSON values: {e}") from None


class Unchanged:
    """Returned by a ``ConversationFolder.mutate`` change function that decided not to change anything;
    ``value`` is what ``mutate`` returns as the result."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ConversationFolder:
    """The conversation files of one user: ``folder/<id>.json``, locks in ``lock_dir``, bad files to ``corrupt_dir``.

    Every id is checked (32 hex digits) before a path is built from it.  Errors: ``ConversationNotFound``
    (unknown, malformed or unreadable id), ``InvalidInput`` (a file of a newer schema), ``HistoryUnavailable``
    (the disk failed; the saved file is then unchanged).
    """

    def __init__(self, folder: Path, lock_dir: Path, corrupt_dir: Path, locks: LockTable) -> None:
        self.folder = folder
        self._lock_dir = lock_dir
        self._corrupt_dir = corrupt_dir
        self._locks = locks

    def path(self, conv_id: Any) -> Path:
        """``folder/<conv_id>.json``.  Raises ``ConversationNotFound`` for anything but 32 hex digits."""
        if not isinstance(conv_id, str) or not CONVERSATION_ID.fullmatch(conv_id):
            raise ConversationNotFound()
        return self.folder / f"{conv_id}.json"

    @contextlib.contextmanager
    def locked(self, conv_id: str, action: str = "save the conversation") -> Iterator[None]:
        """The conversation's exclusive lock (thread lock + ``flock`` on ``lock_dir/<id>.lock``).  Raises
        ``HistoryUnavailable`` ("Could not <action>: ...", no path) when the lock file cannot be opened."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(exclusive_lock(self._lock_dir / f"{conv_id}.lock", self._locks))
            except OSError as e:
                log.warning("conversation %s: cannot take its lock: %s", conv_id, e)
                raise unavailable(action, e) from None
            yield

    def ids(self) -> list[str]:
        """Ids of the conversation files present now (any order; files with other names are ignored)."""
        return [p.stem for p in self.folder.glob("*.json") if CONVERSATION_ID.fullmatch(p.stem)]

    def read(self, conv_id: str, *, locked: bool = False) -> Conversation:
        """Read and parse; an unreadable file is set aside (under the lock) and reported as not found.

        ``locked``: the caller already holds the conversation's lock.  Raises ``OSError`` for a disk error.
        """
        path = self.path(conv_id)
        try:
            return parse(path.read_bytes())
        except FileNotFoundError:
            raise ConversationNotFound() from None
        except NewerSchema as e:
            log.warning("history file %s: %s; left in place", path, e)
            raise InvalidInput("this conversation was saved by a newer version of the service") from None
        except (ValueError, InvalidInput) as e:
            reason = str(e) or type(e).__name__
        if locked:
            set_aside(path, self._corrupt_dir, reason)
            raise ConversationNotFound()
        with self.locked(conv_id):
            # Re-check under the lock: a writer may have replaced the file since we read it.
            return self.read(conv_id, locked=True)

    def mutate(self, conv_id: str, change: Callable[[Conversation], Any],
               touch: bool = True) -> tuple[Conversation, Any]:
        """Read-modify-write under the conversation's lock; ``change`` edits the conversation in place.

        Returns ``(saved conversation, what change returned)``; a change returning ``Unchanged`` writes
        nothing.  Each write increments ``revision`` and, with ``touch`` (not for a pin or tags), sets
        ``updated``.
        """
        self.path(conv_id)
        with self.locked(conv_id):
            try:
                conv = self.read(conv_id, locked=True)
            except OSError as e:
                raise unavailable("read the conversation", e, writing=False) from None
            result = change(conv)
            if isinstance(result, Unchanged):
                return conv, result.value  # nothing changed (e.g. a retried append): nothing to write
            conv.revision += 1
            if touch:
                conv.updated = max(now_iso(), conv.updated)
            self.write(conv)
        return conv, result

    def write(self, conv: Conversation) -> None:
        """Save ``conv`` atomically (the caller holds its lock).  Raises ``HistoryUnavailable``."""
        try:
            write_atomic(self.folder / f"{conv.id}.json", encode(conv))
        except OSError as e:
            log.warning("conversation %s: cannot save it: %s", conv.id, e)
            raise unavailable("save the conversation", e) from None

    def used_image_names(self) -> Optional[set[str]]:
        """Image names referenced by any conversation file; None when some file cannot be read (it might
        reference any image)."""
        used: set[str] = set()
        for path in self.folder.glob("*.json"):
            try:
                conv = parse(path.read_bytes())
            except Exception:  # noqa: BLE001 - an unreadable file might reference images: keep them all
                return None
            used.update(n for m in conv.every_message() for n in m.images)
        return used

    def remove_stale_temp_files(self) -> None:
        """Delete temp files of writes older than ``STALE_TEMP_S`` (left by a writer killed mid-write)."""
        cutoff = time.time() - STALE_TEMP_S
        for path in self.folder.glob(f".*{TEMP_SUFFIX}"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
            except OSError:
                continue
