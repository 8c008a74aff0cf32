"""The saved shapes of a conversation: ``StoredMessage``, ``Conversation``, ``ConversationSummary`` + JSON.

One conversation is one JSON object (schema version 1)::

    {"schema_version": 1, "id": "<32 hex>", "title": "...", "created": "<ISO 8601 UTC>", "updated": "...",
     "revision": 7, "settings": {...},
     "messages": [{"id": "<16 hex>", "role": "user", "text": "...", "reasoning": "", "images": ["<sha256>.png"],
                   "status": "complete", "notice": "", "created": "..."}]}

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

SCHEMA_VERSION = 1
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
    """Title from a first user message: its first non-empty line, whitespace collapsed, cut to 80 chars + "…".

    Falls back to "Image" / "N images" for an image-only message and to ``DEFAULT_TITLE`` otherwise.
    """
    for line in text.splitlines():
        line = " ".join(line.split())
        if line:
            return line if len(line) <= TITLE_MAX_CHARS else line[: TITLE_MAX_CHARS - 1].rstrip() + "…"
    if n_images:
        return "Image" if n_images == 1 else f"{n_images} images"
    return DEFAULT_TITLE


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
    ``STATUSES``; ``notice``: a user-facing remark (error text, dropped context); ``created``: ISO 8601 UTC.

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

    def __post_init__(self) -> None:
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
        """The JSON object of this message (plain dict; ``images`` a list)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "StoredMessage":
        """Parse one message object.  Raises ``ValueError`` (or ``InvalidInput``) when it is malformed."""
        if not isinstance(data, dict):
            raise ValueError("message is not an object")
        known = {k: data[k] for k in ("id", "role", "text", "reasoning", "images", "status", "notice",
                                      "created") if k in data}
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

    def __post_init__(self) -> None:
        if not self.updated:
            self.updated = self.created

    def matches(self, query: str) -> bool:
        """True when ``query`` (whitespace collapsed; case-insensitive, ``str.casefold``) occurs in the title or
        in the text of any message; an empty query matches every conversation."""
        needle = " ".join(query.split()).casefold()
        return not needle or any(needle in " ".join(text.split()).casefold()
                                 for text in [self.title, *(m.text for m in self.messages)])

    def index_of(self, message_id: str) -> Optional[int]:
        """Position of the message with ``message_id``, or None."""
        for index, message in enumerate(self.messages):
            if message.id == message_id:
                return index
        return None

    def to_dict(self) -> dict:
        """The JSON object of this conversation (schema version 1, see the module docstring)."""
        return {
            "schema_version": self.schema_version,
            "id": self.id,
            "title": self.title,
            "created": self.created,
            "updated": self.updated,
            "revision": self.revision,
            "settings": self.settings,
            "messages": [m.to_dict() for m in self.messages],
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Conversation":
        """Parse a conversation object.

        Raises:
            ValueError (or ``InvalidInput``): for anything malformed, including a schema version other than 1.
        """
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema_version") != SCHEMA_VERSION:
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
        return cls(id=conv_id, title=data["title"], created=data["created"], updated=data["updated"],
                   revision=revision, messages=[StoredMessage.from_dict(m) for m in messages],
                   settings=settings)


@dataclass(frozen=True)
class ConversationSummary:
    """What the sidebar lists: id, title, ISO 8601 UTC ``created``/``updated``, number of messages."""

    id: str
    title: str
    created: str
    updated: str
    n_messages: int
