"""The conversation list as a chat app shows it: pinned entries first, tags with a filter, a menu on every entry.

* ``entry_label``: one entry: a pin mark for a pinned conversation, the title and time
  (``render.conversation_label``), ``RUNNING_MARK`` while a reply is being written into it, and its tags after
  a tag mark (``PIN_MARK`` title · time ``RUNNING_MARK`` ``TAG_MARK`` work, home); the page's script
  (``page.js``) reads the entry's title and tags back from it for the menu;
* ``list_entries``: (label, id) pairs, pinned first, each group newest first, only those with the chosen tag;
* ``tag_choices``: the tag filter's choices (every tag of the user's conversations);
* ``ListActions.run``: one command of an entry's menu (rename, pin/unpin, tags, export, delete), sent by the
  page's script as JSON ``{"op": ..., "conv": <id>, ...}``.

The menu itself (opened by the "⋯" button on every entry; rename inline, delete after a confirmation) is drawn by
``page.js``.  No Gradio objects here; every command checks the user's own history (another user's id is "not
found", as everywhere).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from qwen_chat.chat_types import InvalidInput
from qwen_chat.history.records import STREAMING, clean_tags
from qwen_chat.web.render import conversation_label

PIN_MARK = "\u2605 "  # black star + space, before a pinned entry's title (in every common font, unlike emoji)
TAG_MARK = " · tags: "  # before an entry's tags
RUNNING_MARK = " · writing…"  # after the time of an entry whose reply is still being written (page_live)
ALL_TAGS = ""  # the tag filter's value for "every conversation"
MAX_COMMAND_CHARS = 2000


def entry_label(summary: Any, running: bool = False) -> str:
    """The list entry of ``summary`` (``records.ConversationSummary``; ``running``: a reply is being written
    into it): see the module docstring."""
    label = conversation_label(summary) + (RUNNING_MARK if running else "")
    if getattr(summary, "pinned", False):
        label = PIN_MARK + label
    tags = getattr(summary, "tags", ())
    return label + (TAG_MARK + ", ".join(tags) if tags else "")


def has_tag(summary: Any, tag: str) -> bool:
    """True when ``tag`` is ``ALL_TAGS`` or one of the summary's tags (case-insensitive)."""
    return not tag or tag.casefold() in {t.casefold() for t in getattr(summary, "tags", ())}


def list_entries(summaries: list, tag: str = ALL_TAGS, running: Any = ()) -> list[tuple[str, str]]:
    """(label, conversation id) pairs of ``summaries`` (newest first, as ``UserHistory.list`` gives them) that
    carry ``tag``, the pinned ones first (a stable sort: each group stays newest first); the ids in ``running``
    are marked as being written."""
    chosen = [s for s in summaries if has_tag(s, tag)]
    chosen.sort(key=lambda s: not getattr(s, "pinned", False))
    return [(entry_label(s, s.id in running), s.id) for s in chosen]


def tag_choices(summaries: list) -> list[tuple[str, str]]:
    """The tag filter's (label, value) choices: "All conversations" then every tag in use, sorted
    case-insensitively (the first spelling met is shown)."""
    tags: dict[str, str] = {}
    for s in summaries:
        for t in getattr(s, "tags", ()):
            tags.setdefault(t.casefold(), t)
    return [("All conversations", ALL_TAGS)] + [(t, t) for _, t in sorted(tags.items())]


def parse_tags(text: Any) -> list[str]:
    """Comma-separated tags as typed ("work, Home") -> a clean list (``records.clean_tags``; empty: no tags).

    Raises:
        InvalidInput: a tag over 30 characters or more than 10 tags.
    """
    if not isinstance(text, str):
        raise InvalidInput("tags must be text")
    return clean_tags([t for t in (" ".join(p.split()) for p in text.split(",")) if t])


def parse_command(raw: Any) -> dict:
    """The menu's JSON command -> dict with ``op`` and ``conv``.  Raises ``InvalidInput`` when malformed."""
    if not isinstance(raw, str) or not raw or len(raw) > MAX_COMMAND_CHARS:
        raise InvalidInput("that menu command could not be read")
    try:
        command = json.loads(raw)
    except ValueError:
        raise InvalidInput("that menu command could not be read") from None
    if not isinstance(command, dict) or not isinstance(command.get("op"), str) \
            or not isinstance(command.get("conv"), str):
        raise InvalidInput("that menu command could not be read")
    return command


class ListActions:
    """The entry menu's commands on one ``HistoryStore``, for the user of the request."""

    OPS = ("rename", "pin", "tags", "export", "delete")

    def __init__(self, controller: Any) -> None:
        self.ctl = controller

    def run(self, user_id: str, command: dict) -> tuple[str, Optional[str]]:
        """Do ``command`` (``parse_command``'s dict) for ``user_id``; returns (notice, path of an exported zip or
        None).

        Raises:
            InvalidInput / ConversationNotFound: an unknown op, a bad title or tags, another user's or an
            unknown conversation, a delete while a reply is being written into the conversation.
        """
        op, conv_id = command["op"], command["conv"]
        history = self.ctl.store.user(user_id)
        if op == "rename":
            self.ctl.rename(user_id, conv_id, command.get("title") if isinstance(command.get("title"), str) else "")
            return f"Renamed to: {' '.join(command['title'].split())}", None
        if op == "pin":
            pinned = bool(command.get("pinned"))

            def pin(conv: Any) -> None:
                conv.pinned = pinned

            history.mutate(conv_id, pin, touch=False)
            return ("Pinned." if pinned else "Unpinned."), None
        if op == "tags":
            tags = parse_tags(command.get("tags", ""))

            def retag(conv: Any) -> None:
                conv.tags = tags

            history.mutate(conv_id, retag, touch=False)
            return ("Tags: " + ", ".join(tags) if tags else "Tags removed."), None
        if op == "export":  # the one-click Download's zip (<title>.zip: <title>.md, conversation.json, images/)
            return "", self.ctl.download(user_id, conv_id)
        if op == "delete":
            if any(m.status == STREAMING for m in history.load(conv_id).messages):
                raise InvalidInput("a reply is still being written into this conversation: press Stop first")
            self.ctl.delete(user_id, conv_id)
            return "Conversation deleted.", None
        raise InvalidInput(f"unknown menu command {op!r}")
