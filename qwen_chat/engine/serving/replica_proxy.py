"""The front's side of the replica link (``replica_link`` holds the protocol): ``ReplicaProxy``, a remote
data-parallel replica with the ``ChatEngine`` interface the router uses, and ``accept_leads``.  No torch.

Usage (rank 0, ``bootstrap.start_engine``)::

    proxies = accept_leads(listener, replicas=3, timeout_s=...)     # ReplicaProxy for replicas 1 and 2
    updates = proxies[0].stream_chat(messages, settings, cancel)    # runs on replica 1
    proxies[0].health(), proxies[0].stats(), proxies[0].close()
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from typing import Iterator, Optional, Sequence

from qwen_chat.chat_types import CancelToken, ChatMessage, GenerationSettings, NotReady, StreamUpdate
from qwen_chat.engine.serving.replica_link import (
    CANCEL_POLL_S,
    CLOSE_TIMEOUT_S,
    LINK_GONE_GRACE_S,
    STATUS_STALE_S,
    Outbox,
    TextDelta,
    pack_messages,
    read_messages,
    unpack_error,
)
from qwen_chat.lifecycle import die_unless_stopping

log = logging.getLogger(__name__)


class ReplicaProxy:
    """A remote replica as the router sees it: ``stream_chat``, ``health``, ``stats``, ``memory_report``,
    ``info`` and ``close``, as a ``ChatEngine`` has them, over the link to that replica's lead.

    ``stream_chat`` waits for the lead's answer, so its errors (``InvalidInput``, ``ContextTooLong``, ``Busy``...)
    are raised before it returns, as the engine's are.  ``health`` is the lead's last reported health, not ok
    when that is older than ``STATUS_STALE_S`` seconds or the link is gone.
    """

    def __init__(self, replica: int, conn, first_status: dict) -> None:
        self.replica = replica
        self._conn = conn
        self._status, self._status_at = first_status, time.monotonic()
        self._inboxes: dict[int, queue.SimpleQueue] = {}
        self._lock = threading.RLock()  # reentrant: a dropped stream's finalizer may run inside it (gc)
        self._ids = itertools.count(1)
        self._lost: Optional[str] = None
        self._closing = False
        self._closed = threading.Event()
        self._out = Outbox(conn, f"replica{replica}-send", self._gone)
        threading.Thread(target=read_messages, args=(conn, self._dispatch, self._gone), name=f"replica{replica}-recv",
                         daemon=True).start()

    @property
    def info(self):
        """The remote replica's ``ModelInfo`` (from its lead's hello)."""
        return self._status["info"]

    def health(self) -> dict:
        """The lead's ``ChatEngine.health()`` as last reported, or not ok (link gone, status stale)."""
        if self._lost:
            return {"ok": False, "reason": f"link to its lead lost ({self._lost})"}
        age = time.monotonic() - self._status_at
        if age > STATUS_STALE_S:
            return {"ok": False, "reason": f"no status from its lead for {age:.0f} s"}
        return dict(self._status["health"])

    def stats(self) -> dict:
        """The lead's ``ChatEngine.stats()`` as last reported (``gpu_memory_bytes`` keyed by global rank)."""
        return dict(self._status["stats"])

    def memory_report(self) -> dict:
        """The lead's ``ChatEngine.memory_report()`` (state slots, KV blocks, ...) as last reported."""
        return dict(self._status["memory"])

    def stream_chat(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                    cancel: CancelToken) -> Iterator[StreamUpdate]:
        """Run the request on the remote replica; same contract as ``ChatEngine.stream_chat``.  Raises NotReady
        when the link is gone."""
        if self._lost or self._closing:
            raise NotReady(f"replica {self.replica} is not reachable")
        packed, images = pack_messages(messages)
        rid, inbox = next(self._ids), queue.SimpleQueue()
        with self._lock:
            self._inboxes[rid] = inbox
        if self._lost:  # gone since the check above: _gone may have missed this inbox
            inbox.put(("lost",))
        self._out.put(("chat", rid, packed, settings, images))
        stream = _RemoteStream(self, rid, inbox, cancel)
        kind, *rest = stream.receive()
        if kind == "accepted":
            return stream
        stream.finish(cancel_remote=False)
        raise unpack_error(rest[0]) if kind == "refused" else NotReady(f"replica {self.replica} is not reachable")

    def request_close(self) -> None:
        """Ask the lead to close its engine (open streams end "cancelled"); ``wait_closed`` waits for it."""
        self._closing = True
        self._out.put(("close",))

    def wait_closed(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until the lead answered the close (True) or ``timeout_s`` passed; then drop the link."""
        done = self._closed.wait(timeout_s)
        self._out.stop()
        try:
            self._conn.close()
        except OSError:
            pass
        return done

    def close(self) -> None:
        """``request_close`` then ``wait_closed``."""
        self.request_close()
        self.wait_closed()

    def _forget(self, rid: int, cancel_remote: bool) -> None:
        with self._lock:
            self._inboxes.pop(rid, None)
        if cancel_remote and not self._lost:
            self._out.put(("cancel", rid))

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "status":
            self._status, self._status_at = message[1], time.monotonic()
        elif kind == "closed":
            self._closed.set()
        else:
            with self._lock:
                inbox = self._inboxes.get(message[1])
            if inbox is not None:
                inbox.put(message[0:1] + message[2:])

    def _gone(self, reason: str) -> None:
        if self._lost:
            return
        self._lost = reason
        self._closed.set()
        with self._lock:
            inboxes = list(self._inboxes.values())
        for inbox in inboxes:
            inbox.put(("lost",))
        if not self._closing:
            log.critical("replica %d: the link to its lead rank is gone (%s)", self.replica, reason)
            threading.Thread(target=die_unless_stopping, daemon=True, name="replica-gone", args=(
                f"replica {self.replica} is gone; exiting so that the whole group restarts", LINK_GONE_GRACE_S)).start()


class _RemoteStream:
    """The update iterator ``ReplicaProxy.stream_chat`` returns; closing or dropping it cancels the request on
    its replica."""

    def __init__(self, proxy: ReplicaProxy, rid: int, inbox: queue.SimpleQueue, cancel: CancelToken) -> None:
        self._proxy, self._rid, self._inbox, self._cancel = proxy, rid, inbox, cancel
        self._texts = TextDelta()
        self._cancel_sent = False
        self._done = False
        self._finalizer = weakref.finalize(self, proxy._forget, rid, True)

    def receive(self) -> tuple:
        """The next message of this request; sends the cancel once the token is set."""
        while True:
            if self._cancel.cancelled and not self._cancel_sent:
                self._cancel_sent = True
                self._proxy._out.put(("cancel", self._rid))
            try:
                return self._inbox.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                continue

    def finish(self, cancel_remote: bool) -> None:
        self._done = True
        self._finalizer.detach()
        self._proxy._forget(self._rid, cancel_remote)

    def __iter__(self) -> "_RemoteStream":
        return self

    def __next__(self) -> StreamUpdate:
        if self._done:
            raise StopIteration
        kind, *rest = self.receive()
        if kind == "update":
            return self._texts.unpack(rest[0])
        self.finish(cancel_remote=False)
        if kind == "end" and rest[0] is not None:
            raise unpack_error(rest[0])
        if kind == "lost":  # the process is about to leave; end the reply the way an engine failure does
            return StreamUpdate(finish_reason="error", notice=f"replica {self._proxy.replica} stopped")
        raise StopIteration

    def close(self) -> None:
        if not self._done:
            self.finish(cancel_remote=True)


def accept_leads(listener, replicas: int, timeout_s: float) -> list[ReplicaProxy]:
    """Front: wait until the leads of replicas 1 .. ``replicas`` - 1 have connected and said hello (their first
    status).  Returns their proxies, in replica order.

    Raises: TimeoutError naming the replicas missing after ``timeout_s`` seconds.
    """
    found: dict[int, ReplicaProxy] = {}
    done = threading.Event()

    def accept() -> None:
        while len(found) < replicas - 1:
            try:
                conn = listener.accept()
                (kind, status), = conn.recv()
            except Exception as exc:  # noqa: BLE001 - AuthenticationError (not one of ours), a broken hello
                log.warning("replica link: refused a connection (%s)", exc)
                continue
            if kind != "status" or not (0 < int(status["replica"]) < replicas) or status["replica"] in found:
                log.warning("replica link: unexpected hello %r; closing it", kind)
                conn.close()
                continue
            found[status["replica"]] = ReplicaProxy(status["replica"], conn, status)
            log.info("replica %d: its lead connected (%s)", status["replica"], status["health"].get("reason"))
        done.set()

    threading.Thread(target=accept, name="replica-accept", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(1.0) and time.monotonic() < deadline:  # short waits: SIGTERM is handled meanwhile
        pass
    if not done.is_set():
        missing = sorted(set(range(1, replicas)) - set(found))
        raise TimeoutError(f"replica(s) {missing} did not connect within {timeout_s:.0f} s")
    listener.close()
    return [found[r] for r in range(1, replicas)]
