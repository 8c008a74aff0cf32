"""Conversation store: one JSON file per conversation, images stored once by content hash, per-user folders.

Layout under the history folder (``--history-dir``)::

    users/<user_id>/conversations/<conversation id>.json   one conversation (see records.py)
    users/<user_id>/images/<sha256 of the PNG>.png          each image once
    users/<user_id>/corrupt/<file>.<UTC time>.bad           unreadable files, set aside
    users/<user_id>/locks/<conversation id>.lock            flock files (never deleted)

Guarantees (a crash never leaves a corrupt file; a page left open across a restart never wipes history):

* every mutation is a read-modify-write of the file *as it is on disk now*, under an exclusive lock (a thread
  lock plus ``fcntl.flock``), written atomically (``files.write_atomic``), with ``revision`` + 1.  A stale
  browser page that appends a message therefore merges with newer history instead of overwriting it, and
  concurrent writers (threads or processes) never lose an update;
* a reply saved as ``streaming`` by a process that is gone (``kill -9`` mid-reply) reads back as
  ``interrupted`` and is stored that way on the next write (``conversation_files.py``);
* corrupt, empty or half-written files are moved to ``corrupt/`` with a logged warning; the others still list;
* ids are checked on every access (user ids ``[A-Za-z0-9_.-]{1,64}``, conversation ids 32 hex digits, image
  names ``<64 hex>.png``), and each ``UserHistory`` only ever touches its own folder: another user's id, a
  guessed id and a path such as ``../x`` all raise ``ConversationNotFound`` with the same message.

Images live in ``image_folder.py``, the conversation files in ``conversation_files.py``, the life of one
streaming reply in ``turns.py``.  No torch, no Gradio.  Usage::

    store = HistoryStore(Path("history"))
    history = store.user("local")
    conv = history.create()
    ref = history.append_message(conv.id, role="user", text="What is in this photo?",
                                 images=[history.put_image(png_bytes)])
"""
from __future__ import annotations

import io
import logging
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from qwen_chat.chat_types import InvalidInput
from qwen_chat.history.conversation_files import ConversationFolder, Unchanged, encode_json, json_settings
from qwen_chat.history.errors import ConversationNotFound, HistoryUnavailable, MessageNotFound, unavailable
from qwen_chat.history.files import LockTable
from qwen_chat.history.image_folder import ImageFolder
from qwen_chat.history.records import (
    DEFAULT_TITLE,
    STATUSES,
    Conversation,
    ConversationSummary,
    StoredMessage,
    clean_title,
    make_title,
    new_conversation_id,
    retitle_for_replacement,
)

__all__ = [
    "HistoryStore", "UserHistory", "MessageRef", "StoredMessage", "Conversation", "ConversationSummary",
    "ConversationNotFound", "MessageNotFound", "HistoryUnavailable", "DEFAULT_TITLE",
    "LOCAL_USER",
]

log = logging.getLogger(__name__)

