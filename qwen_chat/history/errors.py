"""Errors of the history store; all are ``chat_types.ChatError``s, so the UI shows their message."""
from __future__ import annotations

import errno

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


#: What a refused disk operation means for the history folder, by ``errno`` (POSIX names; ``errno(3)``):
#: (when writing, when reading).  Other errors read as their ``strerror``.
_REASONS = {
    errno.EACCES: ("the history folder is not writable", "the history folder is not readable"),
    errno.EPERM: ("the history folder is not writable", "the history folder is not readable"),
    errno.EROFS: ("the history folder is on a read-only file system",) * 2,
    errno.ENOSPC: ("the disk holding the history folder is full",) * 2,
    errno.EDQUOT: ("the disk quota of the history folder is used up",) * 2,
}


def unavailable(action: str, exc: OSError, writing: bool = True) -> HistoryUnavailable:
    """The ``HistoryUnavailable`` for a failed disk operation: "Could not <action>: <reason>", e.g. "Could not
    save the conversation: the history folder is not writable".  It names no server path (an ``OSError``'s
    text does: ``[Errno 13] Permission denied: '/srv/.../locks/<id>.lock'``); the caller logs the details.

    action: what failed, in words ("save the conversation"); exc: the ``OSError``; writing: False when a read
    failed (EACCES then means "not readable").
    """
    reasons = _REASONS.get(exc.errno)
    reason = reasons[0 if writing else 1] if reasons else (exc.strerror or type(exc).__name__).lower()
    return HistoryUnavailable(f"Could not {action}: {reason}")
