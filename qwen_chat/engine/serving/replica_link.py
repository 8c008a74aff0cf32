"""The link between the web front (global rank 0) and the lead rank of every other data-parallel replica:
requests, streamed updates, cancel and status snapshots.  The whole protocol is this module; no torch.

One ``multiprocessing.connection`` connection per remote replica (opened by ``parallel.replicas``,
HMAC-authenticated), carrying pickled lists of messages: a writer thread on each side sends whatever
accumulated since its last send in one message, so a busy replica costs one send per burst, not per token.

Front -> lead:
  ``("chat", rid, messages, settings, images)``  a request; images travel as ``{name: bytes}`` (``images`` of
                                                  a message hold names), since a replica may run on another host
  ``("cancel", rid)``                             Stop, a closed stream, a client that went away
  ``("close",)``                                  orderly stop: close the engine, then answer ``("closed",)``
Lead -> front:
  ``("status", snapshot)``                        every ``STATUS_INTERVAL_S``: ``{"replica", "health", "stats",
                                                  "memory", "info"}``; the first one is the lead's hello
  ``("accepted", rid)`` / ``("refused", rid, e)`` the answer to "chat", before any update (``stream_chat``'s errors)
  ``("update", rid, packed)``                     one ``StreamUpdate``; its full texts are left out when they only
                                                  grew by the delta (the front rebuilds them)
  ``("end", rid, e)``                             the stream is over (e: None, or a failure after it started)
  ``("closed",)``                                 the lead closed its engine

A link that ends otherwise ends the process on either side within ``LINK_GONE_GRACE_S`` seconds
(``lifecycle.die_unless_stopping``), so that the launcher, and Supervisor after it, restart the whole group.

The front's end is ``replica_proxy`` (``ReplicaProxy``, ``accept_leads``); the lead's end is ``serve_front``
here::

    serve_front(engine, conn, replica=1, rank=2)    # lead of replica 1: until the front's close or SIGTERM
"""
from __future__ import annotations

import logging
import queue
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from qwen_chat.chat_types import CancelToken, ChatError, ChatMessage, GenerationSettings, InvalidImage, StreamUpdate
from qwen_chat.lifecycle import die_unless_stopping, install_sigterm_exit

log = logging.getLogger(__name__)

#: Seconds between two status snapshots of a lead (health, stats, memory report).
STATUS_INTERVAL_S = 0.25
#: A remote replica whose last status is older than this (seconds) counts as unhealthy.
STATUS_STALE_S = 10.0
#: Seconds a cancel token may stay set before the front notices it while no update arrives.
CANCEL_POLL_S = 0.05
#: Seconds a link may be gone before the process leaves, unless it is stopping itself (``lifecycle``).
LINK_GONE_GRACE_S = 2.0
#: Seconds an orderly close waits for the other side (open streams end "cancelled" first).
CLOSE_TIMEOUT_S = 15.0
#: Most messages one send carries.
BATCH_MAX = 1024


# ---- wire format ---------------------------------------------------------------------------------------------
def pack_error(exc: BaseException) -> tuple:
    """``(class name, message, attributes)`` of a ``ChatError`` (``ContextTooLong`` keeps its token counts);
    any other exception becomes a ``RuntimeError`` naming its class."""
    if isinstance(exc, ChatError):
        return type(exc).__name__, str(exc), dict(vars(exc))
    return "RuntimeError", f"{type(exc).__name__}: {exc}", {}


