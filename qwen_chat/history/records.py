"""The saved shapes of a conversation: ``StoredMessage``, ``Conversation``, ``ConversationSummary`` + JSON.

One conversation is one JSON object (schema version 1, or 2 when it has kept versions, a pin or tags)::

    {"schema_version": 1, "id": "<32 hex>", "title": "...", "created": "<ISO 8601 UTC>", "updated": "...",
     "revision": 7, "settings": {...},
     "messages": [{"id": "<16 hex>", "role": "user", "text": "...", "reasoning": "", "images": ["<sha256>.png"],
                   "status": "complete", "notice": "", "created": "..."}]}

Schema version 2 adds three optional keys (``branches.py`` explains them; docs/history-format.md has the whole
format): ``"branches"``, the earlier versions of messages kept by Edit and Regenerate, each
``{"parent": "<id of the message before it>" | null, "hidden": <n>, "message": {...}}``; ``"pinned": true``;
``"tags": ["work", ...]``.  ``messages`` is always the visible path (what is shown and sent to the model).  A
conversation with none of the three is written as version 1, exactly as before.
An assistant message may also have ``"stats"`` (``reply_stats.ReplyStats.record``: tokens, time to first
token, tokens/s, cached prompt tokens); it is left out when there are none, so files written before it existed
open unchanged and files without statistics stay as they were.

``reasoning`` (the assistant's thinking) is kept apart from ``text`` (its answer).  ``images`` are names of
files in the user's image folder (sha256 of the PNG bytes + ".png").  ``revision`` counts saved mutations.
Text is stored exactly as given (no Unicode normalisation), as UTF-8 without ``\\u`` escapes.

No torch, no Gradio, no file access here (see ``store.py``).
"""
from __future__ import annotations

import re
import secrets
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

from qwen_chat.chat_types import InvalidInput
from qwen_chat.history.reply_stats import check_stats

SCHEMA_VERSION = 2
#: The versions this code reads: 1 (no kept versions, pins or tags) and 2.
SCHEMA_VERSIONS = (1, 2)
DEFAULT_TITLE = "New chat"
TITLE_MAX_CHARS = 80

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Status:
    """One status a saved message can have: ``name`` (as saved), the engine's ``finish_reason``
    (``chat_types.FinishReason``) that ends a reply with this status (None: none does), and the ``label`` the
    chat shows after such a reply ("" for none)."""

    name: str
    finish_reason: Optional[str]
    label: str


#: The one status vocabulary.  ``complete``: normal end; ``streaming``: being written now; ``stopped``: the user
#: pressed Stop (or closed the tab); ``interrupted``: the service stopped (or died) while it streamed;
#: ``error``: generation failed; ``length``: max new tokens reached.
STATUS_TABLE = (
    Status("complete", "stop", ""),
    Status("streaming", None, ""),
    Status("stopped", "cancelled", "stopped by the user"),
    Status("interrupted", None, "interrupted: the service stopped before this reply finished"),
    Status("error", "error", "generation failed"),
    Status("length", "length", "token limit reached"),
)
STATUSES = tuple(s.name for s in STATUS_TABLE)
STREAMING = "streaming"
INTERRUPTED = "interrupted"
#: status -> label shown after the reply, for the statuses that have one.
STATUS_LABELS = {s.name: s.label for s in STATUS_TABLE if s.label}
#: engine finish reason -> status of the saved reply.
STATUS_OF_FINISH = {s.finish_reason: s.name for s in STATUS_TABLE if s.finish_reason}

CONVERSATION_ID = re.compile(r"[0-9a-f]{32}")
MESSAGE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
IMAGE_NAME = re.compile(r"[0-9a-f]{64}\.png")


