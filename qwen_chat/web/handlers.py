"""What the chat UI does, as plain functions and one controller class (no Gradio objects, no torch).

``ui.py`` lays the page out and wires its events to ``ChatController``; everything that decides something
lives here or in the modules it uses, so it can be tested without a browser:

* ``controls.py`` turns the page's controls into validated ``GenerationSettings`` and holds their defaults;
* ``ChatController.send`` refuses a blank message (``chat_types.is_blank``), normalises images before
  anything is saved (a bad or unsupported image leaves history untouched), saves the user turn and streams
  the backend's reply, saved through ``history.turns.ReplyRecorder`` (``streaming``, re-saved about once a
  second, finished as ``complete``/``stopped``/``interrupted``/``length``/``error``).  It always appends to
  the conversation as it is *on disk*, so a page left open across a restart never overwrites newer history;
  ``regenerate`` and ``edit`` (an edited user message resent) replace the turns after the message;
* rendering (safe Markdown, Chatbot messages) is in ``render.py``.

Errors meant for the user are ``qwen_chat.chat_types.ChatError`` subclasses; ``ui.py`` shows their message.
"""
from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from qwen_chat.chat_types import (
    CancelToken,
    ChatBackend,
    ChatError,
    GenerationSettings,
    InvalidImage,
    InvalidInput,
    StreamUpdate,
    is_blank,
)
from qwen_chat.history.records import StoredMessage
from qwen_chat.history.store import LOCAL_USER
from qwen_chat.history.turns import (
    STOPPED,
    ReplyRecorder,
    prompt_messages,
    reply_status,
    settings_record,
    wait_settled,
)
from qwen_chat.images import ImageLimits, check_image_count, normalize_image
from qwen_chat.web.render import LiveReply, chatbot_messages, conversation_label, stored_index

__all__ = ["LOCAL_USER", "ChatController", "Session", "TurnView"]

log = logging.getLogger(__name__)


@dataclass
class Session:
    """Per-browser-tab state (kept in ``gr.State``): the cancel token of the reply now streaming, if any, and
    the sidebar's search text (every refresh of the list applies it)."""

    cancel: Optional[CancelToken] = None
    query: str = ""


@dataclass
class TurnView:
    """One UI update while a turn streams: the Chatbot messages, the conversation id and a notice line."""

    messages: list[dict]
    conv_id: str
    notice: str = ""
    done: bool = False


