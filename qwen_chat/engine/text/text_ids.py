"""Token ids of message texts, kept between requests, and what the next prompt of a conversation shares.

Used by ``prompt.build_prompt``: every turn of a conversation sends its earlier messages again, so the ids of
long texts are kept (``text_ids``), and the conversation cache keeps the state where the next prompt stops
sharing this one (``shared_prefix``) and where its system block ends, the part other conversations with the
same system prompt and tools share (``system_prefix``; docs/conversation-cache.md).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

#: Token ids of long message texts, kept between requests (least recently used dropped first): every turn of a
#: conversation sends its earlier messages again, and encoding a 30k-token history takes ~50 ms of CPU
#: (measured: docs/performance.md, "Conversation cache").  Only texts of at least ``TEXT_IDS_MIN_CHARS``.
_TEXT_IDS: "OrderedDict[tuple[int, str], tuple[int, ...]]" = OrderedDict()
TEXT_IDS_ENTRIES = 256
TEXT_IDS_MIN_CHARS = 2000


def text_ids(tokenizer: Any, text: str, special_ids: set) -> Sequence[int]:
    """The ids of one message text (``split_special_tokens``: text that looks like a control token stays text),
    from ``_TEXT_IDS`` when it was encoded before.  Raises RuntimeError if a control id came out anyway (the
    invariant that no control id ever comes from a message).  Called under ``prompt._ENCODE_LOCK``."""
    key = (id(tokenizer), text) if len(text) >= TEXT_IDS_MIN_CHARS else None
    if key is not None and key in _TEXT_IDS:
        _TEXT_IDS.move_to_end(key)
        return _TEXT_IDS[key]
    content_ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    if special_ids.intersection(content_ids):
        raise RuntimeError("Message text produced a control token; refusing to build the prompt.")
    if key is not None:
        _TEXT_IDS[key] = tuple(content_ids)
        while len(_TEXT_IDS) > TEXT_IDS_ENTRIES:
            _TEXT_IDS.popitem(last=False)
    return content_ids


#: The template texts the keep points are found by (docs/facts.md, "Chat template behaviour"): the header that
#: opens the reply's turn, the one that opens a system block, and the text that ends every message.
ASSISTANT_HEADER = "<|im_start|>assistant\n"
SYSTEM_HEADER = "<|im_start|>system\n"
MESSAGE_END = "<|im_end|>\n"
_TEMPLATE_IDS: dict[tuple[int, str], list[int]] = {}  # (id of the tokenizer, text) -> ids


def _template_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of a template text (all special tokens and one newline: encoded once per tokenizer)."""
    key = (id(tokenizer), text)
    if key not in _TEMPLATE_IDS:
        _TEMPLATE_IDS[key] = tokenizer.encode(text, add_special_tokens=False)
    return _TEMPLATE_IDS[key]


def _end_of_run(ids: Sequence[int], run: list[int], positions: range) -> int:
    """The position right after the first occurrence of ``run`` in ``ids`` that starts at one of
    ``positions`` (in their order), or 0 when none does."""
    n = len(run)
    for i in positions:
        if list(ids[i:i + n]) == run:
            return i + n
    return 0


def shared_prefix(tokenizer: Any, ids: Sequence[int]) -> int:
    """Tokens of ``ids`` that the next prompt of the same conversation shares: up to the end of the last
    ``<|im_start|>assistant\\n`` header.  The template renders an earlier reply as its text only (no reasoning,
    no empty think block), so what follows the header (the generation prompt) is not shared.  0 when the
    prompt has no such header."""
    header = _template_ids(tokenizer, ASSISTANT_HEADER)
    return _end_of_run(ids, header, range(len(ids) - len(header), -1, -1))


def system_prefix(tokenizer: Any, ids: Sequence[int]) -> int:
    """Tokens of ``ids`` up to the end of the system block it starts with (``<|im_start|>system\\n``, the tools
    block and system message as the template renders them, then ``<|im_end|>\\n``), or 0 when the prompt does
    not start with one.  Message texts cannot contain ``<|im_end|>`` (a control id never comes from a message:
    ``text_ids``), so the first one closes the system block."""
    header = _template_ids(tokenizer, SYSTEM_HEADER)
    if not _end_of_run(ids, header, range(0, 1)):
        return 0
    end = _template_ids(tokenizer, MESSAGE_END)
    return _end_of_run(ids, end, range(len(header), len(ids) - len(end) + 1))
