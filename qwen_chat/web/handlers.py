"""What the chat UI does, as plain functions and one controller class (no Gradio objects, no torch).

``ui.py`` lays the page out and wires its events to ``ChatController``; everything that decides something
lives here so it can be tested without a browser:

* ``safe_markdown`` makes user/model text inert before it reaches the Chatbot's Markdown renderer (C25);
* ``is_blank`` decides whether a message is empty (C15);
* ``ChatController.send`` normalises images before anything is saved (C06-C09), saves the user turn and a
  ``streaming`` assistant turn through the history store's merge-safe operations, streams the backend's
  reply, re-saves it about once a second, and finishes it as ``complete``/``stopped``/``length``/``error``
  (C19, C21, C22).  It always appends to the conversation as it is *on disk*, so a page left open across a
  restart never overwrites newer history.

Errors meant for the user are ``qwen_chat.chat_types.ChatError`` subclasses; ``ui.py`` shows their message.
"""
from __future__ import annotations

import itertools
import logging
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from qwen_chat.chat_types import (
    CancelToken,
    ChatBackend,
    ChatError,
    ChatMessage,
    GenerationSettings,
    InvalidImage,
    InvalidInput,
    StreamUpdate,
)
from qwen_chat.history.records import StoredMessage
from qwen_chat.images import ImageLimits, normalize_image

log = logging.getLogger(__name__)

LOCAL_USER = "local"
# Characters that render as nothing; a message made only of these and whitespace is empty (C15).
_INVISIBLE = re.compile("[\\s\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e]+")
# Markdown/HTML constructs that must stay literal text (see ``safe_markdown``).
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_UNSAFE_LINK = re.compile(r"\]\(\s*<?\s*(?:javascript|vbscript|data|file):", re.IGNORECASE)

STATUS_STREAMING = "streaming"
STATUS_LABELS = {
    "stopped": "stopped by the user",
    "length": "token limit reached",
    "error": "generation failed",
    "interrupted": "interrupted: the service stopped before this reply finished",
}
FINISH_TO_STATUS = {"stop": "complete", "length": "length", "cancelled": "stopped", "error": "error"}


def is_blank(text: Optional[str]) -> bool:
    """True when ``text`` is None or only whitespace / zero-width characters (U+200B/C/D, U+2060, U+FEFF...)."""
    return not text or not _INVISIBLE.sub("", text)


def _escape_plain(text: str) -> str:
    """Escape a non-code Markdown segment: HTML stays literal, images never load, script links stay text."""
    text = text.replace("&", "&amp;").replace("<", "&lt;")
    text = text.replace("![", "!\\[")  # no remote image loads from model output
    return _UNSAFE_LINK.sub(lambda m: "]\\(" + m.group(0)[2:], text)


def _escape_inline(line: str) -> str:
    """Escape one line outside fenced code, leaving inline code spans (which Markdown escapes itself) alone."""
    out, i = [], 0
    while i < len(line):
        start = line.find("`", i)
        if start < 0:
            out.append(_escape_plain(line[i:]))
            break
        run = len(line[start:]) - len(line[start:].lstrip("`"))
        closing = re.compile(r"(?<!`)" + "`" * run + r"(?!`)")
        close = closing.search(line, start + run)
        if close is None:  # unmatched backticks are literal text
            out.append(_escape_plain(line[i:start + run]))
            i = start + run
            continue
        out.append(_escape_plain(line[i:start]))
        out.append(line[start:close.end()])
        i = close.end()
    return "".join(out)


def safe_markdown(text: str) -> str:
    """Return Markdown that displays ``text`` literally where it is HTML, and never runs or loads anything.

    Outside code spans and fenced code blocks, ``&`` and ``<`` become entities (so ``<img onerror=...>`` and
    ``<script>`` show as typed), Markdown images are disabled (no network request) and links to
    ``javascript:``/``vbscript:``/``data:``/``file:`` are shown as text.  Code keeps its content, because the
    Markdown renderer escapes code itself.  ``$`` needs no escaping: the Chatbot is built with LaTeX off.
    The Chatbot's own ``sanitize_html`` stays on as a second layer.  Known cosmetic limit: inside an
    *indented* (not fenced) code block the entities show as ``&lt;``.
    """
    lines = text.split("\n")
    out: list[str] = []
    fence: Optional[str] = None
    for line in lines:
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                out.append(line)
            else:
                out.append(_escape_inline(line))
        else:
            out.append(line)
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
                fence = None
    return "\n".join(out)