class ChatController:
    """The chat UI's behaviour, independent of Gradio.

    Shared by every browser session: it holds only the backend, the history store and fixed limits; all
    per-user state comes in as arguments (user id, conversation id, ``Session``).

    Args:
        backend: a ``ChatBackend`` (the engine, or a scripted fake in tests).
        store: a ``qwen_chat.history.store.HistoryStore``.
        limits: image limits (``qwen_chat.images.ImageLimits``).
        max_images_per_turn: images accepted in one message.
        save_interval_s: seconds between saves of a streaming reply (kill -9 loses at most this much).
        ui_interval_s: seconds between UI updates while streaming (the final update is always sent); each
            update makes Gradio re-hash every image of the conversation, so keep it at 0.1 s or more.
    """

    def __init__(self, backend: ChatBackend, store: Any, limits: ImageLimits = ImageLimits(),
                 max_images_per_turn: int = 8, save_interval_s: float = 1.0, ui_interval_s: float = 0.1):
        self.backend = backend
        self.store = store
        self.limits = limits
        self.max_images_per_turn = max_images_per_turn
        self.save_interval_s = save_interval_s
        self.ui_interval_s = ui_interval_s

    # ----------------------------------------------------------------- conversations (sidebar)
    def conversation_choices(self, user_id: str, query: str = "") -> list[tuple[str, str]]:
        """(label, conversation id) pairs, newest first, for the sidebar list: every conversation, or those whose
        title or text contains ``query`` (case-insensitive).  Labels: ``render.conversation_label``."""
        return [(conversation_label(c), c.id) for c in self.store.user(user_id).list(query)]

    def open(self, user_id: str, conv_id: str) -> tuple[list[dict], str, str, str]:
        """Reopen a saved conversation: (chatbot messages, conversation id, system prompt, title).

        Raises ``InvalidInput`` (from the store) when it does not exist or is not this user's.
        """
        history = self.store.user(user_id)
        conv = history.load(conv_id)
        return (chatbot_messages(conv.messages, history.image_path), conv.id, self._system_prompt(conv),
                conv.title)

    def title(self, user_id: str, conv_id: str) -> str:
        """The saved title of the conversation.  Raises ``InvalidInput`` for an unknown or foreign id."""
        return self.store.user(user_id).load(conv_id).title

    @staticmethod
    def _system_prompt(conv: Any) -> str:
        settings = getattr(conv, "settings", None) or {}
        return str(settings.get("system_prompt", "") or "")

    def rename(self, user_id: str, conv_id: str, title: str) -> None:
        """Rename the conversation.  Raises ``InvalidInput`` for an empty title or a foreign/unknown id."""
        if not conv_id:
            raise InvalidInput("open a conversation first")
        if is_blank(title):
            raise InvalidInput("the new title is empty")
        self.store.user(user_id).rename(conv_id, title.strip())

    def delete(self, user_id: str, conv_id: str) -> None:
        """Delete the conversation (its JSON; images shared with others stay).  Raises ``InvalidInput``."""
        if not conv_id:
            raise InvalidInput("open a conversation first")
        self.store.user(user_id).delete(conv_id)

    def export(self, user_id: str, conv_id: str) -> str:
        """Write a zip of the conversation JSON and its images to a temp file; returns its path."""
        if not conv_id:
            raise InvalidInput("open a conversation first")
        data = self.store.user(user_id).export_zip(conv_id)
        folder = Path(tempfile.mkdtemp(prefix="qwen_chat_export_"))
        path = folder / f"conversation-{conv_id}.zip"
        if isinstance(data, (bytes, bytearray)):
            path.write_bytes(data)
        else:
            shutil.copyfile(data, path)
        return str(path)

    # ----------------------------------------------------------------- one turn
    def prepare_images(self, files: Sequence[Any]) -> list[Any]:
        """Read and normalise uploaded files (paths or dicts with "path").  Raises ``InvalidImage``.

        Runs before anything is saved, so a bad image leaves history untouched.
        """
        check_image_count(len(files), self.max_images_per_turn)
        images = []
        for f in files:
            path = f.get("path") if isinstance(f, dict) else getattr(f, "path", f)
            name = Path(str(path)).name
            try:
                data = Path(path).read_bytes()
            except OSError:
                raise InvalidImage(f"{name}: the upload could not be read") from None
            try:
                images.append(normalize_image(data, self.limits))
            except InvalidImage as e:
                raise InvalidImage(f"{name}: {e}") from None
        return images

    def send(self, user_id: str, conv_id: Optional[str], text: Optional[str], files: Sequence[Any],
             system_prompt: str, settings: GenerationSettings, session: Session) -> Iterator[TurnView]:
        """Stream one turn: yields ``TurnView`` updates; saves the turn once the backend has accepted it.

        ``settings`` come validated (``build_settings``; the backend checks them again).  Blank text
        (``chat_types.is_blank``) without images yields nothing and saves nothing.  Raises ``ChatError`` for
        bad images (before anything is shown or saved) and for backend refusals (``ContextTooLong``, ``Busy``,
        ``NotReady``, bad settings; raised before the first token); nothing is saved then either, so the next
        turn starts from the same history.  The user turn and a ``streaming`` reply are appended to the
        conversation *as saved on disk* (a stale page merges) as soon as the first update arrives; the reply
        is re-saved every ``save_interval_s`` and finished with its status.
        """
        text = "" if is_blank(text) else (text or "").strip()
        if not text and not files:
            return
        self._check_idle(session)
        images = self.prepare_images(files)
        history = self.store.user(user_id)
        conv = history.load(conv_id) if conv_id else None
        refs = [history.put_image(img.png) for img in images]  # content-addressed; needed for the prompt
        earlier = list(conv.messages) if conv is not None else []
        user_msg = StoredMessage.new("user", text, images=refs)
        notes = "; ".join(img.note for img in images if img.note)

        def save_turn() -> str:
            cid = conv.id if conv is not None else history.create().id
            history.append_message(cid, user_msg)
            return cid

        yield from self._generate(history, conv.id if conv else "", earlier + [user_msg], system_prompt,
                                  settings, session, notes, save_turn)

    def regenerate(self, user_id: str, conv_id: Optional[str], system_prompt: str,
                   settings: GenerationSettings, session: Session) -> Iterator[TurnView]:
        """Generate the reply to the last user message again, replacing the replies after it (on disk).

        Raises ``InvalidInput`` when there is no user message yet, and backend refusals as ``send`` does
        (then the old reply stays).
        """
        if not conv_id:
            raise InvalidInput("nothing to regenerate yet")
        self._check_idle(session)
        history = self.store.user(user_id)
        conv = history.load(conv_id)
        last_user = max((i for i, m in enumerate(conv.messages) if m.role == "user"), default=None)
        if last_user is None:
            raise InvalidInput("nothing to regenerate yet")
        user_msg = conv.messages[last_user]

        def save_turn() -> str:
            if last_user + 1 < len(conv.messages):
                history.truncate_from(conv_id, conv.messages[last_user + 1].id)
            return conv_id

        yield from self._generate(history, conv_id, conv.messages[: last_user + 1], system_prompt, settings,
                                  session, "", save_turn)

    def edit(self, user_id: str, conv_id: Optional[str], shown_index: int, text: Optional[str],
             system_prompt: str, settings: GenerationSettings, session: Session) -> Iterator[TurnView]:
        """Resend the user message the Chatbot shows at ``shown_index`` with ``text`` (its images stay) and
        stream a new reply; the messages after it are replaced, on disk once the backend accepted the turn.

        Raises ``InvalidInput`` when no conversation is open, the position is not a user message of the saved
        conversation, or the new text is blank and the message has no images; backend refusals as ``send``
        does (then nothing changes on disk).
        """
        if not conv_id:
            raise InvalidInput("open a conversation first")
        self._check_idle(session)
        history = self.store.user(user_id)
        conv = history.load(conv_id)
        index = stored_index(conv.messages, shown_index)
        if index is None or conv.messages[index].role != "user":
            raise InvalidInput("only your own messages can be edited")
        old = conv.messages[index]
        text = "" if is_blank(text) else (text or "").strip()
        if not text and not old.images:
            raise InvalidInput("the edited message is empty")
        edited = StoredMessage.new("user", text, images=old.images)
        replaced = index + 1 < len(conv.messages)
        notes = "edited message resent: the turns after it were replaced" if replaced else ""

        def save_turn() -> str:
            history.truncate_from(conv_id, old.id, replacement=edited)
            return conv_id

        yield from self._generate(history, conv_id, conv.messages[:index] + [edited], system_prompt, settings,
                                  session, notes, save_turn)

    @staticmethod
    def _check_idle(session: Session) -> None:
        """One reply at a time per browser tab: a second Send/Regenerate while one streams is refused."""
        if session.cancel is not None and not session.cancel.cancelled:
            raise InvalidInput("a reply is still being written: wait for it or press Stop")

    def _generate(self, history: Any, conv_id: str, messages: list, system_prompt: str,
                  settings: GenerationSettings, session: Session, notes: str, save_turn) -> Iterator[TurnView]:
        """Start the backend, show the pending turn, save it on the first update, then stream (see ``send``)."""
        prompt = prompt_messages(messages, history, system_prompt)
        pending = LiveReply(text="", reasoning="")
        yield TurnView(chatbot_messages(messages + [pending], history.image_path, len(messages)), conv_id, notes)
        cancel = CancelToken()
        session.cancel = cancel
        stream: Iterator[StreamUpdate] = iter(())
        try:
            stream = iter(self.backend.stream_chat(prompt, settings, cancel))
            first = next(stream, None)  # engines raise ChatError here at the latest (before any token)
        except BaseException:
            if session.cancel is cancel:
                session.cancel = None
            getattr(stream, "close", lambda: None)()
            raise
        conv_id = save_turn()
        history.set_settings(conv_id, settings_record(settings, system_prompt))
        recorder = ReplyRecorder(history, conv_id, self.save_interval_s)
        yield from self._stream(recorder, messages, first, stream, cancel, session, notes)

    def _stream(self, recorder: ReplyRecorder, messages: list, first: Optional[StreamUpdate],
                stream: Iterator[StreamUpdate], cancel: CancelToken, session: Session,
                notes: str) -> Iterator[TurnView]:
        history, conv_id = recorder.history, recorder.conv_id
        last = StreamUpdate()
        status, error_text = STOPPED, ""
        last_ui = time.monotonic()
        updates = itertools.chain([first] if first is not None else [], stream)
        try:
            for update in updates:
                last = update
                if update.done:
                    break
                recorder.progress(update)
                now = time.monotonic()
                if now - last_ui >= self.ui_interval_s:
                    last_ui = now
                    live = LiveReply(text=update.answer, reasoning=update.reasoning)
                    yield TurnView(chatbot_messages(messages + [live], history.image_path, len(messages)),
                                   conv_id, "; ".join(x for x in (notes, update.notice) if x))
            status = reply_status(last.finish_reason, stopped_by_user=cancel.cancelled)
        except GeneratorExit:
            cancel.cancel()  # the UI's Stop (or a closed tab) closed us: stop the engine too
            raise
        except ChatError as e:
            status, error_text = "error", str(e)
        except Exception as e:  # noqa: BLE001 - an engine fault must not lose the saved turn
            log.exception("generation failed")
            status, error_text = "error", f"{type(e).__name__}: {e}"
        finally:
            getattr(stream, "close", lambda: None)()
            if session.cancel is cancel:
                session.cancel = None
            recorder.finish(last, status, "; ".join(x for x in (notes, last.notice, error_text) if x))
        conv = history.load(conv_id)
        yield TurnView(chatbot_messages(conv.messages, history.image_path), conv_id,
                       "; ".join(x for x in (notes, last.notice, error_text) if x), done=True)

    def settled(self, user_id: str, conv_id: str, timeout_s: float = 10.0) -> list[dict]:
        """Chatbot messages of the conversation once its last reply is no longer ``streaming`` (after Stop).

        Polls the saved file every 50 ms for at most ``timeout_s`` seconds (the stopped generator saves its
        final state as it closes), then returns what is saved.  Raises ``InvalidInput`` for a foreign id.
        """
        history = self.store.user(user_id)
        return chatbot_messages(wait_settled(history, conv_id, timeout_s).messages, history.image_path)

    def stop(self, session: Optional[Session]) -> None:
        """Ask the reply streaming in this session (if any) to stop at the next decode step."""
        if session is not None and session.cancel is not None:
            session.cancel.cancel()
