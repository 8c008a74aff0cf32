"""The web front's end of the link to the engine processes: ``EngineHub`` (one PULL socket every engine pushes
to) and ``EngineClient`` (one engine process = one replica, with the ``ChatBackend`` interface).  No torch,
no CUDA: the front decodes text with the checkpoint's token strings (``output.updates.TokenTable``, read from
``tokenizer.json`` by a prompt worker).

Output processing happens here, once per engine step for every request: the hub's receiver thread
(``engine_hub``) takes one
``step`` message, feeds each request's ``replies.ReplyAssembler`` (UTF-8-safe detokenization, reasoning
split, stop strings, tool calls, log-probabilities) and hands the resulting updates to each request's
``_Inbox`` in one call per event loop (``loop.call_soon_threadsafe``), not one per token or per stream.

A consumer reads its inbox with ``astream_chat`` (asyncio: the API) or ``stream_chat`` (a thread: the UI's
Gradio handlers); both merge whatever accumulated since the last read into one update per choice (a slow
reader gets fewer, larger deltas, never dropped or reordered), and ``stream_interval`` > 1 waits for that
many tokens per update (vLLM's ``--stream-interval``).

Usage (the front process; ``engine_hub.EngineHub`` makes the clients)::

    clients = hub.wait_ready(timeout_s)          # [EngineClient] in replica order
    updates = await clients[0].astream_chat(messages, settings, cancel)
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Optional, Sequence

import zmq

from qwen_chat.chat_types import (
    CancelToken,
    ChatMessage,
    GenerationSettings,
    NotReady,
    StreamUpdate,
)
from qwen_chat.engine import wire
from qwen_chat.engine.output.updates import Logprob, merge_updates

if TYPE_CHECKING:
    from qwen_chat.engine.client.engine_hub import EngineHub

log = logging.getLogger(__name__)

#: Seconds a waiting thread consumer sleeps at most before it looks at its cancel token again.
CANCEL_POLL_S = 0.05


class _Inbox:
    """One request's updates on their way to its consumer: filled by the receiver thread, read by one
    consumer (async or a thread)."""

    def __init__(self, loop: Optional[asyncio.AbstractEventLoop]) -> None:
        self.loop = loop
        self.items: collections.deque = collections.deque()  # StreamUpdate, or an Exception (refused/lost)
        self.event = asyncio.Event() if loop is not None else None
        self.cond = threading.Condition() if loop is None else None
        self.answer: Optional[tuple] = None  # ("accepted", ...) / ("refused", error) / ("lost", reason)
        self.done = False  # every choice's last update is in ``items`` (set together with them)

    def deliver(self, updates: list, answer: Optional[tuple], done: bool) -> None:
        """Hand over one message's updates (and the engine's answer, and whether the stream is over) and wake
        the consumer: under the condition for a thread, through the event on the consumer's own loop (the hub
        calls this there)."""
        if self.cond is None:
            self._put(updates, answer, done)
            self.event.set()
            return
        with self.cond:
            self._put(updates, answer, done)
            self.cond.notify()

    def _put(self, updates: list, answer: Optional[tuple], done: bool) -> None:
        if answer is not None:
            self.answer = answer
        self.done = self.done or done
        self.items.extend(updates)

    async def wait(self) -> None:
        """Async consumers: sleep until the next delivery or ``wake`` (no timer: a ``wait_for`` per token cost
        14 us of the event loop's time against 5 us for this, measured on the 2-core CPU machine)."""
        await self.event.wait()

    def wake(self) -> None:
        """Wake an async consumer from any thread (its request's cancel token was cancelled)."""
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


class _Request:
    """The front's state of one request on an engine: its inbox, the assembler of its choices, cancel."""

    __slots__ = ("rid", "inbox", "assembler", "settings", "cancel_sent")

    def __init__(self, rid: int, inbox: _Inbox, settings: GenerationSettings) -> None:
        self.rid, self.inbox, self.settings = rid, inbox, settings
        self.assembler = None
        self.cancel_sent = False


class EngineClient:
    """One engine process (a replica) as the front sees it: ``stream_chat`` / ``astream_chat``, ``health``,
    ``stats``, ``memory_report``, ``info``, ``close`` (the ``ChatEngine`` interface, over the link).

    ``astream_chat`` / ``stream_chat`` wait for the engine's answer, so its errors (``InvalidInput``,
    ``ContextTooLong``, ``Busy``...) are raised before they return, as the engine's are.  ``health`` is the
    engine's last reported health, not ok when that is older than ``wire.ENGINE_SILENT_S`` or the link is gone.
    """

    def __init__(self, hub: "EngineHub", replica: int, input_address: str, status: dict, setup: dict) -> None:
        self.hub, self.replica = hub, replica
        self._push = hub.ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(input_address)
        self._push_lock = threading.Lock()
        self._status, self._status_at = status, time.monotonic()
        self.ranks = list(status.get("ranks") or [replica])
        self.info = wire.unpack_info(status["info"])  # the engine's ModelInfo (from its hello; it never changes)
        self.setup = setup
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self.lost: Optional[str] = None
        self._closing = False
        self.closed = threading.Event()
        self.stream_interval = hub.stream_interval

    #: ``astream_chat`` is native here (the API's ``open_updates`` uses it: no thread per stream).
    supports_async = True

    # ---- the ChatEngine interface ---------------------------------------------------------------------------
    def health(self) -> dict:
        """The engine's ``health()`` as last reported, or not ok (link gone, status stale)."""
        if self.lost:
            return {"ok": False, "reason": f"engine process of replica {self.replica} gone ({self.lost})"}
        age = time.monotonic() - self._status_at
        if age > wire.ENGINE_SILENT_S:
            return {"ok": False, "reason": f"no status from the engine process for {age:.0f} s"}
        return dict(self._status["health"])

    def stats(self) -> dict:
        """The engine's ``stats()`` as last reported."""
        return dict(self._status["stats"])

    def memory_report(self) -> dict:
        """The engine's ``memory_report()`` as last reported."""
        return dict(self._status["memory"])

    def send(self, message: list) -> None:
        """Send one message to the engine (any thread)."""
        data = wire.dumps(message)
        with self._push_lock:
            self._push.send(data, copy=False)

    def _check_reachable(self) -> None:
        if self.lost or self._closing:
            raise NotReady(f"replica {self.replica} is not reachable")

    def _open(self, prompt: dict, settings: GenerationSettings,
              loop: Optional[asyncio.AbstractEventLoop]) -> _Request:
        self._check_reachable()
        req = _Request(next(self._ids), _Inbox(loop), settings)
        self._requests[req.rid] = req
        self.send(["prompt", req.rid, prompt, wire.pack_settings(settings)])
        return req

    async def astream_chat(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                           cancel: CancelToken) -> AsyncIterator[StreamUpdate]:
        """Run the request on this engine: the async iterator of its updates (same contract as
        ``ChatEngine.stream_chat``).  The prompt is built by the front's prompt workers meanwhile the event
        loop serves everyone else.  Raises the refusals (bad settings or messages, context, Busy) before
        returning; NotReady when the link is gone.  Closing the iterator (or cancelling ``cancel``) cancels
        the request in the engine."""
        self._check_reachable()
        prompt = await self.hub.prompts.prepare(messages, settings, self.max_context)
        req = self._open(prompt, settings, asyncio.get_running_loop())
        cancel.on_cancel(req.inbox.wake)  # the consumer looks at the token when woken, not on a timer
        try:
            await self._await_answer(req, cancel)
        except BaseException:
            self._forget(req, cancel_remote=True)
            raise
        return self._aiter(req, cancel)

    @property
    def max_context(self) -> int:
        """Tokens per sequence (prompt + reply) the engine holds."""
        return int(self.setup.get("max_context") or self.info.context_length)

    async def _await_answer(self, req: _Request, cancel: CancelToken) -> None:
        inbox = req.inbox
        while inbox.answer is None:
            self._watch_cancel(req, cancel)
            inbox.event.clear()
            if inbox.answer is None:
                await inbox.wait()
        self._raise_refusal(req)

    def _raise_refusal(self, req: _Request) -> None:
        kind, *rest = req.inbox.answer
        if kind == "refused":
            self._forget(req, cancel_remote=False)
            raise wire.unpack_error(rest[0])
        if kind == "lost":
            self._forget(req, cancel_remote=False)
            raise NotReady(f"replica {self.replica} is not reachable")

    def _watch_cancel(self, req: _Request, cancel: CancelToken) -> None:
        if cancel.cancelled and not req.cancel_sent:
            req.cancel_sent = True
            if not self.lost:
                self.send(["cancel", req.rid])

    def _take(self, req: _Request) -> tuple[list[StreamUpdate], bool]:
        """Everything queued for ``req`` (merged), and whether its stream is over."""
        items = req.inbox.items
        got = []
        while items:
            got.append(items.popleft())
        return merge_updates(got), req.inbox.done and not items

    def _ready(self, req: _Request) -> bool:
        """Whether the consumer should read now: something queued and (``stream_interval`` > 1) enough tokens
        or an end."""
        items = req.inbox.items
        if not items:
            return req.inbox.done
        if self.stream_interval <= 1 or req.inbox.done:
            return True
        if any(u.finish_reason is not None for u in items):
            return True
        first, last = items[0], items[-1]
        return last.completion_tokens - first.completion_tokens + 1 >= self.stream_interval

    async def _aiter(self, req: _Request, cancel: CancelToken) -> AsyncIterator[StreamUpdate]:
        inbox = req.inbox
        try:
            while True:
                self._watch_cancel(req, cancel)
                if self._ready(req):
                    updates, over = self._take(req)
                    for u in updates:
                        yield u
                    if over:
                        return
                    continue
                inbox.event.clear()
                if not self._ready(req):
                    await inbox.wait()
        finally:
            self._forget(req, cancel_remote=not req.inbox.done)

    def stream_chat(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                    cancel: CancelToken) -> Iterator[StreamUpdate]:
        """``astream_chat`` for a thread (the UI's Gradio handlers): a blocking iterator."""
        self._check_reachable()
        prompt = self.hub.prompts.prepare_blocking(messages, settings, self.max_context)
        req = self._open(prompt, settings, None)
        inbox = req.inbox
        try:
            with inbox.cond:
                while inbox.answer is None:
                    self._watch_cancel(req, cancel)
                    inbox.cond.wait(CANCEL_POLL_S)
            self._raise_refusal(req)
        except BaseException:
            self._forget(req, cancel_remote=True)
            raise
        return self._iter(req, cancel)

    def _iter(self, req: _Request, cancel: CancelToken) -> Iterator[StreamUpdate]:
        inbox = req.inbox
        try:
            while True:
                with inbox.cond:
                    while not self._ready(req):
                        self._watch_cancel(req, cancel)
                        inbox.cond.wait(CANCEL_POLL_S)
                    updates, over = self._take(req)
                yield from updates
                if over:
                    return
        finally:
            self._forget(req, cancel_remote=not req.inbox.done)

    def _forget(self, req: _Request, cancel_remote: bool) -> None:
        self._requests.pop(req.rid, None)  # (from a consumer thread: a dict pop is atomic)
        if cancel_remote and not req.cancel_sent and not self.lost:
            req.cancel_sent = True
            self.send(["cancel", req.rid])

    def request_close(self) -> None:
        """Ask the engine to close (open streams end "cancelled"); ``wait_closed`` waits for its answer."""
        self._closing = True
        if not self.lost:
            self.send(["close"])

    def wait_closed(self, timeout_s: float = 15.0) -> bool:
        """Wait until the engine answered the close (True) or ``timeout_s`` passed."""
        return self.closed.wait(timeout_s)

    def close(self) -> None:
        """``request_close`` then ``wait_closed``."""
        self.request_close()
        self.wait_closed()

    # ---- the receiver thread's side --------------------------------------------------------------------------
    def on_events(self, events: list, deliveries: dict) -> None:
        """Handle one message's events (receiver thread); updates go into ``deliveries`` {loop or None:
        [(inbox, [updates])]} so that each loop is woken once per message."""
        for event in events:
            kind = event[0]
            if kind == "step":
                self._on_step(event[1], deliveries)
            elif kind == "status":  # health and stats; the hello's memory report and model info stay
                self._status.update(event[1])
                self._status_at = time.monotonic()
            elif kind in ("accepted", "refused"):
                req = self._requests.get(event[1])
                if req is None:
                    continue
                if kind == "accepted":
                    _, _, prompt_tokens, notice, dropped = event
                    req.assembler = self.hub.assembler(req.settings, prompt_tokens, notice, dropped, req.rid)
                    answer = ("accepted",)
                else:
                    answer = ("refused", event[2])
                self._deliver(req, [], deliveries, answer)
            elif kind == "closed":
                self.closed.set()

    def _on_step(self, entries: list, deliveries: dict) -> None:
        by_rid: dict[int, list] = {}
        for entry in entries:
            by_rid.setdefault(entry[0], []).append(entry)
        for rid, group in by_rid.items():
            req = self._requests.get(rid)
            if req is None or req.assembler is None:
                continue
            updates = []
            for _, index, ids, lps, finish, error, completion, cached, ttft in group:
                logprobs = [None if lp is None else Logprob(lp) for lp in lps] if lps else [None] * len(ids)
                made = req.assembler.feed(index, ids, logprobs, finish=finish, error=error,
                                          completion_tokens=completion, ttft_s=ttft, cached_tokens=cached)
                if made and made[-1].finish_reason is not None and req.assembler.choices[index].stopped_by_string \
                        and finish is None and not req.cancel_sent:
                    req.cancel_sent = True  # a stop string ended it: the engine may stop this sequence
                    self.send(["cancel", rid])
                updates.extend(made)
            if updates or req.assembler.done:
                self._deliver(req, updates, deliveries, done=req.assembler.done)

    def _deliver(self, req: _Request, updates: list, deliveries: dict, answer: Optional[tuple] = None,
                 done: bool = False) -> None:
        if done:
            self._requests.pop(req.rid, None)
        deliveries.setdefault(req.inbox.loop, []).append((req, updates, answer, done))

    def on_lost(self, reason: str, deliveries: dict) -> None:
        """The engine process is gone: every open request ends "cancelled" without its user asking (the UI
        keeps it as interrupted, the API sends the shutdown error), as at a shutdown; the front leaves soon
        after and the whole group restarts."""
        if self.lost:
            return
        self.lost = reason
        self.closed.set()
        for req in list(self._requests.values()):
            if req.assembler is None:
                self._deliver(req, [], deliveries, ("lost", reason))
            else:
                # the service is going down (the group restarts): the reply was cut off, as at a shutdown
                self._deliver(req, req.assembler.end_open("cancelled"), deliveries, done=True)
