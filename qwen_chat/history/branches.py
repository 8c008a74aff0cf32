"""Kept versions of a conversation's messages: Edit and Regenerate keep the earlier version, ``< 2/3 >`` switches.

The conversation is a tree of messages; ``Conversation.messages`` is the *visible path* through it (what the page
shows and the model gets) and ``Conversation.branches`` holds every message off that path as a
``records.HiddenMessage`` (the message, the id of the message before it, and the number of the change that hid
it).  The *versions* at position ``i`` of the path are the messages that follow the same message (the path's
``i - 1``-th, or none for ``i == 0``): the visible one and the kept ones, in the order they were written.

* ``keep_from`` hides the path from position ``i`` on (its tail goes with it, linked by ``parent``); Edit then
  appends the edited message and Regenerate the new reply: both become a new version at ``i``;
* ``switch`` shows another version at ``i``: the path from ``i`` is hidden and the chosen version comes back
  with the turns that followed it when it was last shown (at every step the child hidden last, i.e. the one
  that was visible together with its parent);
* ``fork`` copies the path up to a message into a new conversation (no kept versions).

Old files without ``branches`` read as a conversation without kept versions and are written back unchanged
(schema version 1, ``records.Conversation.to_dict``).  The functions taking ``history`` (a
``store.UserHistory``) change the saved file in one locked read-modify-write.  No torch, no Gradio.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from qwen_chat.chat_types import InvalidInput
from qwen_chat.history.errors import MessageNotFound
from qwen_chat.history.records import Conversation, HiddenMessage, StoredMessage, make_title, retitle_for_replacement


@dataclass(frozen=True)
class Versions:
    """The versions at one position of the visible path: ``index`` (position in ``messages``), ``shown``
    (1-based number of the visible one) and ``count`` (how many there are, >= 2)."""

    index: int
    shown: int
    count: int


def _parent(conv: Conversation, index: int) -> Optional[str]:
    return conv.messages[index - 1].id if index > 0 else None


def versions_at(conv: Conversation, index: int) -> list[StoredMessage]:
    """Every version at path position ``index`` (the visible one included), oldest first (``created``, then id).

    Raises:
        MessageNotFound: ``index`` is not a position of the visible path.
    """
    if not 0 <= index < len(conv.messages):
        raise MessageNotFound(f"no message {index} in this conversation")
    parent = _parent(conv, index)
    found = [conv.messages[index]] + [h.message for h in conv.branches if h.parent == parent]
    return sorted(found, key=lambda m: (m.created, m.id))


def version_table(conv: Conversation) -> list[Versions]:
    """``Versions`` of every path position that has more than one version, in path order."""
    children: dict[Optional[str], int] = {}
    for h in conv.branches:
        children[h.parent] = children.get(h.parent, 0) + 1
    table = []
    for index, message in enumerate(conv.messages):
        if children.get(_parent(conv, index)):
            every = versions_at(conv, index)
            table.append(Versions(index, [m.id for m in every].index(message.id) + 1, len(every)))
    return table


def keep_from(conv: Conversation, index: int) -> None:
    """Hide the visible path from ``index`` on (in place): each message becomes a ``HiddenMessage`` linked to the
    one before it, all with one new ``hidden`` number.  Raises ``MessageNotFound`` for a bad ``index``."""
    if not 0 <= index < len(conv.messages):
        raise MessageNotFound(f"no message {index} in this conversation")
    stamp = max((h.hidden for h in conv.branches), default=0) + 1
    for position in range(index, len(conv.messages)):
        conv.branches.append(HiddenMessage(conv.messages[position], _parent(conv, position), stamp))
    del conv.messages[index:]


def _reveal(conv: Conversation, message_id: str) -> None:
    """Move kept message ``message_id`` to the end of the path, then follow the child hidden last at each step."""
    while message_id is not None:
        position = next(i for i, h in enumerate(conv.branches) if h.message.id == message_id)
        conv.messages.append(conv.branches.pop(position).message)
        children = [h for h in conv.branches if h.parent == message_id]
        latest = max(children, key=lambda h: (h.hidden, h.message.created), default=None)
        message_id = latest.message.id if latest is not None else None


def switch(conv: Conversation, index: int, step: int) -> None:
    """Show the version ``step`` places after (negative: before) the visible one at ``index``, in place;
    the turns after it switch with it.

    Raises:
        MessageNotFound: bad ``index``; InvalidInput: there is no version that far (the first or last is shown).
    """
    every = versions_at(conv, index)
    current = [m.id for m in every].index(conv.messages[index].id)
    target = current + step
    if not 0 <= target < len(every) or step == 0:
        raise InvalidInput("there is no other version in that direction")
    keep_from(conv, index)
    _reveal(conv, every[target].id)


def index_of(conv: Conversation, message_id: str) -> int:
    """Path position of ``message_id``.  Raises ``MessageNotFound`` when it is not on the visible path."""
    index = conv.index_of(message_id)
    if index is None:
        raise MessageNotFound("that message is no longer shown in this conversation")
    return index


def keep_and_replace(history: Any, conv_id: str, message_id: str,
                     replacement: Optional[StoredMessage] = None) -> Conversation:
    """Edit / Regenerate without losing anything: hide the path from ``message_id`` on (kept as an earlier
    version) and append ``replacement`` if given, in one saved change.  A title made from a replaced first user
    message (``make_title``) is made again from the replacement; a title the user chose stays.

    Raises:
        ConversationNotFound, MessageNotFound; InvalidInput for a replacement naming an image not stored for
        this user.
    """
    if replacement is not None:
        history.check_images(replacement)

    def change(conv: Conversation) -> None:
        index = index_of(conv, message_id)
        retitle_for_replacement(conv, index, replacement)
        keep_from(conv, index)
        if replacement is not None:
            conv.messages.append(replacement)

    return history.mutate(conv_id, change)[0]


def switch_version(history: Any, conv_id: str, message_id: str, step: int) -> Conversation:
    """``switch`` on the saved conversation: the version ``step`` places from message ``message_id`` (which must
    be on the visible path).  A title made from the first user message (``make_title``) follows the version now
    shown; a title the user chose stays.  Returns the saved conversation.

    Raises:
        ConversationNotFound, MessageNotFound, InvalidInput (no version in that direction).
    """
    def change(conv: Conversation) -> None:
        before = _first_user(conv)
        auto = before is not None and conv.title == make_title(before.text, len(before.images))
        switch(conv, index_of(conv, message_id), step)
        after = _first_user(conv)
        if auto and after is not None:  # a title made from the first message follows the version shown
            conv.title = make_title(after.text, len(after.images))

    return history.mutate(conv_id, change)[0]


def _first_user(conv: Conversation) -> Optional[StoredMessage]:
    """The first user message of the visible path, or None."""
    return next((m for m in conv.messages if m.role == "user"), None)


def fork(history: Any, conv_id: str, message_id: str) -> Conversation:
    """A new conversation of the same user with the visible path up to and including ``message_id`` (no kept
    versions), the same settings and the title "<title> (fork)"; the original is unchanged.

    Raises:
        ConversationNotFound, MessageNotFound (not on the visible path), InvalidInput.
    """
    source = history.load(conv_id)
    turns = source.messages[: index_of(source, message_id) + 1]
    suffix = " (fork)"
    title = source.title[: 200 - len(suffix)] + suffix
    new = history.create(title=title, settings=source.settings)

    def change(conv: Conversation) -> None:
        conv.messages = [StoredMessage.from_dict(m.to_dict()) for m in turns]

    return history.mutate(new.id, change)[0]