def preset_values(thinking: bool) -> tuple[float, float, int, float]:
    """(temperature, top_p, top_k, presence_penalty) of the Qwen3.5 preset for the mode (``chat_types``)."""
    p = GenerationSettings.preset(bool(thinking))
    return p.temperature, p.top_p, p.top_k, p.presence_penalty


def parse_seed(value: Any) -> Optional[int]:
    """Seed box value -> None (empty: fresh random seed) or an int.  Raises ``InvalidInput`` otherwise."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"seed must be a whole number in [0, 2**63-1], got {value!r}") from None
    if number != number or number != int(number):
        raise InvalidInput(f"seed must be a whole number in [0, 2**63-1], got {value!r}")
    return int(number)


def build_settings(thinking: bool, max_new_tokens: Any, temperature: Any, top_p: Any, top_k: Any,
                   presence_penalty: Any, seed: Any) -> GenerationSettings:
    """Validated ``GenerationSettings`` from the UI controls.  Raises ``InvalidInput`` naming the bad value."""
    try:
        settings = GenerationSettings(
            max_new_tokens=int(max_new_tokens) if float(max_new_tokens) == int(float(max_new_tokens))
            else float(max_new_tokens),
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k) if float(top_k) == int(float(top_k)) else float(top_k),
            presence_penalty=float(presence_penalty),
            seed=parse_seed(seed),
            enable_thinking=bool(thinking),
        )
    except (TypeError, ValueError, OverflowError):
        raise InvalidInput("every sampling control needs a number") from None
    return settings.validate()


def view_path(path: Path) -> str:
    """A copy of a stored image under the system temp folder, which Gradio may serve; returns its path.

    History folders are never exposed to Gradio's file route (no ``allowed_paths``): Gradio copies files from
    the temp folder into its own cache under unguessable content-hash names.
    """
    target_dir = Path(tempfile.gettempdir()) / "qwen_chat_view"
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / Path(path).name
    if not target.exists():
        tmp = target.with_suffix(target.suffix + f".{time.monotonic_ns()}.tmp")
        shutil.copyfile(path, tmp)
        tmp.replace(target)
    return str(target)


@dataclass
class Session:
    """Per-browser-tab state (kept in ``gr.State``): the cancel token of the reply now streaming, if any."""

    cancel: Optional[CancelToken] = None


@dataclass
class TurnView:
    """One UI update while a turn streams: the Chatbot messages, the conversation id and a notice line."""

    messages: list[dict]
    conv_id: str
    notice: str = ""
    done: bool = False


def _status_of(msg: Any) -> str:
    return getattr(msg, "status", "complete") or "complete"


def chatbot_messages(messages: Sequence[Any], image_path, live_index: Optional[int] = None) -> list[dict]:
    """Stored messages -> Gradio Chatbot "messages" dicts (text made safe, images as file dicts).

    ``image_path(ref) -> Path`` resolves a stored image reference.  A message whose status is still
    ``streaming`` is shown as interrupted unless it is ``live_index`` (the reply streaming right now).
    Reasoning goes into a collapsible thought message (``metadata.title``), marked unfinished when the reply
    ended inside it.
    """
    out: list[dict] = []
    for index, msg in enumerate(messages):
        if msg.role == "system":
            continue
        if msg.role == "user":
            content: list[dict] = []
            for ref in msg.images:
                try:
                    content.append({"path": view_path(image_path(ref))})
                except (ChatError, OSError):  # deleted or unreadable file: the rest still opens
                    content.append({"type": "text", "text": "*[image no longer available]*"})
            if msg.text:
                content.append({"type": "text", "text": safe_markdown(msg.text)})
            if content:
                out.append({"role": "user", "content": content})
            continue
        status = _status_of(msg)
        live = index == live_index
        if status == STATUS_STREAMING and not live:
            status = "interrupted"
        if msg.reasoning:
            unfinished = not msg.text and status != "complete"
            title = "Thinking (unfinished)" if unfinished and not live else "Thinking"
            out.append({
                "role": "assistant",
                "content": [{"type": "text", "text": safe_markdown(msg.reasoning)}],
                "metadata": {"title": title, "status": "pending" if live and not msg.text else "done"},
            })
        text = safe_markdown(msg.text) if msg.text else ""
        if status in STATUS_LABELS:
            note = getattr(msg, "notice", "") or ""
            label = STATUS_LABELS[status] + (f" ({safe_markdown(note)})" if note and status == "error" else "")
            text = (text + "\n\n" if text else "") + f"*[{label}]*"
        if text:
            out.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
    return out


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
    def conversation_choices(self, user_id: str) -> list[tuple[str, str]]:
        """(label, conversation id) pairs, newest first, for the sidebar list."""
        return [(self._label(c), c.id) for c in self.store.user(user_id).list()]

    @staticmethod
    def _label(summary: Any) -> str:
        title = (summary.title or "New chat").replace("\n", " ").strip()
        return title if len(title) <= 60 else title[:57] + "..."

    def open(self, user_id: str, conv_id: str) -> tuple[list[dict], str, str]:
        """Reopen a saved conversation: (chatbot messages, conversation id, system prompt).

        Raises ``InvalidInput`` (from the store) when it does not exist or is not this user's.
        """
        history = self.store.user(user_id)
        conv = history.load(conv_id)
        return chatbot_messages(conv.messages, history.image_path), conv.id, self._system_prompt(conv)

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

        Runs before anything is saved, so a bad image leaves history untouched (C06-C09).
        """
        if len(files) > self.max_images_per_turn:
            raise InvalidImage(f"at most {self.max_images_per_turn} images per message, got {len(files)}")
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

        Empty/whitespace/zero-width text without images yields nothing and saves nothing (C15).  Raises
        ``ChatError`` for bad images and settings (before anything is shown or saved) and for backend refusals
        (``ContextTooLong``, ``Busy``, ``NotReady``, raised before the first token); nothing is saved then
        either, so the next turn starts from the same history.  The user turn and a ``streaming`` reply are
        appended to the conversation *as saved on disk* (a stale page merges, C22) as soon as the first
        update arrives; the reply is re-saved every ``save_interval_s`` and finished with its status.
        """
        text = "" if is_blank(text) else (text or "").strip()
        if not text and not files:
            return
        self._check_idle(session)
        settings = settings.validate()
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
        settings = settings.validate()
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

    @staticmethod
    def _check_idle(session: Session) -> None:
        """One reply at a time per browser tab: a second Send/Regenerate while one streams is refused."""
        if session.cancel is not None and not session.cancel.cancelled:
            raise InvalidInput("a reply is still being written: wait for it or press Stop")

    @staticmethod
    def _settings_dict(settings: GenerationSettings, system_prompt: str) -> dict:
        return {
            "system_prompt": system_prompt or "",
            "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
            "presence_penalty": settings.presence_penalty,
            "seed": settings.seed,
            "enable_thinking": settings.enable_thinking,
        }

    @staticmethod
    def _prompt(messages: Sequence[StoredMessage], history: Any, system_prompt: str) -> list[ChatMessage]:
        """Stored messages -> ``ChatMessage``s for the backend (replies without an answer are left out)."""
        prompt = [ChatMessage(role="system", text=system_prompt)] if not is_blank(system_prompt) else []
        for msg in messages:
            if msg.role == "user":
                prompt.append(ChatMessage(role="user", text=msg.text,
                                          images=tuple(str(history.image_path(r)) for r in msg.images)))
            elif msg.role == "assistant" and msg.text:
                prompt.append(ChatMessage(role="assistant", text=msg.text, reasoning=msg.reasoning))
        return prompt

    def _generate(self, history: Any, conv_id: str, messages: list, system_prompt: str,
                  settings: GenerationSettings, session: Session, notes: str, save_turn) -> Iterator[TurnView]:
        """Start the backend, show the pending turn, save it on the first update, then stream (see ``send``)."""
        prompt = self._prompt(messages, history, system_prompt)
        pending = _Live(text="", reasoning="")
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
        history.set_settings(conv_id, self._settings_dict(settings, system_prompt))
        reply = history.append_message(conv_id, role="assistant", text="", status=STATUS_STREAMING)
        yield from self._stream(history, conv_id, reply, messages, first, stream, cancel, session, notes)

    def _stream(self, history: Any, conv_id: str, reply: Any, messages: list, first: Optional[StreamUpdate],
                stream: Iterator[StreamUpdate], cancel: CancelToken, session: Session,
                notes: str) -> Iterator[TurnView]:
        last = StreamUpdate()
        status, error_text = "stopped", ""
        last_save = last_ui = time.monotonic()
        updates = itertools.chain([first] if first is not None else [], stream)
        try:
            for update in updates:
                last = update
                now = time.monotonic()
                if update.done:
                    break
                if now - last_save >= self.save_interval_s:
                    history.update_message(conv_id, reply, text=update.answer, reasoning=update.reasoning,
                                           status=STATUS_STREAMING)
                    last_save = now
                if now - last_ui >= self.ui_interval_s:
                    last_ui = now
                    live = _Live(text=update.answer, reasoning=update.reasoning)
                    yield TurnView(chatbot_messages(messages + [live], history.image_path, len(messages)),
                                   conv_id, " ".join(x for x in (notes, update.notice) if x))
            status = FINISH_TO_STATUS.get(last.finish_reason or "", "stopped")
            if last.finish_reason == "cancelled" and not cancel.cancelled:
                # Nobody pressed Stop or closed the page: the engine ended the stream because the service is
                # shutting down (Supervisor restart, SIGTERM), which is what "interrupted" means.
                status = "interrupted"
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
            notice = " ".join(x for x in (notes, last.notice, error_text) if x)
            try:
                history.update_message(conv_id, reply, text=last.answer, reasoning=last.reasoning, status=status,
                                       notice=notice)
            except ChatError as e:  # the conversation was deleted meanwhile: nothing left to save into
                log.warning("reply of conversation %s not saved: %s", conv_id, e)
        conv = history.load(conv_id)
        yield TurnView(chatbot_messages(conv.messages, history.image_path), conv_id,
                       " ".join(x for x in (notes, last.notice, error_text) if x), done=True)

    def settled(self, user_id: str, conv_id: str, timeout_s: float = 10.0) -> list[dict]:
        """Chatbot messages of the conversation once its last reply is no longer ``streaming`` (after Stop).

        Polls the saved file every 50 ms for at most ``timeout_s`` seconds (the stopped generator saves its
        final state as it closes), then returns what is saved.  Raises ``InvalidInput`` for a foreign id.
        """
        history = self.store.user(user_id)
        deadline = time.monotonic() + timeout_s
        conv = history.load(conv_id)
        while conv.messages and _status_of(conv.messages[-1]) == STATUS_STREAMING and time.monotonic() < deadline:
            time.sleep(0.05)
            conv = history.load(conv_id)
        return chatbot_messages(conv.messages, history.image_path)

    def stop(self, session: Optional[Session]) -> None:
        """Ask the reply streaming in this session (if any) to stop at the next decode step."""
        if session is not None and session.cancel is not None:
            session.cancel.cancel()


@dataclass(frozen=True)
class _Live:
    """The in-memory view of the reply streaming right now (the fields ``chatbot_messages`` reads)."""

    text: str
    reasoning: str
    role: str = "assistant"
    images: tuple = ()
    status: str = STATUS_STREAMING
    notice: str = ""
