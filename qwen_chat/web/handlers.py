"""What the chat UI does, as plain functions and one controller class (no Gradio objects, no torch).

``ui.py`` lays the page out and wires its events to ``ChatController``; everything that decides something
lives here or in the modules it uses, so it can be tested without a browser:

* ``controls.py`` turns the page's controls into validated ``GenerationSettings`` and holds their defaults;
* ``ChatController.send`` refuses a blank message (``chat_types.is_blank``), normalises images before
  anything is saved (a bad or unsupported image leaves history untouched), saves the user turn and streams
  the backend's reply, saved through ``history.turns.ReplyRecorder`` (``streaming``, re-saved about once a
  second, finished as ``complete``/``stopped``/``interrupted``/``length``/``error``, with its statistics).
  The reply runs in its own thread (``live_turns``): closing the event that shows it (New chat, another
  conversation) leaves it running; Stop or a closed tab (``close_tab``) stops it.  It appends to the conversation
  as it is *on disk* (a page left open across a restart never overwrites newer history); ``regenerate`` and
  ``edit`` put a new version in place of the message, keeping the earlier one (``history.branches``: ``< 2/3 >``);
* rendering (safe Markdown, Chatbot messages) is in ``render.py``.

Errors meant for the user are ``qwen_chat.chat_types.ChatError`` subclasses; ``ui.py`` shows their message.
"""
from __future__ import annotations

import io
import logging
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from qwen_chat.chat_types import (
    CancelToken,
    ChatBackend,
    GenerationSettings,
    InvalidImage,
    InvalidInput,
    StreamUpdate,
    is_blank,
)
from qwen_chat.history.branches import keep_and_replace
from qwen_chat.history.export_md import conversation_markdown, download_name
from qwen_chat.history.records import StoredMessage
from qwen_chat.history.reply_stats import ReplyStats
from qwen_chat.history.store import LOCAL_USER
from qwen_chat.history.turns import ReplyRecorder, prompt_messages, settings_record, wait_settled
from qwen_chat.images import ImageLimits, check_image_count, normalize_image
from qwen_chat.web import file_access
from qwen_chat.web.controls import with_session_choices
from qwen_chat.web.live_turns import LiveTurn, LiveTurns, watch
from qwen_chat.web.render import LiveReply, chatbot_messages, stored_index
from qwen_chat.web.sidebar import RUNNING_MARK, list_entries
from qwen_chat.web.stats_view import stats_line
from qwen_chat.web.tab_state import Session

__all__ = ["LOCAL_USER", "RUNNING_MARK", "ChatController", "Session", "TurnView"]

log = logging.getLogger(__name__)


