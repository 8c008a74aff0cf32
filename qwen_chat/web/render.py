"""What the chat page shows: text made inert before the Markdown renderer, stored turns as Chatbot messages.

* ``safe_markdown`` makes user/model text inert: HTML typed into the chat (or echoed by the model) shows as
  typed and never runs, no remote image loads, no script links;
* ``chatbot_messages`` turns stored messages (and the reply streaming now, ``LiveReply``) into Gradio
  Chatbot "messages" dicts, with the reasoning in a collapsible block and the status label of the reply
  (``history.records.STATUS_LABELS``);
  ``stored_index`` maps a shown position back to the stored message (for the Chatbot's edit event) and
  ``plain_text`` turns a shown text back into what was typed;
* ``conversation_label``: a sidebar entry (title and date);
* ``view_path`` copies a stored image where Gradio may serve it.

No Gradio objects here (plain dicts), no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from qwen_chat.chat_types import ChatError
from qwen_chat.history.files import write_atomic
from qwen_chat.history.records import DEFAULT_TITLE, STATUS_LABELS, STREAMING
from qwen_chat.history.turns import shown_status
from qwen_chat.web.math_render import DisplayDollars, display_dollar_positions, dollar_math
from qwen_chat.web.stats_view import is_stats_message, stats_message

# Markdown/HTML constructs that must stay literal text (see ``safe_markdown``).
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_UNSAFE_LINK = re.compile(r"\]\(\s*<?\s*(?:javascript|vbscript|data|file):", re.IGNORECASE)
_ESCAPED_LINK = re.compile(r"\]\\\(\s*<?\s*(?:javascript|vbscript|data|file):", re.IGNORECASE)
_ENTITY = re.compile(r"&(lt|amp);")


def _escape_plain(text: str) -> str:
    """Escape a non-code Markdown segment: HTML stays literal, images never load, script links stay text."""
    text = text.replace("&", "&amp;").replace("<", "&lt;")
    text = text.replace("![", "!\\[")  # no remote image loads from model output
    return _UNSAFE_LINK.sub(lambda m: "]\\(" + m.group(0)[2:], text)


def _unescape_plain(text: str) -> str:
    """Undo ``_escape_plain`` on a non-code segment."""
    text = _ESCAPED_LINK.sub(lambda m: "](" + m.group(0)[3:], text).replace("!\\[", "![")
    return _ENTITY.sub(lambda m: "<" if m.group(1) == "lt" else "&", text)


def _escape_inline(line: str, plain: Callable[[str], str]) -> str:
    """Apply ``plain`` to one line outside fenced code, leaving inline code spans (which Markdown escapes
    itself) alone."""
    out, i = [], 0
    while i < len(line):
        start = line.find("`", i)
        if start < 0:
            out.append(plain(line[i:]))
            break
        run = len(line[start:]) - len(line[start:].lstrip("`"))
        closing = re.compile(r"(?<!`)" + "`" * run + r"(?!`)")
        close = closing.search(line, start + run)
        if close is None:  # unmatched backticks are literal text
            out.append(plain(line[i:start + run]))
            i = start + run
            continue
        out.append(plain(line[i:start]))
        out.append(line[start:close.end()])
        i = close.end()
    return "".join(out)


def _outside_code(text: str, plain: Callable[[str], str]) -> str:
    """``text`` with ``plain`` applied to every part outside fenced code blocks and inline code spans."""
    out: list[str] = []
    fence: Optional[str] = None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                out.append(line)
            else:
                out.append(_escape_inline(line, plain))
        else:
            out.append(line)
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
                fence = None
    return "\n".join(out)


def safe_markdown(text: str, math: bool = False) -> str:
    """Return Markdown that displays ``text`` literally where it is HTML, and never runs or loads anything.

    Outside code spans and fenced code blocks, ``&`` and ``<`` become entities (so ``<img onerror=...>`` and
    ``<script>`` show as typed), Markdown images are disabled (no network request) and links to
    ``javascript:``/``vbscript:``/``data:``/``file:`` are shown as text.  Code keeps its content, because the
    Markdown renderer escapes code itself.  ``math``: also write the ``$...$`` spans that are math
    (``math_render.dollar_math``) as inline-math delimiters and ``$$...$$`` as display ones
    (``math_render.DisplayDollars``), outside code only; a single ``$`` is never a
    delimiter in the browser, so dollar amounts stay text either way.  The Chatbot's own ``sanitize_html``
    stays on as a second layer.  Known cosmetic limit: inside an *indented* (not fenced) code block the
    entities show as ``&lt;``.
    """
    if math:
        total = [0]

        def count(part: str) -> str:
            total[0] += len(display_dollar_positions(part))
            return part

        _outside_code(text, count)
        display = DisplayDollars(total[0])
        return _outside_code(text, lambda part: _escape_plain(dollar_math(display(part))))
    return _outside_code(text, _escape_plain)


def plain_text(shown: str) -> str:
    """The text a user typed, back from its ``safe_markdown`` form (what the Chatbot's edit box holds).

    ``plain_text(safe_markdown(t)) == t`` for every ``t`` that does not itself contain ``!\\[``, ``]\\(`` before a
    script scheme, or the entities ``&lt;``/``&amp;`` outside code (those read back as ``![``, ``](``, ``<``, ``&``).
    """
    return _outside_code(shown, _unescape_plain)


def view_path(path: Path) -> str:
    """A copy of a stored image in this user's temporary folder (``file_access.temp_root``), which Gradio may
    serve; returns its path.

    History folders are never exposed to Gradio's file route (no ``allowed_paths``): Gradio copies files from
    the temp folder into its own cache under unguessable content-hash names.  Raises ``OSError`` when the
    stored image cannot be read.
    """
    from qwen_chat.web.file_access import VIEW_DIR, temp_root

    target_dir = temp_root() / VIEW_DIR
    target_dir.mkdir(exist_ok=True)
    target = target_dir / Path(path).name
    if not target.exists():
        write_atomic(target, Path(path).read_bytes())
    return str(target)


@dataclass(frozen=True)
class LiveReply:
    """The in-memory view of the reply streaming right now (the fields ``chatbot_messages`` reads)."""

    text: str
    reasoning: str
    role: str = "assistant"
    images: tuple = ()
    status: str = STREAMING
    notice: str = ""
    stats: Optional[dict] = None


def chatbot_messages(messages: Sequence[Any], image_path, live_index: Optional[int] = None) -> list[dict]:
    """Stored messages -> Gradio Chatbot "messages" dicts (text made safe, images as file dicts).

    ``image_path(ref) -> Path`` resolves a stored image reference.  A message whose status is still
    ``streaming`` is shown as interrupted unless it is ``live_index`` (the reply streaming right now).
    Reasoning goes into a collapsible thought message (``metadata.title``), marked unfinished when the reply
    ended inside it; a reply's statistics follow it as their own message (``stats_view.stats_message``).
    """
    return [shown for _, shown in _shown_messages(messages, image_path, live_index)]


def stored_index(messages: Sequence[Any], shown_index: int) -> Optional[int]:
    """The index in ``messages`` of the message the Chatbot shows at position ``shown_index`` (as laid out by
    ``chatbot_messages``), or None when there is no such position."""
    sources = shown_sources(messages)
    return sources[shown_index] if 0 <= shown_index < len(sources) else None


def shown_sources(messages: Sequence[Any]) -> list[int]:
    """For every position the Chatbot shows (as laid out by ``chatbot_messages``), the index in ``messages`` of
    the message it comes from (a reply with reasoning has two positions)."""
    return [index for index, _ in _shown_messages(messages, None, None)]


def stats_rows(messages: Sequence[Any]) -> set[int]:
    """The Chatbot positions (as laid out by ``chatbot_messages``) that hold a reply's statistics line."""
    return {row for row, (_, shown) in enumerate(_shown_messages(messages, None, None)) if is_stats_message(shown)}


def _shown_messages(messages: Sequence[Any], image_path, live_index: Optional[int]):
    """(index in ``messages``, Chatbot dict) for every message shown; ``image_path`` None: images as a note."""
    for index, msg in enumerate(messages):
        if msg.role == "system":
            continue
        if msg.role == "user":
            content = [_image_part(image_path, ref) for ref in msg.images]
            if msg.text:
                content.append({"type": "text", "text": safe_markdown(msg.text)})
            if content:
                yield index, {"role": "user", "content": content}
            continue
        live = index == live_index
        status = shown_status(msg, live)
        if msg.reasoning:
            unfinished = not msg.text and status != "complete"
            title = "Thinking (unfinished)" if unfinished and not live else "Thinking"
            yield index, {
                "role": "assistant",
                "content": [{"type": "text", "text": safe_markdown(msg.reasoning, math=True)}],
                "metadata": {"title": title, "status": "pending" if live and not msg.text else "done"},
            }
        text = safe_markdown(msg.text, math=True) if msg.text else ""
        if status in STATUS_LABELS:
            note = getattr(msg, "notice", "") or ""
            label = STATUS_LABELS[status] + (f" ({safe_markdown(note)})" if note and status == "error" else "")
            text = (text + "\n\n" if text else "") + f"*[{label}]*"
        if text:
            yield index, {"role": "assistant", "content": [{"type": "text", "text": text}]}
        shown_stats = stats_message(getattr(msg, "stats", None))
        if shown_stats is not None:
            yield index, shown_stats


def _image_part(image_path, ref: str) -> dict:
    """The Chatbot part showing stored image ``ref`` (a note when it is gone or ``image_path`` is None)."""
    if image_path is not None:
        try:
            return {"path": view_path(image_path(ref))}
        except (ChatError, OSError):  # deleted or unreadable file: the rest still opens
            pass
    return {"type": "text", "text": "*[image no longer available]*"}


def conversation_label(summary: Any, now: Optional[datetime] = None) -> str:
    """The sidebar entry of a conversation: its title (one line, at most 60 characters) and when it was last
    updated, in the server's local time: "today 14:05", "yesterday 09:30", "3 Mar 14:05", or "3 Mar 2024" for
    another year.  ``summary`` has ``title`` and ``updated`` (ISO 8601 with a UTC offset, ``records.now_iso``);
    an unreadable time leaves the title alone."""
    title = " ".join((summary.title or DEFAULT_TITLE).split())
    title = title if len(title) <= 60 else title[:57] + "..."
    try:
        when = datetime.fromisoformat(summary.updated).astimezone()
    except (TypeError, ValueError):
        return title
    today = (now or datetime.now().astimezone()).date()
    if when.date() == today:
        day = "today"
    elif when.date() == today - timedelta(days=1):
        day = "yesterday"
    elif when.year == today.year:
        day = f"{when.day} {when:%b}"
    else:
        return f"{title} · {when.day} {when:%b} {when.year}"
    return f"{title} · {day} {when:%H:%M}"
