"""Streaming detokenizer for replies: UTF-8-safe text deltas, reasoning split at ``</think>``, stop strings.

The engine pushes the ids it samples, step by step, into a :class:`ReplyDecoder` and forwards the returned
``(reasoning_delta, answer_delta)`` pairs as ``StreamUpdate`` deltas.  Rules (they answer two known failures
of chat services: broken Unicode or a stalled stream while streaming, and reasoning shown as the answer when
the template pre-fills ``<think>``):

* Text is decoded from the accumulated *bytes* of the ids, never per token: every id of a byte-level BPE
  vocabulary stands for a fixed byte string, and those bytes go through one incremental UTF-8 decoder
  (``codecs.getincrementaldecoder("utf-8")("replace")``).  A character split across tokens (CJK, emoji,
  ``Ɐ``) is therefore emitted whole once its last byte arrives, and no delta ever ends in a partial
  character.  U+FFFD appears only where the model really produced it (the bytes EF BF BD, or an invalid
  byte sequence), and it streams immediately instead of stalling the rest of the reply.
* With thinking on, Qwen3.5's chat template ends the prompt with ``<think>\\n``, so the reply is reasoning
  from its first token until the ``</think>`` id; after it comes the answer.  A reply cut off before
  ``</think>`` is all reasoning with an empty answer.  A stray ``<think>`` id is dropped.  With
  thinking off everything is answer.
* Special and control ids (added tokens such as ``<|im_end|>``, ``<think>``, ``<|image_pad|>``) never
  become text.
* Whitespace: the reasoning loses its leading and trailing whitespace (the template's ``\\n`` after
  ``<think>`` and before ``</think>``), the answer its leading whitespace (the ``\\n\\n`` after ``</think>``).
  Trailing whitespace of the reasoning is held back until more reasoning text follows.

No torch here; the tokenizer only needs ``convert_ids_to_tokens`` and a byte-level BPE (GPT-2 style) vocabulary,
as Qwen3.5's has.
"""
from __future__ import annotations

import codecs
from typing import Sequence

