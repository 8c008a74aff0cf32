"""A conversation as one Markdown document (the readable half of the download; ``conversation.json`` is the
exact half).

``conversation_markdown(conv)``: the title as a heading, the system prompt if any, then every message under
"**You**" / "**Assistant**" with its images linked as ``images/<name>.png`` (the files of the same zip), the
assistant's reasoning in a ``<details>`` block, its status label and its statistics line.  ``download_name``:
a file name made from the title.  No torch, no Gradio, no file access.
"""
from __future__ import annotations

import re
from typing import Any

from qwen_chat.history.records import STATUS_LABELS

_UNSAFE_NAME = re.compile(r"[^\w .,()+-]+")


def download_name(title: str, suffix: str, max_chars: int = 80) -> str:
    """A file name for a download of the conversation titled ``title``: characters other than letters,
    digits, space and ``.,()+-_`` become ``_``, runs of them one, cut to ``max_chars``; "conversation" when
    nothing is left; ``suffix`` (such as ".zip") appended."""
    name = _UNSAFE_NAME.sub("_", " ".join(title.split())).strip(" ._")[:max_chars].strip(" ._")
    return (name or "conversation") + suffix


def conversation_markdown(conv: Any, stats_line=None) -> str:
    """The Markdown text of ``conv`` (a ``records.Conversation``); ``stats_line(record) -> str`` formats a
    reply's statistics (left out when None)."""
    out = [f"# {conv.title}", ""]
    system = str((conv.settings or {}).get("system_prompt", "") or "")
    if system.strip():
        out += ["**System prompt**", "", system, ""]
    for msg in conv.messages:
        if msg.role == "system":
            continue
        out += ["**You**" if msg.role == "user" else "**Assistant**", ""]
        out += [f"![image](images/{name})" for name in msg.images]
        if msg.images:
            out.append("")
        if msg.reasoning:
            out += ["<details><summary>Thinking</summary>", "", msg.reasoning, "", "</details>", ""]
        if msg.text:
            out += [msg.text, ""]
        if msg.status in STATUS_LABELS:
            out += [f"*[{STATUS_LABELS[msg.status]}]*", ""]
        if stats_line is not None and getattr(msg, "stats", None):
            out += [f"*{stats_line(msg.stats)}*", ""]
    return "\n".join(out).rstrip() + "\n"