def now_iso() -> str:
    """Current UTC time as ISO 8601 with microseconds (sorts as text in time order)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def new_conversation_id() -> str:
    """Random 128-bit id, 32 lowercase hex digits (unguessable; ``secrets.token_hex``)."""
    return secrets.token_hex(16)


def new_message_id() -> str:
    """Random 64-bit id, 16 lowercase hex digits."""
    return secrets.token_hex(8)


def _check_text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{name} contains characters that are not valid Unicode (lone surrogates)") from None
    return value


def make_title(text: str, n_images: int = 0) -> str:
    """Title from a first user message: its first line with a letter or digit that is not a code fence's
    (```` ```python ````, ``~~~``), else its first non-empty line; whitespace collapsed, cut to 80 chars + "…".

    Falls back to "Image" / "N images" for an image-only message and to ``DEFAULT_TITLE`` otherwise.
    """
    lines = [" ".join(line.split()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    worded = [line for line in lines if any(ch.isalnum() for ch in line) and not line.startswith(("```", "~~~"))]
    for line in worded[:1] or lines[:1]:
        return line if len(line) <= TITLE_MAX_CHARS else line[: TITLE_MAX_CHARS - 1].rstrip() + "…"
    if n_images:
        return "Image" if n_images == 1 else f"{n_images} images"
    return DEFAULT_TITLE


def retitle_for_replacement(conv: "Conversation", index: int, replacement: Optional["StoredMessage"]) -> None:
    """Before the message at ``index`` of ``conv`` is replaced by ``replacement`` (Edit): when it is the first
    user message and the title was made from it (``make_title``), make the title again from the replacement; a
    title the user chose stays.  Nothing without a replacement."""
    dropped = conv.messages[index]
    if (replacement is not None and dropped.role == "user"
            and not any(m.role == "user" for m in conv.messages[:index])
            and conv.title == make_title(dropped.text, len(dropped.images))):
        conv.title = make_title(replacement.text, len(replacement.images))


def clean_title(title: Any) -> str:
    """Validate a user-given title: text, not blank after collapsing whitespace, at most 200 characters.

    Raises:
        InvalidInput: otherwise.
    """
    title = " ".join(_check_text("title", title).split())
    if not title:
        raise InvalidInput("the title is empty")
    if len(title) > 200:
        raise InvalidInput(f"the title is too long ({len(title)} characters, at most 200)")
    return title


@dataclass
class StoredMessage:
    """One saved turn.

    ``id``: unique within the conversation (``MESSAGE_ID``); ``role``: one of ``ROLES``; ``text``: the
    visible text (for an assistant: the answer only); ``reasoning``: the assistant's thinking (never the
    answer); ``images``: image file names (``IMAGE_NAME``) in the user's image folder; ``status``: one of
    ``STATUSES``; ``notice``: a user-facing remark (error text, dropped context); ``created``: ISO 8601 UTC;
    ``stats``: the reply's statistics (``reply_stats``) or None.

    Raises:
        InvalidInput: on construction, for a bad role, status, id, image name or non-text field.
    """

    id: str
    role: str
    text: str
    reasoning: str = ""
    images: list[str] = field(default_factory=list)
    status: str = "complete"
    notice: str = ""
    created: str = field(default_factory=now_iso)
    stats: Optional[dict] = None

    def __post_init__(self) -> None:
        try:
            self.stats = check_stats(self.stats)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        if not isinstance(self.id, str) or not MESSAGE_ID.fullmatch(self.id):
            raise InvalidInput(f"bad message id {self.id!r}")
        if self.role not in ROLES:
            raise InvalidInput(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.status not in STATUSES:
            raise InvalidInput(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        _check_text("text", self.text)
        _check_text("reasoning", self.reasoning)
        _check_text("notice", self.notice)
        _check_text("created", self.created)
        if isinstance(self.images, (str, bytes)):
            raise InvalidInput("images must be a list of image names")
        self.images = list(self.images)
        for name in self.images:
            if not isinstance(name, str) or not IMAGE_NAME.fullmatch(name):
                raise InvalidInput(f"bad image reference {name!r}")

    @classmethod
    def new(cls, role: str, text: str, **fields: Any) -> "StoredMessage":
        """A message with a fresh random id and the current time."""
        return cls(id=new_message_id(), role=role, text=text, **fields)

    def to_dict(self) -> dict:
        """The JSON object of this message (plain dict; ``images`` a list; no ``stats`` key when None)."""
        data = asdict(self)
        if data["stats"] is None:
            del data["stats"]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "StoredMessage":
        """Parse one message object.  Raises ``ValueError`` (or ``InvalidInput``) when it is malformed."""
        if not isinstance(data, dict):
            raise ValueError("message is not an object")
        known = {k: data[k] for k in ("id", "role", "text", "reasoning", "images", "status", "notice",
                                      "created", "stats") if k in data}
        missing = {"id", "role", "text"} - known.keys()
        if missing:
            raise ValueError(f"message lacks {sorted(missing)}")
        return cls(**known)


@dataclass
class Conversation:
    """One saved conversation (see the module docstring for the JSON form).

    ``created``/``updated`` are ISO 8601 UTC; ``revision`` is incremented by every saved mutation;
    ``settings`` holds the generation settings and system prompt as plain JSON values.
    """

    id: str
    title: str = DEFAULT_TITLE
    created: str = field(default_factory=now_iso)
    updated: str = ""
    revision: int = 0
    messages: list[StoredMessage] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    branches: list["HiddenMessage"] = field(default_factory=list)
    pinned: bool = False
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.updated:
            self.updated = self.created

    def every_message(self) -> list[StoredMessage]:
        """The visible path's messages, then every kept earlier version (``branches``)."""
        return [*self.messages, *(h.message for h in self.branches)]

    def matches(self, query: str) -> bool:
        """True when ``query`` (whitespace collapsed; case-insensitive, ``str.casefold``) occurs in the title or
        in the text of any message, earlier versions (``branches``) included; an empty query matches every
        conversation."""
        needle = " ".join(query.split()).casefold()
        return not needle or any(needle in " ".join(text.split()).casefold()
                                 for text in [self.title, *(m.text for m in self.every_message())])

    def index_of(self, message_id: str) -> Optional[int]:
        """Position of the message with ``message_id``, or None."""
        for index, message in enumerate(self.messages):
            if message.id == message_id:
                return index
        return None

    def to_dict(self) -> dict:
        """The JSON object of this conversation (see the module docstring): schema version 1 without kept
        versions, pin and tags (the keys are then left out), else 2."""
        data = {
            "schema_version": 2 if self.branches or self.pinned or self.tags else 1,
            "id": self.id,
            "title": self.title,
            "created": self.created,
            "updated": self.updated,
            "revision": self.revision,
            "settings": self.settings,
            "messages": [m.to_dict() for m in self.messages],
        }
        if self.pinned:
            data["pinned"] = True
        if self.tags:
            data["tags"] = list(self.tags)
        if self.branches:
            data["branches"] = [h.to_dict() for h in self.branches]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "Conversation":
        """Parse a conversation object.

        Raises:
            ValueError (or ``InvalidInput``): for anything malformed, including a schema version not in
            ``SCHEMA_VERSIONS``.
        """
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema_version") not in SCHEMA_VERSIONS or isinstance(data.get("schema_version"), bool):
            raise ValueError(f"unsupported schema_version {data.get('schema_version')!r}")
        conv_id = data.get("id")
        if not isinstance(conv_id, str) or not CONVERSATION_ID.fullmatch(conv_id):
            raise ValueError("bad or missing conversation id")
        messages = data.get("messages")
        settings = data.get("settings", {})
        revision = data.get("revision", 0)
        if not isinstance(messages, list) or not isinstance(settings, dict):
            raise ValueError("messages must be a list and settings an object")
        if isinstance(revision, bool) or not isinstance(revision, int):
            raise ValueError("revision must be an integer")
        for key in ("title", "created", "updated"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"{key} must be text")
        branches, pinned, tags = data.get("branches", []), data.get("pinned", False), data.get("tags", [])
        if not isinstance(branches, list) or not isinstance(pinned, bool) or not isinstance(tags, list):
            raise ValueError("branches and tags must be lists and pinned true or false")
        return cls(id=conv_id, title=data["title"], created=data["created"], updated=data["updated"],
                   revision=revision, messages=[StoredMessage.from_dict(m) for m in messages],
                   settings=settings, branches=[HiddenMessage.from_dict(h) for h in branches], pinned=pinned,
                   tags=clean_tags(tags))


@dataclass(frozen=True)
class ConversationSummary:
    """What the sidebar lists: id, title, ISO 8601 UTC ``created``/``updated``, number of messages (visible
    path), whether it is pinned and its tags."""

    id: str
    title: str
    created: str
    updated: str
    n_messages: int
    pinned: bool = False
    tags: tuple[str, ...] = ()


@dataclass
class HiddenMessage:
    """A kept earlier version (or a turn after one): ``message`` is off the visible path; ``parent`` is the id
    of the message before it (None: it was the first message); ``hidden`` numbers the change that hid it
    (1, 2, ...: larger is later; a tail hidden together shares one number).  JSON:
    ``{"parent": ..., "hidden": n, "message": {...}}``.

    Raises:
        InvalidInput / ValueError: on construction or parsing, for a malformed field.
    """

    message: StoredMessage
    parent: Optional[str]
    hidden: int

    def __post_init__(self) -> None:
        if self.parent is not None and (not isinstance(self.parent, str) or not MESSAGE_ID.fullmatch(self.parent)):
            raise InvalidInput(f"bad parent id {self.parent!r}")
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden < 1:
            raise InvalidInput(f"hidden must be a positive integer, got {self.hidden!r}")

    def to_dict(self) -> dict:
        """The JSON object of this kept message."""
        return {"parent": self.parent, "hidden": self.hidden, "message": self.message.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> "HiddenMessage":
        """Parse one kept message.  Raises ``ValueError`` (or ``InvalidInput``) when it is malformed."""
        if not isinstance(data, dict) or not {"parent", "hidden", "message"} <= data.keys():
            raise ValueError("a kept version needs parent, hidden and message")
        return cls(StoredMessage.from_dict(data["message"]), data["parent"], data["hidden"])


TAG_MAX_CHARS = 30
MAX_TAGS = 10


def clean_tags(tags: Any) -> list[str]:
    """Validate tags: a list of at most ``MAX_TAGS`` texts, each whitespace-collapsed, 1-30 characters, no comma;
    duplicates (case-insensitive) dropped, order kept.

    Raises:
        InvalidInput: not a list, too many, or a tag that is blank, too long or has a comma.
    """
    if isinstance(tags, (str, bytes)) or not isinstance(tags, (list, tuple)):
        raise InvalidInput("tags must be a list of texts")
    seen, out = set(), []
    for tag in tags:
        tag = " ".join(_check_text("tag", tag).split())
        if not tag or len(tag) > TAG_MAX_CHARS or "," in tag:
            raise InvalidInput(f"a tag has 1-{TAG_MAX_CHARS} characters and no comma, got {tag!r}")
        if tag.casefold() not in seen:
            seen.add(tag.casefold())
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise InvalidInput(f"at most {MAX_TAGS} tags per conversation, got {len(out)}")
    return out
