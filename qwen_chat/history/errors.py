"""Errors of the history store; all are ``chat_types.ChatError``s, so the UI shows their message."""
from __future__ import annotations

from qwen_chat.chat_types import ChatError, InvalidInput


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


class HistoryUnavailable(ChatError):
    """The history folder could not be read or written (disk full, permissions); nothing was changed."""

    kind = "history_unavailable"
    http_status = 500