#: The user id used when login is off.
LOCAL_USER = "local"
USER_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
        lock_dir = folder / "locks"
        self._files = ConversationFolder(folder / "conversations", lock_dir, folder / "corrupt", locks)
        self._images = ImageFolder(folder / "images", lock_dir / "images.lock", locks)
        try:
            for d in (self._files.folder, self._images.folder, lock_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise unavailable("create the history folder", e) from None

    # ------------------------------------------------------------------ reading
    def list(self, query: str = "") -> list[ConversationSummary]:
        """Summaries of every readable conversation, most recently updated first; with a ``query`` only those
        whose title or message text contains it (``Conversation.matches``: case-insensitive).

        Unreadable files are set aside into ``corrupt/`` with a warning; never raises for them.
        """
        self._files.remove_stale_temp_files()
        summaries = []
        for conv_id in self._files.ids():
            try:
                conv = self._files.read(conv_id)
            except (ConversationNotFound, InvalidInput):
                continue
            except OSError as e:
                log.warning("cannot read history file %s: %s", self._files.path(conv_id), e)
                continue
            if not conv.matches(query):
                continue
            summaries.append(ConversationSummary(conv.id, conv.title, conv.created, conv.updated,
                                                 len(conv.messages), conv.pinned, tuple(conv.tags)))
        summaries.sort(key=lambda s: (s.updated, s.id), reverse=True)
        return summaries

    def load(self, conv_id: str) -> "Conversation":
        """The conversation as saved now (``streaming`` replies of a dead process read as ``interrupted``).

        Raises:
            ConversationNotFound: unknown, foreign, malformed or unreadable (then set aside) id.
        """
        path = self._files.path(conv_id)
        try:
            return self._files.read(path.stem)
        except OSError as e:
            raise unavailable("read the conversation", e, writing=False) from None

    # ------------------------------------------------------------------ writing
    def create(self, title: str = DEFAULT_TITLE, settings: Optional[dict] = None) -> Conversation:
        """Save a new empty conversation with a random id and return it (revision 1).

        Raises:
            InvalidInput: bad title or settings that are not plain JSON.
        """
        title = DEFAULT_TITLE if not isinstance(title, str) or not title.strip() else clean_title(title)
        conv = Conversation(id=new_conversation_id(), title=title, revision=1,
                            settings=json_settings(settings or {}))
        with self._files.locked(conv.id):
            self._files.write(conv)
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
        self.check_images(message)

        def change(conv: Conversation) -> Any:
            existing = conv.index_of(message.id)
            if existing is not None:
                if conv.messages[existing].to_dict() == message.to_dict():
                    return Unchanged(MessageRef(existing, message.id))
                raise InvalidInput("a different message with this id is already saved")
            if (message.role == "user" and conv.title == DEFAULT_TITLE
                    and not any(m.role == "user" for m in conv.messages)):
                conv.title = make_title(message.text, len(message.images))
            conv.messages.append(message)
            return MessageRef(len(conv.messages) - 1, message.id)

        return self._files.mutate(conv_id, change)[1]

    def update_message(self, conv_id: str, message: MessageKey, *, text: Optional[str] = None,
                       reasoning: Optional[str] = None, status: Optional[str] = None,
                       notice: Optional[str] = None, stats: Optional[dict] = None) -> Conversation:
        """Change fields of one saved message (None: leave as is; ``stats``: ``reply_stats`` record); returns
        the saved conversation.

        ``message`` is a ``MessageRef`` (found by id, also among the kept earlier versions), a message id (str)
        or an index (int).

        Raises:
            ConversationNotFound, MessageNotFound, InvalidInput (bad status or non-text value).
        """
        if status is not None and status not in STATUSES:
            raise InvalidInput(f"status must be one of {', '.join(STATUSES)}, got {status!r}")

        def change(conv: Conversation) -> None:
            try:
                index, holder = _resolve(conv, message), None
                fields = conv.messages[index].to_dict()
            except MessageNotFound:  # a reply whose version was switched away while it streamed
                holder = next((h for h in conv.branches if isinstance(message, (MessageRef, str))
                               and h.message.id == getattr(message, "message_id", message)), None)
                if holder is None:
                    raise
                fields = holder.message.to_dict()
            for key, value in (("text", text), ("reasoning", reasoning), ("status", status),
                               ("notice", notice), ("stats", stats)):
                if value is not None:
                    fields[key] = value
            if holder is None:
                conv.messages[index] = StoredMessage(**fields)
            else:
                holder.message = StoredMessage(**fields)

        return self._files.mutate(conv_id, change)[0]

    def truncate_from(self, conv_id: str, message: MessageKey,
                      replacement: Optional[StoredMessage] = None) -> Conversation:
        """Drop ``message`` and every later message (Regenerate); with a ``replacement``, append it in the
        same saved change (an edited user message: the turns after it are replaced).  A title that was made
        from the dropped first user message (``make_title``) is made again from the replacement; a title the
        user chose stays.  Returns the saved conversation.

        Raises:
            ConversationNotFound, MessageNotFound; InvalidInput when ``replacement`` is not a
            ``StoredMessage`` or names an image not stored for this user.
        """
        if replacement is not None:
            self.check_images(replacement)

        def change(conv: Conversation) -> None:
            index = _resolve(conv, message)
            retitle_for_replacement(conv, index, replacement)
            del conv.messages[index:]
            if replacement is not None:
                conv.messages.append(replacement)

        return self._files.mutate(conv_id, change)[0]

    def mutate(self, conv_id: str, change: Callable[[Conversation], Any], touch: bool = True) -> tuple:
        """Read-modify-write of the saved conversation under its lock (``ConversationFolder.mutate``): ``change``
        edits it in place; returns (saved conversation, what ``change`` returned).  For the kept versions
        (``branches.py``) and the sidebar's pin and tags (``touch`` False: ``updated`` stays).

        Raises:
            ConversationNotFound; what ``change`` raises (then nothing is written).
        """
        return self._files.mutate(conv_id, change, touch)

    def set_settings(self, conv_id: str, settings: dict) -> Conversation:
        """Replace the stored generation settings (a JSON-serialisable dict).

        Raises:
            ConversationNotFound; InvalidInput when ``settings`` is not a dict of plain JSON values.
        """
        settings = json_settings(settings)

        def change(conv: Conversation) -> None:
            conv.settings = settings

        return self._files.mutate(conv_id, change)[0]

    def rename(self, conv_id: str, title: str) -> Conversation:
        """Set the title (whitespace collapsed, 1-200 characters).

        Raises:
            ConversationNotFound; InvalidInput for a blank or too long title.
        """
        title = clean_title(title)

        def change(conv: Conversation) -> None:
            conv.title = title

        return self._files.mutate(conv_id, change)[0]

    def delete(self, conv_id: str) -> None:
        """Delete the conversation's file, then images no other conversation of this user uses
        (except ones stored in the last ``image_folder.IMAGE_GC_GRACE_S`` seconds).

        Raises:
            ConversationNotFound.
        """
        path = self._files.path(conv_id)
        with self._files.locked(conv_id, "delete the conversation"):
            try:
                path.unlink()
            except FileNotFoundError:
                raise ConversationNotFound() from None
            except OSError as e:
                raise unavailable("delete the conversation", e) from None
        self._images.remove_unused(self._files.used_image_names)

    def export_zip(self, conv_id: str) -> bytes:
        """A zip (bytes) with ``conversation.json`` (the saved JSON, kept versions included) and
        ``images/<name>.png`` for its images (those of the kept versions too).

        Raises:
            ConversationNotFound.
        """
        conv = self.load(conv_id)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("conversation.json", encode_json(conv.to_dict()))
            names = sorted({n for m in conv.every_message() for n in m.images})
            for name in names:
                try:
                    data = (self._images.folder / name).read_bytes()
                except FileNotFoundError:
                    log.warning("image %s of conversation %s is missing from %s", name, conv.id,
                                self._images.folder)
                    continue
                zf.writestr(f"images/{name}", data, compress_type=zipfile.ZIP_STORED)
        return buffer.getvalue()

    # ------------------------------------------------------------------ images
    def put_image(self, png_bytes: bytes) -> str:
        """Store a normalised PNG once; return its name ``<sha256 hex of the bytes>.png``.

        Raises:
            InvalidImage: ``png_bytes`` is not PNG data (normalise uploads with ``qwen_chat.images`` first).
        """
        try:
            return self._images.put(png_bytes)
        except OSError as e:
            raise unavailable("store the image", e) from None

    def image_path(self, name: str) -> Path:
        """Path of a stored image of this user.

        Raises:
            InvalidInput: malformed name (not ``<64 hex>.png``) or no such image for this user.
        """
        return self._images.path(name)

    def check_images(self, message: Any) -> None:
        """Raise ``InvalidInput`` unless ``message`` is a ``StoredMessage`` whose images are all stored here."""
        if not isinstance(message, StoredMessage):
            raise InvalidInput("message must be a StoredMessage")
        for name in message.images:
            if not self._images.has(name):
                raise InvalidInput(f"image {name} is not stored for this user")


def _resolve(conv: Conversation, key: MessageKey) -> int:
    """Index of the message ``key`` names: a ``MessageRef`` or id by id, an ``int`` as an index.

    Raises:
        MessageNotFound: no such message (any more).
    """
    if isinstance(key, MessageRef) or isinstance(key, str):
        message_id = key.message_id if isinstance(key, MessageRef) else key
        index = conv.index_of(message_id)
        if index is None:
            raise MessageNotFound("that message is no longer in this conversation")
        return index
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(conv.messages):
        return key
    raise MessageNotFound(f"no message {key!r} in this conversation")
