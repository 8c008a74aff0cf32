"""``Router``: the front's ``ChatBackend`` over several data-parallel replicas (each an engine process behind
an ``engine_client.EngineClient``, or in tests any ``ChatEngine``).  No torch.

The routing rule, all of it here (``order_replicas``, ``conversation_key``):

1. **Conversation affinity.**  A conversation is recognised by its leading messages up to and including the
   first assistant reply (``conversation_key``: SHA-256 of role, text, image names and tool calls of those
   messages).  A first turn has no key yet; when it ends, the key of its messages plus the reply of each choice
   is remembered with the replica that served it, and every later turn refreshes it (the newest
   ``AFFINITY_ENTRIES`` keys are kept).  A later turn whose key is known goes to that replica when it has
   room: a free state slot and a free KV block, counting the requests the router already sent there.  The UI
   and the API are treated alike, with no conversation id in the backend's interface, and the key is exactly
   the prefix such a replica's cache holds: two conversations that opened with the same words but got
   different first replies are told apart, while identical ones share a key and either replica is as good.
2. **Most free capacity.**  Every other request (first turns included, whatever their words) goes to the
   replica with the lowest load = max(requests in flight / state slots, KV blocks used / KV blocks); ties go
   to fewer requests in flight, then to the lower replica index.  Requests in flight are counted here (n
   choices count n) from the call until the stream ends, so a burst spreads at once; the KV blocks come from
   the replica's last ``stats()``.
3. Replicas that are not healthy, or full (in flight >= state slots + queue bound) are skipped; a replica that
   answers ``Busy`` passes the request to the next one; the last ``Busy`` (HTTP 429) is raised when all are.

``health()`` is ok only when every replica is; ``stats()`` returns ``{"replicas": {"0": stats, "1": ...}}``,
each replica's own ``stats()`` plus ``routed_total`` and ``routed_affinity_total`` (``/metrics`` labels them
``replica``).  At ``--data-parallel 1`` no router exists: the front holds replica 0's ``EngineClient`` itself.

Usage::

    router = Router(clients, ranks=[[0, 1], [2, 3]], world_size=4)       # engine_client.EngineClient each
    updates = router.stream_chat(messages, settings, cancel)     # as ChatEngine.stream_chat
"""
from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import AsyncIterator, Iterator, Optional, Sequence

from qwen_chat.chat_types import Busy, CancelToken, ChatMessage, GenerationSettings, NotReady, StreamUpdate

#: Conversations whose replica is remembered (least recently used forgotten first; ~200 bytes each).
AFFINITY_ENTRIES = 65536


