"""Conversation store: one JSON file per conversation, images stored once by content hash, per-user folders.

Layout under the history folder (``--history-dir``)::

    users/<user_id>/conversations/<conversation id>.json   one conversation (see records.py)
    users/<user_id>/images/<sha256 of the PNG>.png          each image once
    users/<user_id>/corrupt/<file>.<UTC time>.bad           unreadable files, set aside (C21)
    users/<user_id>/locks/<conversation id>.lock            flock files (never deleted)

Guarantees (public cases C21, C22; issue 5 items 3-4):

* every mutation is a read-modify-write of the file *as it is on disk now*, under an exclusive lock (a thread
  lock plus ``fcntl.flock``), written atomically (``files.write_atomic``), with ``revision`` + 1.  A stale
  browser page that appends a message therefore merges with newer history instead of overwriting it, and
  concurrent writers (threads or processes) never lose an update;
* a reply saved as ``streaming`` by a process that is gone (``kill -9`` mid-reply) reads back as
  ``interrupted`` and is stored that way on the next write;
* corrupt, empty or half-written files are moved to ``corrupt/`` with a logged warning; the others still list;
* ids are checked on every access (user ids ``[A-Za-z0-9_.-]{1,64}``, conversation ids 32 hex digits, image
  names ``<64 hex>.png``), and each ``UserHistory`` only ever touches its own folder: another user's id, a
  guessed id and a path such as ``../x`` all raise ``ConversationNotFound`` with the same message.

No torch, no Gradio.  Usage::

    store = HistoryStore(Path("history"))
    history = store.user("local")
    conv = history.create()
    ref = history.append_message(conv.id, role="user", text="What is in this photo?",
                                 images=[history.put_image(png_bytes)])
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import secrets
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from qwen_chat.chat_types import ChatError, ChatMessage, InvalidImage, InvalidInput
from qwen_chat.history.files import TEMP_SUFFIX, LockTable, exclusive_lock, set_aside, write_atomic
from qwen_chat.history.records import (
    CONVERSATION_ID,
    DEFAULT_TITLE,
    IMAGE_NAME,
    SCHEMA_VERSION,
    STATUSES,
    Conversation,
    ConversationSummary,
    StoredMessage,
    clean_title,
    make_title,
    new_conversation_id,
    now_iso,
)

__all__ = [
    "HistoryStore", "UserHistory", "MessageRef", "StoredMessage", "Conversation", "ConversationSummary",
    "ConversationNotFound", "MessageNotFound", "StaleConversation", "HistoryUnavailable", "DEFAULT_TITLE",
    "LOCAL_USER",
]

log = logging.getLogger(__name__)

#: The user id used when login is off.
LOCAL_USER = "local"
USER_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Unreferenced images younger than this are kept when a conversation is deleted: they may have been put
#: a moment ago for a message that is about to be appended.
IMAGE_GC_GRACE_S = 600.0
#: Temp files older than this are leftovers of a crash between write and rename; ``list()`` removes them.
STALE_TEMP_S = 3600.0

# Identifies this process in messages saved as "streaming": a streaming message written by another (dead)
# process reads back as "interrupted".  The pid part changes in a forked child.
_BOOT = secrets.token_hex(6)


def _writer_id() -> str:
    return f"{os.getpid()}-{_BOOT}"


class ConversationNotFound(InvalidInput):
    """No such conversation *for this user* (also for foreign, guessed or malformed ids; never says which)."""

    kind = "conversation_not_found"
    http_status = 404

    def __init__(self, message: str = "conversation not found"):
        super().__init__(message)


class MessageNotFound(InvalidInput):
    """The message id/index does not exist (any more) in the conversation."""

    kind = "message_not_found"
    http_status = 404


class StaleConversation(ChatError):
    """The conversation changed since the caller read it (``expected_revision`` did not match): reload."""

    kind = "stale_conversation"
    http_status = 409


class HistoryUnavailable(ChatError):
    """The history folder could not be read or written (disk full, permissions); nothing was changed."""

    kind = "history_unavailable"
    http_status = 500


class MessageRef(int):
    """What ``append_message`` returns: the message's index in the conversation as saved, as an ``int``,
    carrying the message's stable id in ``message_id``.

    Passing it back to ``update_message``/``truncate_from`` finds the message by id, so the right message is
    updated even if another tab changed the conversation in between; a plain ``int`` is used as an index.
    """

    message_id: str

    def __new__(cls, index: int, message_id: str) -> "MessageRef":
        ref = super().__new__(cls, index)
        ref.message_id = message_id
        return ref


MessageKey = Union[MessageRef, int, str]


class HistoryStore:
    """All users' histories under ``root`` (created if missing).  Thread- and process-safe."""

    def __init__(self, root: Union[Path, str]) -> None:
        self.root = Path(root)
        self._locks = LockTable()

    def user(self, user_id: str) -> "UserHistory":
        """The history of one user (folder ``root/users/<user_id>/``, created on first use).

        Raises:
            InvalidInput: ``user_id`` is not 1-64 characters of ``[A-Za-z0-9_.-]`` or is only dots.
        """
        if not isinstance(user_id, str) or not USER_ID.fullmatch(user_id) or not user_id.strip("."):
            raise InvalidInput("bad user id: use 1-64 letters, digits, '_', '.', '-'")
        return UserHistory(self.root / "users" / user_id, user_id, self._locks)


