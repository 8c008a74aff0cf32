"""The statistics line under a reply: ``stats_line`` (plain text) and ``stats_message`` (its Chatbot message).

Shown for every reply that has statistics (``history.reply_stats``), live while it streams and from the saved
record afterwards, e.g. ``42 tokens · first token 0.31 s · 18.2 tokens/s · prompt 130 tokens, 120 cached``.
The message is a separate Chatbot entry (so the answer's own text stays exactly the model's answer: copy,
edit and the API's views of the answer are unchanged) marked with ``metadata`` (no title: not a collapsible
block) and a ``reply-stats`` element that ``page_js.CSS`` styles as a small line under the reply.

No Gradio objects here (plain dicts).
"""
from __future__ import annotations

from typing import Optional

#: The CSS class of the statistics line (``page_js.CSS``; the browser tests find it by this class).
STATS_CLASS = "reply-stats"


def stats_line(stats: dict) -> str:
    """One line of text for a ``reply_stats`` record: tokens generated, time to first token (seconds, 2
    decimals), decode speed (tokens/s, 1 decimal; left out until known) and the prompt's tokens with how many
    of them came from the conversation cache."""
    completion = stats.get('completion_tokens') or 0
    parts = [f"{completion} token" if completion == 1 else f"{completion} tokens"]
    ttft = stats.get("ttft_s")
    if ttft is not None:
        parts.append(f"first token {ttft:.2f} s")
    speed = stats.get("tokens_per_s")
    if speed is not None:
        parts.append(f"{speed:.1f} tokens/s")
    parts.append(f"prompt {stats.get('prompt_tokens') or 0} tokens, {stats.get('cached_tokens') or 0} cached")
    return " · ".join(parts)


def is_stats_message(shown: dict) -> bool:
    """True when the Chatbot message ``shown`` is a statistics line made by ``stats_message`` (reply text is
    made inert by ``render.safe_markdown``, so it never starts with this element)."""
    parts = shown.get("content") or [{}]
    text = parts[0].get("text", "") if isinstance(parts[0], dict) else ""
    return "title" not in (shown.get("metadata") or {"title": ""}) and text.startswith(f'<div class="{STATS_CLASS}"')


def stats_message(stats: Optional[dict]) -> Optional[dict]:
    """The Chatbot message showing ``stats`` under a reply, or None when there are none."""
    if not stats:
        return None
    text = f'<div class="{STATS_CLASS}" title="tokens generated · time to first token · decode speed · ' \
           f'prompt tokens, of them from the conversation cache">{stats_line(stats)}</div>'
    return {"role": "assistant", "content": [{"type": "text", "text": text}], "metadata": {"status": "done"}}