#: Default ids from the Qwen3.5 tokenizer (docs/facts.md, "Tokens").
THINK_START_ID = 248068  # <think>
THINK_END_ID = 248069  # </think>
ENDOFTEXT_ID = 248044  # <|endoftext|> (eos)
IM_END_ID = 248046  # <|im_end|>


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` table (openai/gpt-2 ``encoder.py``, used by every byte-level
    BPE incl. Qwen's): printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100.. in order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_UNICODE_TO_BYTE = _unicode_to_byte()


def _inner_tokenizer(tokenizer):
    """Accept a tokenizer or a processor that carries one in ``.tokenizer``."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return tokenizer
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "convert_ids_to_tokens"):
        return inner
    raise TypeError(f"{type(tokenizer).__name__} has no convert_ids_to_tokens (not a tokenizer/processor)")


def _control_ids(tokenizer) -> frozenset[int]:
    """Ids of added/special tokens (``<|im_end|>``, ``<think>``, ...): they are never shown as text."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if callable(get_added):
        ids.update(get_added().values())
    return frozenset(ids)


class _Segment:
    """One text stream (reasoning or answer): incremental UTF-8 decoding plus whitespace trimming.

    ``strip_leading`` drops whitespace before the first visible character; ``hold_trailing`` keeps trailing
    whitespace back until non-whitespace text follows (and drops it at the end).
    """

    def __init__(self, *, strip_leading: bool, hold_trailing: bool) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip_leading = strip_leading
        self._hold_trailing = hold_trailing
        self._pending_ws = ""
        self.text = ""

    def feed(self, data: bytes) -> str:
        """Decode ``data`` (raw token bytes) and return the newly visible text (maybe "")."""
        return self._visible(self._utf8.decode(data, final=False))

    def close(self) -> str:
        """End the segment: drop held trailing whitespace and an incomplete trailing character.

        A character whose last bytes were never generated (reply cut off mid-character) is dropped rather
        than shown as U+FFFD: it is not text the model produced.
        """
        self._utf8.reset()
        self._pending_ws = ""
        return ""

    def _visible(self, decoded: str) -> str:
        if not decoded:
            return ""
        text = self._pending_ws + decoded
        self._pending_ws = ""
        if self._strip_leading and not self.text:
            text = text.lstrip()
        if self._hold_trailing:
            keep = len(text.rstrip())
            text, self._pending_ws = text[:keep], text[keep:]
        self.text += text
        return text


class ReplyDecoder:
    """Turn the ids of one streamed reply into ``(reasoning_delta, answer_delta)`` pairs.

    Args:
        tokenizer: a byte-level BPE tokenizer (e.g. ``build_qwen35_tokenizer()`` or ``processor.tokenizer``)
            or a processor carrying one in ``.tokenizer``.
        starts_in_reasoning: True when the prompt ends inside ``<think>`` (Qwen3.5 with thinking on).
        think_start_id / think_end_id: ids of ``<think>`` / ``</think>`` (Qwen3.5: 248068 / 248069).
        stop_ids: end-of-turn ids (``<|endoftext|>`` 248044, ``<|im_end|>`` 248046); they produce no text.
        literal_ids: control ids shown as their name when they reach the decoder (``<tool_call>`` and
            ``</tool_call>`` of a call that did not parse, ``qwen_chat.engine.text.toolcalls``); when given, the
            answer's trailing whitespace is held back until more answer text follows (it precedes a call).

    Not thread-safe: one decoder per reply, used by the thread that samples it.
    """

    def __init__(self, tokenizer, *, starts_in_reasoning: bool, think_start_id: int = THINK_START_ID,
                 think_end_id: int = THINK_END_ID, stop_ids: Sequence[int] = (ENDOFTEXT_ID, IM_END_ID),
                 literal_ids: Sequence[int] = ()) -> None:
        self._tokenizer = _inner_tokenizer(tokenizer)
        self._think_start = int(think_start_id)
        self._think_end = int(think_end_id)
        self._control = _control_ids(self._tokenizer) | {self._think_start, self._think_end} | {
            int(i) for i in stop_ids}
        self._bytes_cache: dict[int, bytes] = {}
        self._reasoning = _Segment(strip_leading=True, hold_trailing=True)
        self._literal = frozenset(int(i) for i in literal_ids)
        self._answer = _Segment(strip_leading=True, hold_trailing=bool(self._literal))
        self._in_reasoning = bool(starts_in_reasoning)
        self._finished = False

    @property
    def reasoning(self) -> str:
        """Reasoning text emitted so far (the sum of all reasoning deltas)."""
        return self._reasoning.text

    @property
    def answer(self) -> str:
        """Answer text emitted so far (the sum of all answer deltas)."""
        return self._answer.text

    @property
    def in_reasoning(self) -> bool:
        """True while the reply is still inside its reasoning (no ``</think>`` seen yet, thinking on)."""
        return self._in_reasoning

    def push(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """Add newly sampled ids (any number, in order) and return ``(reasoning_delta, answer_delta)``.

        Either delta may be "" (e.g. while a multi-byte character is incomplete).  Deltas never end in a
        partial UTF-8 character.

        Raises:
            RuntimeError: if called after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("ReplyDecoder.push called after finish()")
        reasoning_out: list[str] = []
        answer_out: list[str] = []
        for token_id in token_ids:
            token_id = int(token_id)
            if token_id == self._think_end and self._in_reasoning:
                reasoning_out.append(self._reasoning.close())
                self._in_reasoning = False
                continue
            if token_id in self._control and token_id not in self._literal:
                # Includes a stray <think> at the start (the template already opened the block) and
                # end-of-turn ids; none of them is text.
                continue
            data = self.token_piece(token_id)[1] if token_id in self._literal else self._token_bytes(token_id)
            if self._in_reasoning:
                reasoning_out.append(self._reasoning.feed(data))
            else:
                answer_out.append(self._answer.feed(data))
        return "".join(reasoning_out), "".join(answer_out)

    def finish(self) -> tuple[str, str]:
        """End the reply and return the last ``(reasoning_delta, answer_delta)``.

        Held trailing whitespace of the reasoning and a character cut off mid-bytes are dropped, so in
        practice both deltas are "".  Further :meth:`push` calls raise ``RuntimeError``.
        """
        if self._finished:
            return "", ""
        self._finished = True
        return self._reasoning.close(), self._answer.close()

    def _token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one regular token (byte-level BPE: each symbol of the token string is one byte).

        Raises:
            ValueError: the tokenizer is not byte-level (a token symbol outside GPT-2's byte table).
        """
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            # Padding rows of the embedding (Qwen3.5: ids 248077..248319 of 248,320) have no token; a model
            # with random weights does sample them.  Like tokenizer.decode, they produce no text.
            self._bytes_cache[token_id] = b""
            return b""
        try:
            data = bytes(_UNICODE_TO_BYTE[ch] for ch in token)
        except KeyError:
            raise ValueError(
                f"token id {token_id} ({token!r}) is not a byte-level BPE token; ReplyDecoder needs a "
                "byte-level tokenizer such as Qwen3.5's") from None
        self._bytes_cache[token_id] = data
        return data

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """``(text, raw bytes)`` of one id as log-probability reports show it: a special id as its name
        (``<|im_end|>``, UTF-8), a regular one as its bytes decoded, or ``bytes:\\xNN...`` when they are not
        whole UTF-8 (part of a character split across tokens, as vLLM writes it); a padding id is ``("", b"")``.

        Raises: ValueError as ``push`` (a tokenizer that is not byte-level).
        """
        token_id = int(token_id)
        if token_id in self._control:
            name = self._tokenizer.convert_ids_to_tokens(token_id) or ""
            return name, name.encode("utf-8")
        data = self._token_bytes(token_id)
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


def find_stop_string(text: str, stops: Sequence[str]) -> int:
    """Index in ``text`` where the earliest of ``stops`` begins, or -1 if none occurs.

    Empty stop strings are ignored.  Used for the OpenAI API ``stop`` parameter: the reply is cut at that
    index (the stop string itself is not returned, as in OpenAI's API).
    """
    best = -1
    for stop in stops:
        if not stop:
            continue
        index = text.find(stop)
        if index != -1 and (best == -1 or index < best):
            best = index
    return best


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``stops`` (0 if none).

    That many trailing characters must be held back while streaming, because the next delta may complete
    a stop string.
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopStringFilter:
    """Apply OpenAI-style ``stop`` strings to a stream of text deltas.

    ``push(delta)`` returns the text that is safe to emit now; text that could be the start of a stop
    string is held back.  Once a stop string is complete, ``stopped`` is True, the text before it is
    returned and everything after it is discarded.  ``finish()`` releases the held-back tail.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.text = ""  # everything emitted so far

    def push(self, delta: str) -> str:
        """Add a delta; return the text that can be emitted now ("" after a stop)."""
        if self.stopped or not delta:
            return ""
        buffer = self._held + delta
        cut = find_stop_string(buffer, self._stops)
        if cut != -1:
            self.stopped = True
            self._held = ""
            return self._emit(buffer[:cut])
        hold = stop_prefix_length(buffer, self._stops)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return self._emit(buffer[:len(buffer) - hold])

    def finish(self) -> str:
        """End of stream: return the held-back tail (it did not turn into a stop string)."""
        if self.stopped:
            return ""
        tail, self._held = self._held, ""
        return self._emit(tail)

    def _emit(self, text: str) -> str:
        self.text += text
        return text