def _chat_error_classes() -> dict:
    found, todo = {}, [ChatError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def unpack_error(packed: tuple) -> Exception:
    """The exception ``pack_error`` described (its class when that is a known ``ChatError``, else RuntimeError)."""
    name, message, attrs = packed
    cls = _chat_error_classes().get(name)
    if cls is None:
        return RuntimeError(message)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(attrs)
    return exc


class TextDelta:
    """Packs (lead) or rebuilds (front) the full texts of a stream's updates, per choice."""

    def __init__(self) -> None:
        self._texts: dict[int, tuple[str, str]] = {}

    def pack(self, u: StreamUpdate) -> tuple:
        """``(u without its full texts, reasoning or None, answer or None)``: None where the text is the
        previous one of the same choice plus the update's delta."""
        reasoning, answer = self._texts.get(u.index, ("", ""))
        self._texts[u.index] = (u.reasoning, u.answer)
        grown_r = u.reasoning == reasoning + u.reasoning_delta
        grown_a = u.answer == answer + u.answer_delta
        return (replace(u, reasoning="", answer=""), None if grown_r else u.reasoning, None if grown_a else u.answer)

    def unpack(self, packed: tuple) -> StreamUpdate:
        """The ``StreamUpdate`` that ``pack`` packed, its full texts rebuilt from this stream's earlier ones."""
        bare, reasoning, answer = packed
        prev_r, prev_a = self._texts.get(bare.index, ("", ""))
        reasoning = prev_r + bare.reasoning_delta if reasoning is None else reasoning
        answer = prev_a + bare.answer_delta if answer is None else answer
        self._texts[bare.index] = (reasoning, answer)
        return replace(bare, reasoning=reasoning, answer=answer)


def pack_messages(messages: Sequence[ChatMessage]) -> tuple[list, dict]:
    """Messages with image names instead of paths, and ``{name: bytes}`` of those images (both stores name
    image files by their SHA-256, so one name is one content).  Raises InvalidImage for an unreadable file."""
    images: dict[str, bytes] = {}
    out = []
    for m in messages:
        names = []
        for path in m.images:
            name = Path(path).name
            if name not in images:
                try:
                    images[name] = Path(path).read_bytes()
                except OSError as exc:
                    raise InvalidImage(f"an image of this conversation cannot be read: {exc.strerror or exc}")
            names.append(name)
        out.append(replace(m, images=tuple(names)) if m.images else m)
    return out, images


class Outbox:
    """The one writer of a connection: ``put`` queues a message, a thread sends what accumulated as one list.
    A failed send calls ``on_broken(reason)`` once and drops everything after."""

    def __init__(self, conn, name: str, on_broken) -> None:
        self._conn, self._on_broken = conn, on_broken
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> None:
        """Queue ``message`` for the next send (never blocks)."""
        self._queue.put(message)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then end the writer thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < BATCH_MAX:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    self._conn.send(batch)
            except (OSError, ValueError) as exc:
                self._on_broken(f"send failed: {exc}")
                return
            if stop:
                return


def read_messages(conn, dispatch, on_gone) -> None:
    """The one reader of a connection: ``dispatch(message)`` for every message received, in order, until the
    connection ends; then ``on_gone(reason)``.  Runs in its own thread."""
    try:
        while True:
            for message in conn.recv():
                dispatch(message)
    except Exception as exc:  # noqa: BLE001 - EOFError, OSError, a handle closed under recv: gone
        on_gone(f"{type(exc).__name__}: {exc}" if str(exc) else "connection closed")


# ---- lead side -----------------------------------------------------------------------------------------------
class _LeadServer:
    """Serves one replica's ``ChatEngine`` to the front: one thread per request, a status thread, the reader."""

    def __init__(self, engine, conn, replica: int, rank: int) -> None:
        self.engine, self.conn, self.replica, self.rank = engine, conn, replica, rank
        self.cancels: dict[int, CancelToken] = {}
        self.threads: set[threading.Thread] = set()
        self.lock = threading.Lock()
        self.done = threading.Event()  # the front asked for the orderly close
        self.gone = False
        self.tmp = Path(tempfile.mkdtemp(prefix=f"qwen_chat-replica{replica}-"))
        self.out = Outbox(conn, "front-send", self.front_gone)

    def status(self) -> dict:
        stats = dict(self.engine.stats())
        if isinstance(stats.get("gpu_memory_bytes"), (list, tuple)):  # this process's, by global rank
            stats["gpu_memory_bytes"] = {self.rank + i: v for i, v in enumerate(stats["gpu_memory_bytes"])}
        return {"replica": self.replica, "health": self.engine.health(), "stats": stats,
                "memory": self.engine.memory_report(), "info": self.engine.info}

    def push_status(self) -> None:
        while not self.done.wait(STATUS_INTERVAL_S):
            try:
                self.out.put(("status", self.status()))
            except Exception:  # noqa: BLE001 - the next snapshot may work; a stale one turns health red
                log.exception("replica %d: status snapshot failed", self.replica)

    def dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "chat":
            _, rid, messages, settings, images = message
            cancel = CancelToken()
            thread = threading.Thread(target=self.run_request, args=(rid, messages, settings, images, cancel),
                                      name=f"replica-request-{rid}", daemon=True)
            with self.lock:
                self.cancels[rid] = cancel
                self.threads.add(thread)
            thread.start()
        elif kind == "cancel":
            with self.lock:
                cancel = self.cancels.get(message[1])
            if cancel is not None:
                cancel.cancel()
        elif kind == "close":
            self.done.set()

    def run_request(self, rid: int, messages: list, settings: GenerationSettings, images: dict,
                    cancel: CancelToken) -> None:
        folder = None
        try:
            if images:
                folder = Path(tempfile.mkdtemp(dir=self.tmp))
                for name, data in images.items():
                    (folder / Path(name).name).write_bytes(data)
                messages = [replace(m, images=tuple(str(folder / Path(n).name) for n in m.images)) if m.images
                            else m for m in messages]
            try:
                updates = self.engine.stream_chat(messages, settings, cancel)
            except Exception as exc:  # noqa: BLE001 - the front raises it for its caller
                self.out.put(("refused", rid, pack_error(exc)))
                return
            self.out.put(("accepted", rid))
            texts, failure = TextDelta(), None
            try:
                for update in updates:
                    self.out.put(("update", rid, texts.pack(update)))
            except Exception as exc:  # noqa: BLE001 - after the stream started: reported as its end
                log.exception("replica %d: request %d failed while streaming", self.replica, rid)
                failure = pack_error(exc)
            finally:
                getattr(updates, "close", lambda: None)()
            self.out.put(("end", rid, failure))
        finally:
            with self.lock:
                self.cancels.pop(rid, None)
                self.threads.discard(threading.current_thread())
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def front_gone(self, reason: str) -> None:
        if self.done.is_set() or self.gone:
            return
        self.gone = True
        log.critical("replica %d: the link to the web front (rank 0) is gone (%s)", self.replica, reason)
        threading.Thread(target=die_unless_stopping, daemon=True, name="front-gone", args=(
            f"replica {self.replica}: lost the web front; exiting so that the whole group restarts",
            LINK_GONE_GRACE_S)).start()

    def shutdown(self) -> None:
        """Close the engine (open streams end "cancelled" and their last updates go out), then say "closed"."""
        self.engine.close()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.out.put(("closed",))
        self.out.stop()
        try:
            self.conn.close()
        except OSError:
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def serve_front(engine, conn, replica: int, rank: int) -> None:
    """Lead of replica ``replica`` (global rank ``rank``): serve ``engine`` to the front over ``conn`` until the
    front's orderly close (then return) or this process's SIGTERM (``SystemExit`` from
    ``lifecycle.install_sigterm_exit``, installed here unless a handler is in place already: a tensor-parallel
    lead has ``install_rank0_sigterm``'s).  Either way the engine is closed first.  A front that vanishes ends
    the process (module docstring)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        install_sigterm_exit()
    server = _LeadServer(engine, conn, replica, rank)
    server.out.put(("status", server.status()))  # the hello
    threading.Thread(target=read_messages, args=(conn, server.dispatch, server.front_gone), name="front-recv",
                     daemon=True).start()
    threading.Thread(target=server.push_status, name="replica-status", daemon=True).start()
    log.info("replica %d: serving the web front", replica)
    try:
        while not server.done.wait(1.0):  # short waits keep the main thread responsive to signals
            pass
    finally:
        server.shutdown()