def conversation_key(messages: Sequence[ChatMessage]) -> Optional[str]:
    """The key of the conversation ``messages`` belong to: SHA-256 (hex) of the messages up to and including the
    first assistant message (role, stripped text, image file names, tool calls' names and arguments); None when
    no assistant message is there yet (a first turn).  Reasoning is left out: it is never sent back."""
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), None)
    if first is None:
        return None
    lead = [[m.role, (m.text or "").strip(), [p.replace("\\", "/").rsplit("/", 1)[-1] for p in m.images],
             [[c.name, c.arguments] for c in m.tool_calls]] for m in messages[:first + 1]]
    return hashlib.sha256(json.dumps(lead, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class Load:
    """One replica's load when a request is routed: ``inflight`` (choices the router sent there and that have
    not ended), ``num_slots`` (state slots), ``max_queue`` (requests that may wait), ``kv_blocks`` and
    ``kv_used`` (KV blocks in all and charged now), ``healthy``.  A count of 0 means unknown (a replica whose
    ``stats()`` lacks it): no limit from it."""

    inflight: int
    num_slots: int
    max_queue: int
    kv_blocks: int
    kv_used: int
    healthy: bool

    @property
    def usage(self) -> float:
        """max(in flight / state slots, KV blocks used / KV blocks): 0 idle, 1 and more full."""
        slots = self.inflight / self.num_slots if self.num_slots > 0 else float(self.inflight)
        return max(slots, self.kv_used / self.kv_blocks) if self.kv_blocks > 0 else slots

    @property
    def full(self) -> bool:
        """Every state slot and queue place is taken by requests the router sent (a new one would get Busy)."""
        return self.num_slots > 0 and self.inflight >= self.num_slots + self.max_queue

    @property
    def has_room(self) -> bool:
        """A new request would start at once: a free state slot and at least one free KV block."""
        slot = self.num_slots <= 0 or self.inflight < self.num_slots
        return slot and (self.kv_blocks <= 0 or self.kv_used < self.kv_blocks)


def order_replicas(loads: Sequence[Load], preferred: Optional[int] = None) -> list[int]:
    """Replica indices in the order a request tries them (module docstring, rules 1-3): healthy, not full, the
    ``preferred`` one (its conversation's) first when it has room, then by (usage, in flight, index)."""
    candidates = [i for i, load in enumerate(loads) if load.healthy and not load.full]
    ranked = sorted(candidates, key=lambda i: (loads[i].usage, loads[i].inflight, i))
    if preferred in candidates and loads[preferred].has_room:
        ranked.remove(preferred)
        ranked.insert(0, preferred)
    return ranked


class Router:
    """The ``ChatBackend`` of a multi-replica service (module docstring).

    Args:
        replicas: one ``EngineClient`` per replica, in replica order (anything with
            ``stream_chat``, ``health``, ``stats``, ``memory_report``, ``info`` and ``close``).
        ranks: the global ranks of each replica (reported by ``health``).
        world_size: ranks in all (``info.world_size``); default the replicas' sum.
    """

    def __init__(self, replicas: Sequence, ranks: Sequence[Sequence[int]] = (), world_size: Optional[int] = None):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.ranks = [list(r) for r in ranks] or [[i] for i in range(len(self.replicas))]
        self.info = replace(self.replicas[0].info, world_size=world_size or sum(len(r) for r in self.ranks))
        n = len(self.replicas)
        # Reentrant: a dropped stream's finalizer (``_Routed``) may run, through the garbage collector, in a thread
        # that holds the lock already.
        self._lock = threading.RLock()
        self._inflight, self._routed, self._affine = [0] * n, [0] * n, [0] * n
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._closed = False

    # ---- routing ---------------------------------------------------------------------------------------------
    def _loads(self) -> list[Load]:
        loads = []
        for i, rep in enumerate(self.replicas):
            s, healthy = rep.stats() or {}, bool(rep.health().get("ok"))
            loads.append(Load(self._inflight[i], int(s.get("num_slots") or 0), int(s.get("max_queue") or 0),
                              int(s.get("kv_blocks") or 0), int(s.get("kv_blocks_used") or 0), healthy))
        return loads

    def replica_for(self, messages: Sequence[ChatMessage]) -> Optional[int]:
        """The replica remembered for the conversation of ``messages`` (None: a first turn, or forgotten)."""
        key = conversation_key(messages)
        with self._lock:
            return self._affinity.get(key) if key else None

    def _order(self, messages: Sequence[ChatMessage], settings: GenerationSettings):
        """``(replicas to try in order, conversation key, count, preferred replica)``; the first one is counted
        in flight already.  Raises NotReady / Busy when none can take it."""
        if self._closed:
            raise NotReady("the engine is shutting down")
        key = conversation_key(messages)
        count = settings.n if isinstance(settings.n, int) and settings.n >= 1 else 1
        with self._lock:  # the choice and its count in one step: concurrent arrivals see each other
            preferred = self._affinity.get(key) if key else None
            order = order_replicas(self._loads(), preferred)
            if order:
                self._inflight[order[0]] += count
        if not order:
            unhealthy = [f"replica {i}: {rep.health().get('reason')}" for i, rep in enumerate(self.replicas)
                         if not rep.health().get("ok")]
            if unhealthy:
                raise NotReady("no replica is ready (" + "; ".join(unhealthy) + ")")
            raise Busy("every replica's generation queue is full; retry in a moment")
        return order, key, count, preferred

    def _routed_to(self, i: int, preferred: Optional[int]) -> None:
        with self._lock:
            self._routed[i] += 1
            self._affine[i] += int(i == preferred)

    def stream_chat(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                    cancel: CancelToken) -> Iterator[StreamUpdate]:
        """Route the request (module docstring) and return that replica's updates; same contract as
        ``ChatEngine.stream_chat``.  Raises NotReady when no replica is healthy (or the router is closed), Busy
        when every healthy replica is full, and whatever the chosen replica raises before its first update."""
        order, key, count, preferred = self._order(messages, settings)
        busy: Optional[Busy] = None
        for tried, i in enumerate(order):
            if tried:
                with self._lock:
                    self._inflight[i] += count
            try:
                updates = self.replicas[i].stream_chat(messages, settings, cancel)
            except Busy as exc:  # its queue filled since the last stats: try the next replica
                self._release(i, count)
                busy = exc
                continue
            except BaseException:
                self._release(i, count)
                raise
            self._routed_to(i, preferred)
            return _Routed(self, i, updates, list(messages), key, count)
        raise busy

    @property
    def supports_async(self) -> bool:
        """True when every replica has a native ``astream_chat`` (engine clients)."""
        return all(getattr(rep, "supports_async", False) for rep in self.replicas)

    async def astream_chat(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                           cancel: CancelToken) -> AsyncIterator[StreamUpdate]:
        """``stream_chat`` for asyncio (replicas with ``astream_chat``): routed the same way."""
        order, key, count, preferred = self._order(messages, settings)
        busy: Optional[Busy] = None
        for tried, i in enumerate(order):
            if tried:
                with self._lock:
                    self._inflight[i] += count
            try:
                updates = await self.replicas[i].astream_chat(messages, settings, cancel)
            except Busy as exc:
                self._release(i, count)
                busy = exc
                continue
            except BaseException:
                self._release(i, count)
                raise
            self._routed_to(i, preferred)
            return self._arouted(i, updates, list(messages), key, count)
        raise busy

    async def _arouted(self, replica: int, updates: AsyncIterator[StreamUpdate], messages: list,
                       key: Optional[str], count: int) -> AsyncIterator[StreamUpdate]:
        last: dict[int, StreamUpdate] = {}
        try:
            async for update in updates:
                last[update.index] = update
                yield update
        finally:
            await updates.aclose()
            self._release(replica, count)
            self._remember(replica, messages, key, list(last.values()))

    def _release(self, replica: int, count: int) -> None:
        with self._lock:
            self._inflight[replica] -= count

    def _remember(self, replica: int, messages: list, key: Optional[str], last: Sequence[StreamUpdate]) -> None:
        """After a turn: its conversation's key(s) -> ``replica`` (rule 1)."""
        if key is not None:
            keys = [key]
        else:
            # every choice's answer, an empty one too (a reply cut off while thinking is sent back as "")
            keys = [conversation_key(messages + [ChatMessage(role="assistant", text=u.answer, tool_calls=u.tool_calls)])
                    for u in last]
        with self._lock:
            for k in keys:
                self._affinity[k] = replica
                self._affinity.move_to_end(k)
            while len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)

    # ---- the rest of the ChatBackend -------------------------------------------------------------------------
    def health(self) -> dict:
        """``{"ok", "reason", "mode", "world_size", "data_parallel", "active", "queued", "self_check",
        "replicas": [{"replica", "ranks", "ok", "reason", "active", "queued"}...]}``: ok only when every
        replica's ``health()`` is (a remote one also when its last status is fresh)."""
        reports = [dict(rep.health()) for rep in self.replicas]
        per = [{"replica": i, "ranks": self.ranks[i] if i < len(self.ranks) else [], "ok": bool(h.get("ok")),
                "reason": h.get("reason", ""), "active": h.get("active", 0), "queued": h.get("queued", 0)}
               for i, h in enumerate(reports)]
        bad = [f"replica {p['replica']}: {p['reason'] or 'not ready'}" for p in per if not p["ok"]]
        if self._closed:
            bad.insert(0, "engine closed")
        checks = {h.get("self_check") for h in reports}
        return {"ok": not bad, "reason": "; ".join(bad) if bad else "ready", "mode": self.info.mode,
                "world_size": self.info.world_size, "data_parallel": len(self.replicas),
                "active": sum(p["active"] or 0 for p in per), "queued": sum(p["queued"] or 0 for p in per),
                "self_check": "passed" if checks == {"passed"} else "; ".join(sorted(map(str, checks - {"passed"}))),
                "replicas": per}

    def stats(self) -> dict:
        """``{"replicas": {"<index>": that replica's ``stats()`` + ``routed_total`` + ``routed_affinity_total``}}``."""
        out = {}
        for i, rep in enumerate(self.replicas):
            s = dict(rep.stats() or {})
            with self._lock:
                s.update(routed_total=self._routed[i], routed_affinity_total=self._affine[i])
            out[str(i)] = s
        return {"replicas": out}

    def memory_report(self) -> dict:
        """What the replicas' memory budgets hold in all, for ``/v1/models``: ``replicas``, the sums of
        ``state_slots`` / ``max_concurrent_sequences`` / ``kv_blocks`` / ``kv_tokens`` / ``memory_budget_gib``,
        ``kv_block_tokens`` and ``max_context`` (the smallest), ``conversation_cache``, ``kv_cache_dtype`` and ``weights`` (replica
        0's: every replica runs the same flags and checkpoint), and ``per_replica`` (each one's report); {} when
        a replica has none."""
        reports = [getattr(rep, "memory_report", dict)() for rep in self.replicas]
        if not all(reports):
            return {}
        out = {"replicas": len(reports)}
        for key in ("state_slots", "max_concurrent_sequences", "kv_blocks", "kv_tokens"):
            out[key] = sum(int(r.get(key, 0)) for r in reports)
        out["memory_budget_gib"] = round(sum(float(r.get("memory_budget_gib", 0)) for r in reports), 3)
        out["kv_block_tokens"] = reports[0].get("kv_block_tokens")
        out["max_context"] = min(int(r.get("max_context", 0)) for r in reports)
        for key in ("conversation_cache", "kv_cache_dtype", "weights"):  # the same on every replica (one config)
            if key in reports[0]:
                out[key] = reports[0][key]
        out["per_replica"] = reports
        return out

    def close(self) -> None:
        """Close every replica: the remote ones are asked first (their open streams end "cancelled" while
        replica 0 closes), then waited for.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        remote = self.replicas[1:]
        for rep in remote:
            getattr(rep, "request_close", lambda: None)()
        getattr(self.replicas[0], "close", lambda: None)()
        for rep in remote:
            getattr(rep, "wait_closed", getattr(rep, "close", lambda: None))()


class _Routed:
    """The updates of one routed request: counts it in flight until it ends (or is closed or dropped), then
    remembers its conversation's replica."""

    def __init__(self, router: Router, replica: int, inner, messages: list, key: Optional[str], count: int):
        self.replica = replica
        self._inner = iter(inner)
        self._last: dict[int, StreamUpdate] = {}
        self._router, self._messages, self._key = router, messages, key
        self._release = weakref.finalize(self, router._release, replica, count)

    def __iter__(self) -> "_Routed":
        return self

    def __next__(self) -> StreamUpdate:
        try:
            update = next(self._inner)
        except BaseException:  # the end (StopIteration) or a failure: either way no longer in flight
            self._end()
            raise
        self._last[update.index] = update
        return update

    def close(self) -> None:
        getattr(self._inner, "close", lambda: None)()
        self._end()

    def _end(self) -> None:
        if self._release.alive:
            self._release()
            self._router._remember(self.replica, self._messages, self._key, list(self._last.values()))
