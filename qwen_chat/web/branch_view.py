"""Kept versions on the chat page: the ``< 2/3 >`` switch and "Fork" on the messages (``history.branches``).

* ``branch_rows``: what the page's script (``page.js``) draws under the messages, as JSON: one entry per
  message of the visible path, at the last Chatbot position that message fills (``render.shown_sources``) other
  than its statistics line (``render.stats_rows``: the tools sit under the answer, the line under them), with
  the message's id and, where there are several versions, which one is shown and how many there are;
* ``BranchActions.run``: a command the script sends (``{"op": "switch", "msg": <id>, "step": -1 | 1}`` or
  ``{"op": "fork", "msg": <id>}``): switch the version shown at that message (the turns after it switch with
  it) or start a new conversation with the turns up to it.

The model always gets the visible path only (``handlers.ChatController`` builds every prompt from
``Conversation.messages``); a switched-back version's prompt is the same token sequence as before, so the
engine's conversation cache reuses its kept state while it is still kept (docs/conversation-cache.md).
No Gradio objects here.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from qwen_chat.chat_types import InvalidInput
from qwen_chat.history import branches
from qwen_chat.history.records import STREAMING
from qwen_chat.web.render import chatbot_messages, shown_sources, stats_rows

MAX_COMMAND_CHARS = 1000


def branch_rows(conv: Any) -> list[dict]:
    """``[{"row": <Chatbot position>, "id": <message id>, "role": ..., "shown": k, "count": n}]`` for every
    message of ``conv``'s visible path that the Chatbot shows (``count`` 1: a single version)."""
    versions = {v.index: v for v in branches.version_table(conv)}
    last_row: dict[int, int] = {}
    stats = stats_rows(conv.messages)
    for row, index in enumerate(shown_sources(conv.messages)):
        if row not in stats or index not in last_row:  # a reply shown as its statistics line only keeps it
            last_row[index] = row
    rows = []
    for index, row in sorted(last_row.items(), key=lambda item: item[1]):
        message = conv.messages[index]
        v = versions.get(index)
        rows.append({"row": row, "id": message.id, "role": message.role,
                     "shown": v.shown if v else 1, "count": v.count if v else 1})
    return rows


def branch_json(controller: Any, user_id: str, conv_id: Optional[str]) -> str:
    """``branch_rows`` of the open conversation as JSON ("[]" for none, or one that is gone)."""
    if not conv_id:
        return "[]"
    try:
        conv = controller.store.user(user_id).load(conv_id)
    except Exception:  # noqa: BLE001 - deleted meanwhile / another user's: nothing to draw
        return "[]"
    return json.dumps(branch_rows(conv))


class BranchActions:
    """The message tools' commands on the controller's store, for the user of the request."""

    def __init__(self, controller: Any) -> None:
        self.ctl = controller

    def run(self, user_id: str, conv_id: str, raw: Any) -> tuple[list[dict], str, str]:
        """Do the JSON command ``raw`` in conversation ``conv_id``; returns (Chatbot messages, the conversation
        id now open (a fork's new id), notice).

        Raises:
            InvalidInput: malformed command, no conversation open, a reply still being written into this
            conversation (a saved ``streaming`` reply reads as ``interrupted`` once its writer is gone), no
            version in that direction; ConversationNotFound / MessageNotFound: gone or not on the visible path.
        """
        command = _parse(raw)
        if not conv_id:
            raise InvalidInput("open a conversation first")
        history = self.ctl.store.user(user_id)
        # a reply being written into this conversation (by any tab): its updates would draw over the switch
        if any(m.status == STREAMING for m in history.load(conv_id).messages):
            raise InvalidInput("a reply is still being written: wait for it or press Stop")
        if command["op"] == "switch":
            step = command.get("step")
            if step not in (-1, 1):
                raise InvalidInput("that menu command could not be read")
            conv = branches.switch_version(history, conv_id, command["msg"], step)
            notice = ""
        elif command["op"] == "fork":
            conv = branches.fork(history, conv_id, command["msg"])
            notice = f"Forked into a new conversation: {conv.title}"
        else:
            raise InvalidInput(f"unknown message command {command['op']!r}")
        return chatbot_messages(conv.messages, history.image_path), conv.id, notice


def _parse(raw: Any) -> dict:
    if not isinstance(raw, str) or not raw or len(raw) > MAX_COMMAND_CHARS:
        raise InvalidInput("that message command could not be read")
    try:
        command = json.loads(raw)
    except ValueError:
        raise InvalidInput("that message command could not be read") from None
    if not isinstance(command, dict) or not isinstance(command.get("op"), str) \
            or not isinstance(command.get("msg"), str):
        raise InvalidInput("that message command could not be read")
    return command
