"""``RequestHandle``: the token stream of one request, between the scheduler thread and one consumer.

The scheduler (``qwen_chat.engine.core.scheduler``) creates a handle in ``Scheduler.submit``, pushes each
sampled token id and finally the finish reason; the consumer (``ChatEngine``'s update stream) iterates it and
may ``close()`` it to take the request out of the batch.  The n choices of one request (n > 1) are n handles
that share one queue (``sink``); ``group_chunks`` reads them together.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from qwen_chat.chat_types import CancelToken, FinishReason


@dataclass(frozen=True)
class _Finish:
    """Sentinel put on a handle's queue after its last token."""

    reason: FinishReason
    error: str = ""


@dataclass
class Chunk:
    """What one handle of a group produced since the previous read: its ``index``, the token ids in order,
    their ``SampledLogprob``s (``qwen_chat.engine.types``; None where not asked for), and
    ``finished`` when its stream ended after them."""

    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finished: bool = False


def group_chunks(handles: Sequence["RequestHandle"]) -> Iterator[Chunk]:
    """Read handles that share one ``sink`` (or a single handle): one ``Chunk`` per handle with news, in the
    order the news came, until every handle has finished.  Blocks until a token or a finish arrives."""
    sink = handles[0]._queue
    open_indexes = {h.index for h in handles}
    while open_indexes:
        items = [sink.get()]
        while True:
            try:
                items.append(sink.get_nowait())
            except queue.Empty:
                break
        chunks: dict[int, Chunk] = {}
        for index, item, logprob in items:
            chunk = chunks.setdefault(index, Chunk(index))
            if isinstance(item, _Finish):
                chunk.finished = True
            else:
                chunk.ids.append(item)
                chunk.logprobs.append(logprob)
        for chunk in chunks.values():
            if chunk.finished:
                open_indexes.discard(chunk.index)
            yield chunk


class RequestHandle:
    """The token stream of one submitted request (thread-safe; consumed by one reader).

    Iterating yields sampled token ids (int) in order, excluding the stop token itself, and ends when the
    request finishes; then ``finish_reason`` is 'stop' (a stop id was sampled), 'length' (``max_new_tokens``
    or the context was reached), 'cancelled' (CancelToken, ``close()``, or shutdown) or 'error' (the executor
    failed; ``error`` holds a message meant for the user, without internals).  ``close()`` tells the scheduler
    the consumer went away; the request leaves the batch at the next step.  ``wake``: called (no arguments) by
    ``close()`` to wake the scheduler thread.

    Attributes (set by the scheduler thread): ``prompt_tokens`` (tokens), ``completion_tokens`` (sampled
    tokens including a final stop token, as OpenAI counts them), ``ttft_s`` (seconds from submit to the first
    sampled token, or None), ``submitted_at`` (``time.monotonic()`` seconds), ``cached_tokens`` (prompt tokens
    not prefilled because a kept conversation prefix held them: ``conv_cache``).

    ``index``: the choice this handle is (0 .. n-1); ``sink``: the queue shared by the n choices of a request
    (None: its own).
    """

    def __init__(self, request_id: int, prompt_tokens: int, cancel: CancelToken, wake, index: int = 0,
                 sink: Optional[queue.Queue] = None) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttft_s: Optional[float] = None
        self.submitted_at = time.monotonic()
        self.finish_reason: Optional[FinishReason] = None
        self.error = ""
        self._cancel = cancel
        self._closed = threading.Event()
        self.index = index
        # items: (index, token id or _Finish, SampledLogprob or None)
        self._queue: queue.Queue = sink if sink is not None else queue.Queue()
        self._wake = wake

    # ---- consumer side -------------------------------------------------------------------------------
    @property
    def abandoned(self) -> bool:
        """True once the consumer closed the handle or cancelled its token."""
        return self._closed.is_set() or self._cancel.cancelled

    def close(self) -> None:
        """Stop the request (if still running) at the next step; safe to call many times, from any thread."""
        if not self._closed.is_set():
            self._closed.set()
            self._wake()

    def __iter__(self) -> Iterator[int]:
        for chunk in self.chunks():
            yield from chunk

    def chunks(self) -> Iterator[list[int]]:
        """Yield lists of token ids: everything sampled since the previous list (at least one id).  Blocks
        until a token or the finish arrives.  (A handle of its own; the choices of a group: ``group_chunks``.)"""
        for chunk in group_chunks([self]):
            if chunk.ids:
                yield chunk.ids

    # ---- scheduler side (only the scheduler thread calls these) ----------------------------------------
    def push_token(self, token: int, logprob=None) -> None:
        """Append one sampled token id (and its ``SampledLogprob``, if asked for) to the stream."""
        self._queue.put((self.index, token, logprob))

    def finish(self, reason: FinishReason, error: str = "") -> None:
        """End the stream with ``reason`` (and for 'error' a message meant for the user)."""
        self.finish_reason = reason
        self.error = error
        self._queue.put((self.index, _Finish(reason, error), None))