@dataclass
class TurnView:
    """One UI update while a turn streams: the Chatbot messages, the conversation id and a notice line;
    ``saved``: the first update after the turn was saved (its conversation is now the newest in the list and
    has a running reply); ``done``: the last one."""

    messages: list[dict]
    conv_id: str
    notice: str = ""
    done: bool = False
    saved: bool = False


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
        self.live = LiveTurns()

    # ----------------------------------------------------------------- conversations (sidebar)
    def conversation_choices(self, user_id: str, query: str = "", tag: str = "") -> list[tuple[str, str]]:
        """(label, conversation id) pairs for the sidebar list, pinned first, then newest first: every
        conversation, or those whose title or text contains ``query`` (case-insensitive) and that carry ``tag``
        ("": any).  Labels: ``sidebar.entry_label`` (``RUNNING_MARK`` on those whose reply is being written)."""
        return list_entries(self.store.user(user_id).list(query), tag, self.live.running(user_id))

    def open(self, user_id: str, conv_id: str) -> tuple[list[dict], str, str, str]:
        """Reopen a saved conversation: (chatbot messages, conversation id, system prompt, title).

        Raises ``InvalidInput`` (from the store) when it does not exist or is not this user's.
        """
        history = self.store.user(user_id)
        conv = history.load(conv_id)
        live = self.live_messages(user_id, conv_id, conv)
        shown = live if live is not None else chatbot_messages(self.live.shown(user_id, conv), history.image_path)
        return shown, conv.id, self._system_prompt(conv), conv.title

    def live_messages(self, user_id: str, conv_id: str, conv: Any = None) -> Optional[list[dict]]:
        """Chatbot messages of ``conv_id`` with its running reply as it is now (texts and statistics), or None
        when no reply runs there.  Raises ``InvalidInput`` for an unknown or foreign id."""
        turn = self.live.find(user_id, conv_id)
        if turn is None:
            return None
        history = self.store.user(user_id)
        conv = conv if conv is not None else history.load(conv_id)
        _, update, stats, done = turn.snapshot()
        index = conv.index_of(turn.recorder.ref.message_id) if not done else None
        if index is None:
            return None
        live = LiveReply(text=update.answer, reasoning=update.reasoning, stats=stats)
        return chatbot_messages(conv.messages[:index] + [live], history.image_path, index)

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
        folder = Path(tempfile.mkdtemp(prefix=file_access.EXPORT_PREFIX, dir=file_access.temp_root()))
        path = folder / f"conversation-{conv_id}.zip"
        if isinstance(data, (bytes, bytearray)):
            path.write_bytes(data)
        else:
            shutil.copyfile(data, path)
        file_access.grant(user_id, path)  # the file route serves it to this user only
        return str(path)

    def download(self, user_id: str, conv_id: str) -> str:
        """The conversation as one zip named after its title (``<title>.zip``: ``<title>.md``,
        ``conversation.json`` and ``images/``), written in this user's temporary folder (one file per
        conversation, replaced by the next download); returns its path.  Raises ``InvalidInput``."""
        if not conv_id:
            raise InvalidInput("open a conversation first")
        history = self.store.user(user_id)
        conv = history.load(conv_id)
        data = history.export_zip(conv_id)
        folder = file_access.temp_root() / file_access.DOWNLOAD_DIR / conv.id
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.zip"):
            old.unlink(missing_ok=True)
        path = folder / download_name(conv.title, ".zip")
        with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(path, "w") as target:
            for item in source.infolist():
                target.writestr(item, source.read(item))
            target.writestr(download_name(conv.title, ".md"), conversation_markdown(conv, stats_line))
        file_access.grant(user_id, path)  # the file route serves it to this user only
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
        self.live.check_room(user_id, conv_id, session.tab)
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
        """Generate the reply to the last user message again; the earlier reply (with anything after it) is kept
        as an earlier version (``history.branches.keep_and_replace``).

        Raises ``InvalidInput`` when there is no user message yet, and backend refusals as ``send`` does
        (then the old reply stays).
        """
        if not conv_id:
            raise InvalidInput("nothing to regenerate yet")
        self._check_idle(session)
        self.live.check_room(user_id, conv_id, session.tab)
        history = self.store.user(user_id)
        conv = history.load(conv_id)
        last_user = max((i for i, m in enumerate(conv.messages) if m.role == "user"), default=None)
        if last_user is None:
            raise InvalidInput("nothing to regenerate yet")

        def save_turn() -> str:
            if last_user + 1 < len(conv.messages):
                keep_and_replace(history, conv_id, conv.messages[last_user + 1].id)
            return conv_id

        yield from self._generate(history, conv_id, conv.messages[: last_user + 1], system_prompt, settings,
                                  session, "", save_turn)

    def edit(self, user_id: str, conv_id: Optional[str], shown_index: int, text: Optional[str],
             system_prompt: str, settings: GenerationSettings, session: Session) -> Iterator[TurnView]:
        """Resend the user message the Chatbot shows at ``shown_index`` with ``text`` (its images stay) and
        stream a new reply; the earlier version and the messages after it are kept as an earlier version
        (``history.branches``), on disk once the backend accepted the turn.

        Raises ``InvalidInput`` when no conversation is open, the position is not a user message of the saved
        conversation, or the new text is blank and the message has no images; backend refusals as ``send``
        does (then nothing changes on disk).
        """
        if not conv_id:
            raise InvalidInput("open a conversation first")
        self._check_idle(session)
        self.live.check_room(user_id, conv_id, session.tab)
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
        notes = "edited message resent: the earlier version is kept (switch with < > on the message)" \
            if replaced else ""

        def save_turn() -> str:
            keep_and_replace(history, conv_id, old.id, edited)
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
        """Start the backend, show the pending turn, save it on the first update, then run the reply in its
        own thread (``live_turns.LiveTurn``) and show it as it grows (see ``send``)."""
        settings = with_session_choices(settings, session)
        prompt = prompt_messages(messages, history, system_prompt)
        cancel = CancelToken()
        session.cancel = cancel
        if session.stop_asked:  # Stop came before this turn had its token (``Session.ask_stop``)
            session.stop_asked = False
            cancel.cancel()
        pending = LiveReply(text="", reasoning="")
        stream: Iterator[StreamUpdate] = iter(())
        try:
            yield TurnView(chatbot_messages(messages + [pending], history.image_path, len(messages)), conv_id,
                           notes)
            stats = ReplyStats()
            stream = iter(self.backend.stream_chat(prompt, settings, cancel))
            first = next(stream, None)  # engines raise ChatError here at the latest (before any token)
        except BaseException:
            if session.cancel is cancel:
                session.cancel = None
            getattr(stream, "close", lambda: None)()
            raise
        try:
            conv_id = save_turn()
            history.set_settings(conv_id, {**settings_record(settings, system_prompt), "preset": session.preset})
            recorder = ReplyRecorder(history, conv_id, self.save_interval_s)
        except BaseException:
            cancel.cancel()
            getattr(stream, "close", lambda: None)()
            if session.cancel is cancel:
                session.cancel = None
            raise

        def ended(turn: LiveTurn) -> None:
            self.live.forget(turn)
            if session.cancel is cancel:
                session.cancel = None

        turn = LiveTurn(history.user_id, conv_id, session.tab, recorder, stats, first, stream, cancel, notes, ended)
        self.live.add(turn)
        yield from self._watch(turn, history, messages, session)

    def _watch(self, turn: LiveTurn, history: Any, messages: list, session: Session) -> Iterator[TurnView]:
        """Show ``turn`` as it grows, then as saved (as generated when the disk refused its last save:
        ``LiveTurn.unsaved``); closing this generator leaves the turn running."""
        session.watching, since = turn.conv_id, time.monotonic()
        first = True
        try:
            for update, stats in watch(turn, self.ui_interval_s):
                if self.live.left_since(session.tab, since):  # the tab moved on (New chat): draw no more
                    return
                live = LiveReply(text=update.answer, reasoning=update.reasoning, stats=stats)
                yield TurnView(chatbot_messages(messages + [live], history.image_path, len(messages)),
                               turn.conv_id, "; ".join(x for x in (turn.notes, update.notice, turn.save_note()) if x),
                               saved=first)
                first = False
        finally:
            if session.watching == turn.conv_id:
                session.watching = ""
        shown = self.live.shown(history.user_id, history.load(turn.conv_id))
        yield TurnView(chatbot_messages(shown, history.image_path), turn.conv_id, turn.notice, done=True)

    def close_tab(self, tab: str) -> int:
        """Stop the replies browser tab ``tab`` started (the tab was closed); returns how many."""
        return self.live.close_tab(tab)

    def settled(self, user_id: str, conv_id: str, timeout_s: float = 10.0) -> list[dict]:
        """Chatbot messages of the conversation once its last reply is no longer ``streaming`` (after Stop).

        Waits at most ``timeout_s`` seconds for the reply's turn to end, then as long for the saved file
        (polled every 50 ms: a turn still starting saves its final state as it closes); a reply whose final
        save the disk refused is shown as generated.  Raises ``InvalidInput`` for a foreign id.
        """
        history = self.store.user(user_id)
        turn = self.live.find(user_id, conv_id)
        if turn is not None:
            turn.wait_done(timeout_s)
        unsaved = self.live.unsaved(user_id, conv_id) is not None
        conv = history.load(conv_id) if unsaved else wait_settled(history, conv_id, timeout_s)
        return chatbot_messages(self.live.shown(user_id, conv), history.image_path)

    def stop(self, session: Optional[Session]) -> None:
        """Ask the reply of this session to stop at the next decode step (a turn still starting: once it has its
        cancel token, ``Session.ask_stop``)."""
        if session is not None:
            session.ask_stop()
