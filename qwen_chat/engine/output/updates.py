"""What the front's output processing needs beside ``replies.ReplyAssembler``: the token table it decodes with
(``TokenTable``: the checkpoint's token strings, read by a prompt worker through the ``tokenizers`` library), a
sampled token's log-probability as the engine link carries it (``Logprob``), and the merging of the updates a
slow reader has not taken yet (``merge_updates``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from qwen_chat.chat_types import StreamUpdate


class TokenTable:
    """``convert_ids_to_tokens`` over a checkpoint's token strings (byte-level symbols, what
    ``textstream.ReplyDecoder`` needs to turn ids into text; no transformers, no torch).

    Args: ``strings``: the token string of every id 0 .. n - 1, None for an id without a token (a prompt
    worker's ``token_strings``: parsing the 33 MB ``tokenizer.json`` of Qwen3.5 is one C call that holds the
    GIL for 1-3 s, which the front's event loop should not wait through).
    """

    def __init__(self, strings: Sequence[Optional[str]]) -> None:
        self._strings = list(strings)

    def convert_ids_to_tokens(self, token_id: int) -> Optional[str]:
        """The token string of ``token_id`` (byte-level symbols), None for an id without a token."""
        i = int(token_id)
        return self._strings[i] if 0 <= i < len(self._strings) else None


def token_strings(tokenizer) -> list[Optional[str]]:
    """Every token string of a ``tokenizers.Tokenizer``, by id (0 .. the largest id; None where an id has no
    token): what ``TokenTable`` holds."""
    size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return [tokenizer.id_to_token(i) for i in range(size)]


class Logprob:
    """A sampled token's log-probability as the wire carries it (``SampledLogprob``'s fields)."""

    __slots__ = ("logprob", "top_ids", "top_logprobs")

    def __init__(self, packed: Sequence) -> None:
        self.logprob, self.top_ids, self.top_logprobs = packed


def merge_updates(updates: Sequence[StreamUpdate]) -> list[StreamUpdate]:
    """Consecutive updates of the same choice merged into one (deltas and log-probabilities concatenated, the
    newest full texts and counters); a choice's last update (``finish_reason``) stays last.  Order across
    choices is kept.  Each merged update is built once (a ``dataclasses.replace`` costs 4-5 us: a reader that
    lags by k updates would otherwise pay k - 1 of them; bench/results/2026-12-03-cpu2-merge-updates.txt)."""
    if len(updates) < 2:
        return list(updates)
    runs: list[list[StreamUpdate]] = []
    open_at: dict[int, int] = {}  # choice -> position in runs of its mergeable run
    for u in updates:
        at = open_at.get(u.index)
        if at is not None:
            runs[at].append(u)
        else:
            open_at[u.index] = len(runs)
            runs.append([u])
        if u.finish_reason is not None:
            open_at.pop(u.index, None)
    return [run[0] if len(run) == 1 else _merged(run) for run in runs]


def _merged(run: Sequence[StreamUpdate]) -> StreamUpdate:
    """The last update of ``run`` (one choice's, in order) carrying the deltas and log-probabilities of all."""
    reasoning, answer, logprobs = [], [], []
    for u in run:
        reasoning.append(u.reasoning_delta)
        answer.append(u.answer_delta)
        logprobs.extend(u.logprobs)
    return replace(run[-1], reasoning_delta="".join(reasoning), answer_delta="".join(answer),
                   logprobs=tuple(logprobs))