class UserHistory:
    """One user's conversations and images.  Every method validates the ids it is given.

    Errors: ``ConversationNotFound`` / ``MessageNotFound`` / ``InvalidInput`` / ``InvalidImage`` for bad
    requests, ``HistoryUnavailable`` when the disk fails (the saved file is then unchanged).
    """

    def __init__(self, folder: Path, user_id: str, locks: LockTable) -> None:
        self.user_id = user_id
        self.folder = folder
        self._conv_dir = folder / "conversations"
        self._image_dir = folder / "images"
        self._lock_dir = folder / "locks"
        self._corrupt_dir = folder / "corrupt"
        self._locks = locks
        try:
            for d in (self._conv_dir, self._image_dir, self._lock_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HistoryUnavailable(f"cannot create the history folder: {e.strerror or e}") from None

    # ------------------------------------------------------------------ reading
    def list(self) -> list[ConversationSummary]:
        """Summaries of every readable conversation, most recently updated first.

        Unreadable files are set aside into ``corrupt/`` with a warning; never raises for them.
        """
        self._remove_stale_temp_files()
        summaries = []
        for path in self._conv_dir.glob("*.json"):
            if not CONVERSATION_ID.fullmatch(path.stem):
                continue
            try:
                conv = self._read_checked(path.stem)
            except (ConversationNotFound, InvalidInput):
                continue
            except OSError as e:
                log.warning("cannot read history file %s: %s", path, e)
                continue
            summaries.append(ConversationSummary(conv.id, conv.title, conv.created, conv.updated,
                                                 len(conv.messages)))
        summaries.sort(key=lambda s: (s.updated, s.id), reverse=True)
        return summaries

    def load(self, conv_id: str) -> "Conversation":
        """The conversation as saved now (``streaming`` replies of a dead process read as ``interrupted``).

        Raises:
            ConversationNotFound: unknown, foreign, malformed or unreadable (then set aside) id.
        """
        path = self._conv_path(conv_id)
        try:
            return self._read_checked(path.stem)
        except OSError as e:
            raise HistoryUnavailable(f"cannot read the conversation: {e.strerror or e}") from None

    def chat_messages(self, conv: Conversation) -> list[ChatMessage]:
        """``conv``'s messages as ``chat_types.ChatMessage`` (image names resolved to file paths)."""
        return [ChatMessage(role=m.role, text=m.text, reasoning=m.reasoning,
                            images=tuple(str(self.image_path(n)) for n in m.images)) for m in conv.messages]

    # ------------------------------------------------------------------ writing
    def create(self, title: str = DEFAULT_TITLE, settings: Optional[dict] = None) -> Conversation:
        """Save a new empty conversation with a random id and return it (revision 1).

        Raises:
            InvalidInput: bad title or settings that are not plain JSON.
        """
        title = DEFAULT_TITLE if not isinstance(title, str) or not title.strip() else clean_title(title)
        conv = Conversation(id=new_conversation_id(), title=title, revision=1,
                            settings=_json_settings(settings or {}))
        with self._locked(conv.id):
            self._write(conv)
        return conv

    def append_message(self, conv_id: str, message: Optional[StoredMessage] = None, *,
                       role: Optional[str] = None, text: str = "", reasoning: str = "",
                       images: Iterable[str] = (), status: str = "complete", notice: str = "") -> MessageRef:
        """Append a message to the conversation as it is on disk now (merge, never overwrite).

        Pass a ``StoredMessage`` or the fields (``role`` required; a random id is made).  The first user
        message sets the title if it is still the default.  Appending a message whose id is already saved
        with the same content is a no-op (safe retry).

        Returns:
            ``MessageRef``: the message's index (an ``int``) with its id in ``.message_id``.
        Raises:
            ConversationNotFound; InvalidInput for bad fields, an image that was not ``put_image``d for this
            user, or a different message reusing a saved id.
        """
        if message is None:
            if role is None:
                raise InvalidInput("append_message needs a message or a role")
            message = StoredMessage.new(role, text, reasoning=reasoning, images=list(images), status=status,
                                        notice=notice)
        elif role is not None:
            raise InvalidInput("pass either a StoredMessage or message fields, not both")
        if not isinstance(message, StoredMessage):
            raise InvalidInput("message must be a StoredMessage")
        for name in message.images:
            if not (self._image_dir / name).is_file():
                raise InvalidInput(f"image {name} is not stored for this user")

        def change(conv: Conversation) -> Any:
            existing = conv.index_of(message.id)
            if existing is not None:
                if conv.messages[existing].to_dict() == message.to_dict():
                    return _Unchanged(MessageRef(existing, message.id))
                raise InvalidInput("a different message with this id is already saved")
            if (message.role == "user" and conv.title == DEFAULT_TITLE
                    and not any(m.role == "user" for m in conv.messages)):
                conv.title = make_title(message.text, len(message.images))
            conv.messages.append(message)
            return MessageRef(len(conv.messages) - 1, message.id)

        return self._mutate(conv_id, change)[1]

    def update_message(self, conv_id: str, message: MessageKey, *, text: Optional[str] = None,
                       reasoning: Optional[str] = None, status: Optional[str] = None,
                       notice: Optional[str] = None) -> Conversation:
        """Change fields of one saved message (None: leave as is); returns the saved conversation.

        ``message`` is a ``MessageRef`` (found by id), a message id (str) or an index (int).

        Raises:
            ConversationNotFound, MessageNotFound, InvalidInput (bad status or non-text value).
        """
        if status is not None and status not in STATUSES:
            raise InvalidInput(f"status must be one of {', '.join(STATUSES)}, got {status!r}")

        def change(conv: Conversation) -> None:
            index = _resolve(conv, message)
            fields = conv.messages[index].to_dict()
            for key, value in (("text", text), ("reasoning", reasoning), ("status", status),
                               ("notice", notice)):
                if value is not None:
                    fields[key] = value
            conv.messages[index] = StoredMessage(**fields)

        return self._mutate(conv_id, change)[0]

    def truncate_from(self, conv_id: str, message: MessageKey, *,
                      expected_revision: Optional[int] = None) -> Conversation:
        """Drop ``message`` and every later message (for Regenerate); returns the saved conversation.

        ``expected_revision``: if given and the saved revision differs, nothing changes and
        ``StaleConversation`` is raised (so a stale page cannot cut off turns it never saw).

        Raises:
            ConversationNotFound, MessageNotFound, StaleConversation.
        """

        def change(conv: Conversation) -> None:
            if expected_revision is not None and conv.revision != expected_revision:
                raise StaleConversation("this conversation changed in another window; reload it")
            del conv.messages[_resolve(conv, message):]

        return self._mutate(conv_id, change)[0]

    def set_settings(self, conv_id: str, settings: dict) -> Conversation:
        """Replace the stored generation settings (a JSON-serialisable dict).

        Raises:
            ConversationNotFound; InvalidInput when ``settings`` is not a dict of plain JSON values.
        """
        settings = _json_settings(settings)

        def change(conv: Conversation) -> None:
            conv.settings = settings

        return self._mutate(conv_id, change)[0]

    def rename(self, conv_id: str, title: str) -> Conversation:
        """Set the title (whitespace collapsed, 1-200 characters).

        Raises:
            ConversationNotFound; InvalidInput for a blank or too long title.
        """
        title = clean_title(title)

        def change(conv: Conversation) -> None:
            conv.title = title

        return self._mutate(conv_id, change)[0]

    def delete(self, conv_id: str) -> None:
        """Delete the conversation's file, then images no other conversation of this user uses
        (except ones stored in the last ``IMAGE_GC_GRACE_S`` seconds).

        Raises:
            ConversationNotFound.
        """
        path = self._conv_path(conv_id)
        with self._locked(conv_id):
            try:
                path.unlink()
            except FileNotFoundError:
                raise ConversationNotFound() from None
            except OSError as e:
                raise HistoryUnavailable(f"cannot delete the conversation: {e.strerror or e}") from None
        self._collect_images()

    def export_zip(self, conv_id: str) -> bytes:
        """A zip (bytes) with ``conversation.json`` (the saved JSON) and ``images/<name>.png`` for its images.

        Raises:
            ConversationNotFound.
        """
        conv = self.load(conv_id)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("conversation.json", _encode(conv.to_dict()))
            names = sorted({n for m in conv.messages for n in m.images})
            for name in names:
                try:
                    data = (self._image_dir / name).read_bytes()
                except FileNotFoundError:
                    log.warning("image %s of conversation %s is missing from %s", name, conv.id, self._image_dir)
                    continue
                zf.writestr(f"images/{name}", data, compress_type=zipfile.ZIP_STORED)
        return buffer.getvalue()

    # ------------------------------------------------------------------ images
    def put_image(self, png_bytes: bytes) -> str:
        """Store a normalised PNG once; return its name ``<sha256 hex of the bytes>.png``.

        Raises:
            InvalidImage: ``png_bytes`` is not PNG data (normalise uploads with ``qwen_chat.images`` first).
        """
        if not isinstance(png_bytes, (bytes, bytearray)) or not bytes(png_bytes[:8]) == PNG_SIGNATURE:
            raise InvalidImage("only normalised PNG images can be stored")
        data = bytes(png_bytes)
        name = hashlib.sha256(data).hexdigest() + ".png"
        path = self._image_dir / name
        with self._locked_images():
            try:
                if path.is_file():
                    os.utime(path)  # fresh mtime: protects it from a concurrent delete's image cleanup
                else:
                    write_atomic(path, data)
            except OSError as e:
                raise HistoryUnavailable(f"cannot store the image: {e.strerror or e}") from None
        return name

    def image_path(self, name: str) -> Path:
        """Path of a stored image of this user.

        Raises:
            InvalidInput: malformed name (not ``<64 hex>.png``) or no such image for this user.
        """
        if not isinstance(name, str) or not IMAGE_NAME.fullmatch(name):
            raise InvalidInput("bad image reference")
        path = self._image_dir / name
        if not path.is_file():
            raise InvalidInput("image not found")
        return path

    # ------------------------------------------------------------------ internals
    def _conv_path(self, conv_id: Any) -> Path:
        if not isinstance(conv_id, str) or not CONVERSATION_ID.fullmatch(conv_id):
            raise ConversationNotFound()
        return self._conv_dir / f"{conv_id}.json"

    def _locked(self, conv_id: str):
        return exclusive_lock(self._lock_dir / f"{conv_id}.lock", self._locks)

    def _locked_images(self):
        return exclusive_lock(self._lock_dir / "images.lock", self._locks)

    def _read_checked(self, conv_id: str, *, locked: bool = False) -> Conversation:
        """Read and parse; an unreadable file is set aside (under the lock) and reported as not found."""
        path = self._conv_path(conv_id)
        try:
            return _parse(path.read_bytes())
        except FileNotFoundError:
            raise ConversationNotFound() from None
        except _NewerSchema as e:
            log.warning("history file %s: %s; left in place", path, e)
            raise InvalidInput("this conversation was saved by a newer version of the service") from None
        except (ValueError, InvalidInput) as e:
            reason = str(e) or type(e).__name__
        if locked:
            set_aside(path, self._corrupt_dir, reason)
            raise ConversationNotFound()
        with self._locked(conv_id):
            # Re-check under the lock: a writer may have replaced the file since we read it.
            return self._read_checked(conv_id, locked=True)

    def _mutate(self, conv_id: str, change: Callable[[Conversation], Any]) -> tuple[Conversation, Any]:
        """Read-modify-write under the conversation's lock; ``change`` edits the conversation in place."""
        self._conv_path(conv_id)
        with self._locked(conv_id):
            try:
                conv = self._read_checked(conv_id, locked=True)
            except OSError as e:
                raise HistoryUnavailable(f"cannot read the conversation: {e.strerror or e}") from None
            result = change(conv)
            if isinstance(result, _Unchanged):
                return conv, result.value  # nothing changed (e.g. a retried append): nothing to write
            conv.revision += 1
            conv.updated = max(now_iso(), conv.updated)
            self._write(conv)
        return conv, result

    def _write(self, conv: Conversation) -> None:
        data = conv.to_dict()
        writer = _writer_id()
        for message in data["messages"]:
            if message["status"] == "streaming":
                message["writer"] = writer
        try:
            write_atomic(self._conv_dir / f"{conv.id}.json", _encode(data))
        except OSError as e:
            raise HistoryUnavailable(f"cannot save the conversation: {e.strerror or e}") from None

    def _collect_images(self) -> None:
        with self._locked_images():
            used: set[str] = set()
            for path in self._conv_dir.glob("*.json"):
                try:
                    conv = _parse(path.read_bytes())
                except Exception:  # noqa: BLE001 - an unreadable file might reference images: keep them all
                    return
                used.update(n for m in conv.messages for n in m.images)
            cutoff = time.time() - IMAGE_GC_GRACE_S
            for path in self._image_dir.glob("*.png"):
                try:
                    if path.name not in used and path.stat().st_mtime < cutoff:
                        path.unlink()
                except OSError:
                    continue

    def _remove_stale_temp_files(self) -> None:
        cutoff = time.time() - STALE_TEMP_S
        for path in self._conv_dir.glob(f".*{TEMP_SUFFIX}"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
            except OSError:
                continue


class _NewerSchema(Exception):
    """A file written by a newer schema: left in place, not treated as corrupt."""


class _Unchanged:
    """Returned by a ``_mutate`` change function that decided not to change anything."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _parse(raw: bytes) -> Conversation:
    """bytes -> Conversation; a ``streaming`` message of another (dead) process becomes ``interrupted``.

    Raises ``ValueError``/``InvalidInput`` for malformed content, ``_NewerSchema`` for schema_version > 1.
    """
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8: {e}") from None
    if isinstance(data, dict):
        version = data.get("schema_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            raise _NewerSchema(f"schema_version {version} is newer than {SCHEMA_VERSION}")
        messages = data.get("messages")
        if isinstance(messages, list):
            me = _writer_id()
            for message in messages:
                if isinstance(message, dict) and message.get("status") == "streaming" \
                        and message.get("writer") != me:
                    message["status"] = "interrupted"
    return Conversation.from_dict(data)


def _resolve(conv: Conversation, key: MessageKey) -> int:
    if isinstance(key, MessageRef) or isinstance(key, str):
        message_id = key.message_id if isinstance(key, MessageRef) else key
        index = conv.index_of(message_id)
        if index is None:
            raise MessageNotFound("that message is no longer in this conversation")
        return index
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(conv.messages):
        return key
    raise MessageNotFound(f"no message {key!r} in this conversation")


def _json_settings(settings: Any) -> dict:
    if not isinstance(settings, dict):
        raise InvalidInput("settings must be a dict")
    try:
        return json.loads(json.dumps(settings, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"settings must be plain JSON values: {e}") from None


def _encode(data: dict) -> bytes:
    return json.dumps(data, ensure_ascii=False, indent=1).encode("utf-8")
