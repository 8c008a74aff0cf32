"""The life of one chat turn in the history: what the backend is sent, how the reply is saved while it streams,
and which status it ends with.

* ``prompt_messages``: stored messages -> the ``ChatMessage``s the backend gets (image names resolved to
  file paths, replies without an answer left out, reasoning kept apart from the answer);
* ``ReplyRecorder``: the assistant reply is appended as ``streaming`` once the backend has accepted the
  turn, re-saved at most every ``save_interval_s`` seconds while it streams (``kill -9`` loses at most that
  much) and finished with its status and notice; a save the disk refuses (``HistoryUnavailable``: folder not
  writable, disk full) does not stop the reply: it is noted in ``failure`` and tried again (``save_later``);
* ``reply_status``: the status a finished stream is saved with (through ``records.STATUS_OF_FINISH``), with
  the "interrupted" rule: a stream the engine ended as ``cancelled`` although nobody pressed Stop was ended
  by a service shutdown;
* ``shown_status``: a saved reply still marked ``streaming`` that is not being written right now is shown
  as interrupted;
* ``settings_record`` (the settings saved with the conversation) and ``wait_settled`` (the conversation
  once its last reply is no longer ``streaming``).

``history`` arguments are ``store.UserHistory`` objects.  No torch, no Gradio.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

from qwen_chat.chat_types import ChatError, ChatMessage, GenerationSettings, StreamUpdate, is_blank
from qwen_chat.history.errors import HistoryUnavailable
from qwen_chat.history.records import INTERRUPTED, STATUS_OF_FINISH, STREAMING, Conversation

log = logging.getLogger(__name__)

#: Status of a reply whose stream ended without a finish reason (closed by Stop or a closed tab).
STOPPED = STATUS_OF_FINISH["cancelled"]
#: A reply whose final save failed is saved again every SAVE_RETRY_S seconds for SAVE_RETRY_FOR_S seconds at
#: most (``ReplyRecorder.save_later``): once the folder is writable again it is saved with its real status.
SAVE_RETRY_S = 2.0
SAVE_RETRY_FOR_S = 3600.0


def reply_status(finish_reason: Optional[str], stopped_by_user: bool) -> str:
    """The saved status of a reply whose stream ended with ``finish_reason`` (None: no final update).

    ``stopped_by_user``: the turn's ``CancelToken`` was cancelled (Stop pressed, page closed).  A ``cancelled``
    finish without it means the engine drained the stream because the service is shutting down (Supervisor
    restart, SIGTERM): ``interrupted``.
    """
    if finish_reason == "cancelled" and not stopped_by_user:
        return INTERRUPTED
    return STATUS_OF_FINISH.get(finish_reason or "", STOPPED)


def shown_status(message: Any, live: bool) -> str:
    """The status to show for a saved (or live) message: ``streaming`` reads as interrupted unless ``live``
    (the reply being written right now); a message without a status is complete."""
    status = getattr(message, "status", "complete") or "complete"
    return INTERRUPTED if status == STREAMING and not live else status


def prompt_messages(messages: Sequence[Any], history: Any, system_prompt: str) -> list[ChatMessage]:
    """Stored messages -> ``ChatMessage``s for the backend.

    The system prompt comes first unless it is blank (``chat_types.is_blank``); user messages keep their
    images as file paths (``history.image_path``); assistant replies without an answer are left out.

    Raises:
        InvalidInput: an image reference is not (any more) stored for this user.
    """
    prompt = [ChatMessage(role="system", text=system_prompt)] if not is_blank(system_prompt) else []
    for msg in messages:
        if msg.role == "user":
            prompt.append(ChatMessage(role="user", text=msg.text,
                                      images=tuple(str(history.image_path(r)) for r in msg.images)))
        elif msg.role == "assistant" and msg.text:
            prompt.append(ChatMessage(role="assistant", text=msg.text, reasoning=msg.reasoning))
    return prompt


def settings_record(settings: GenerationSettings, system_prompt: str) -> dict:
    """The settings saved with a conversation (plain JSON values; reopened by the UI)."""
    return {
        "system_prompt": system_prompt or "",
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "presence_penalty": settings.presence_penalty,
        "seed": settings.seed,
        "enable_thinking": settings.enable_thinking,
        "thinking_token_budget": settings.thinking_token_budget,
    }


class ReplyRecorder:
    """Saves one assistant reply of conversation ``conv_id`` while it streams.

    Constructing it appends an empty ``streaming`` reply (raises what ``append_message`` raises);
    ``progress`` re-saves the texts at most every ``save_interval_s`` seconds; ``finish`` saves the end.
    The reply is addressed by its ``MessageRef``, so another tab changing the conversation meanwhile never
    makes it overwrite a different message.  ``failure``: the message of the last save the disk refused
    (``HistoryUnavailable``, no server path), "" while saves succeed; the saved file then keeps its last good
    version (writes are atomic).
    """

    def __init__(self, history: Any, conv_id: str, save_interval_s: float) -> None:
        self.history = history
        self.conv_id = conv_id
        self.save_interval_s = save_interval_s
        self.ref = history.append_message(conv_id, role="assistant", text="", status=STREAMING)
        self._last_save = time.monotonic()
        self.failure = ""
        self._final: dict = {}  # what ``finish`` saves, kept for ``save_later``

    def progress(self, update: StreamUpdate, stats: Optional[dict] = None) -> None:
        """Save ``update``'s texts (still ``streaming``) and ``stats`` (``reply_stats`` record) if
        ``save_interval_s`` has passed since the last save."""
        now = time.monotonic()
        if now - self._last_save >= self.save_interval_s:
            self._last_save = now
            self._save(text=update.answer, reasoning=update.reasoning, status=STREAMING, stats=stats)

    def finish(self, update: StreamUpdate, status: str, notice: str, stats: Optional[dict] = None) -> bool:
        """Save the final texts with ``status``, ``notice`` and ``stats``.  Returns False when the disk refused
        it (``failure`` says why; ``save_later`` tries again); a conversation deleted meanwhile is logged only."""
        self._final = dict(text=update.answer, reasoning=update.reasoning, status=status, notice=notice,
                           stats=stats)
        return self._save(**self._final)

    def save_later(self) -> bool:
        """After a ``finish`` that returned False: save the final state again every ``SAVE_RETRY_S`` seconds
        until it is saved (True) or ``SAVE_RETRY_FOR_S`` seconds passed (False; a restart then shows the reply
        as saved last, *interrupted*)."""
        deadline = time.monotonic() + SAVE_RETRY_FOR_S
        while time.monotonic() < deadline:
            time.sleep(SAVE_RETRY_S)
            if self._save(**self._final):
                log.info("reply of conversation %s saved after the history folder came back", self.conv_id)
                return True
        return False

    def _save(self, **fields) -> bool:
        try:
            self.history.update_message(self.conv_id, self.ref, **fields)
        except HistoryUnavailable as e:
            if not self.failure:
                log.warning("reply of conversation %s: %s; trying again", self.conv_id, e)
            self.failure = str(e)
            return False
        except ChatError as e:  # the conversation was deleted meanwhile: nothing left to save into
            log.warning("reply of conversation %s not saved: %s", self.conv_id, e)
        self.failure = ""
        return True


def wait_settled(history: Any, conv_id: str, timeout_s: float) -> Conversation:
    """The conversation once its last message is no longer ``streaming`` (e.g. just after Stop).

    Polls the saved file every 50 ms for at most ``timeout_s`` seconds (the stopped generator saves its final
    state as it closes), then returns what is saved.  Raises what ``history.load`` raises.
    """
    deadline = time.monotonic() + timeout_s
    conv = history.load(conv_id)
    while conv.messages and shown_status(conv.messages[-1], live=True) == STREAMING \
            and time.monotonic() < deadline:
        time.sleep(0.05)
        conv = history.load(conv_id)
    return conv
