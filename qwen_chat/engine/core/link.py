"""The engine process's end of the link to the web front: ``serve_engine`` serves one replica's ``ChatEngine``
over ZeroMQ (wire format: ``wire``).

Threads of an engine process (a replica's lead rank):

- the **scheduler thread** (``Scheduler``): plans and launches every step; the handles of the requests served
  here push their tokens into ``_StepOutput`` (a deque append each), and after the step's tokens were
  delivered the scheduler calls ``_StepOutput.flush``, which turns them into ONE ``step`` event for all
  requests and hands it to the sender.  No text, JSON or per-stream Python on that thread.
- the **input thread**: receives the front's requests (prompts already built by the front's prompt workers:
  ``prompt_worker``), compiles their grammars and queues them on the scheduler (``ChatEngine.submit_prepared``);
  cancels; the front's pings (a front silent for ``wire.FRONT_SILENT_S`` ends the process).
- the **sender thread**: packs (msgpack) and sends whatever accumulated, as one message.
- the **status thread**: health, stats and memory report every ``wire.STATUS_INTERVAL_S``.

Usage (``app.py`` on rank 0, ``bootstrap`` on the other replicas' leads)::

    serve_engine(engine, "tcp://127.0.0.1:40123", token, replica=0, ranks=[0], host="127.0.0.1")
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Optional, Sequence

import zmq

from qwen_chat.chat_types import CancelToken
from qwen_chat.engine import wire
from qwen_chat.engine.text.prompt_worker import unpack_prompt
from qwen_chat import lifecycle

log = logging.getLogger(__name__)

#: Seconds an orderly close waits for the open streams' last updates to go out.
CLOSE_TIMEOUT_S = 15.0
#: Seconds the process may live on after the front went silent, unless it is stopping itself.
FRONT_GONE_GRACE_S = 1.0


class _RequestSink:
    """The queue the n handles of one request push to (``RequestHandle.push_token`` / ``finish``): tags each
    item with the request id into the process's ``_StepOutput``."""

    __slots__ = ("rid", "output")

    def __init__(self, rid: int, output: "_StepOutput") -> None:
        self.rid, self.output = rid, output

    def put(self, item: tuple) -> None:
        self.output.items.append((self.rid, item))


class _StepOutput:
    """Everything the scheduler delivered since the last flush, turned into one ``step`` event per flush."""

    def __init__(self, send) -> None:
        self.items: collections.deque = collections.deque()  # (rid, (index, token or _Finish, logprob))
        self.handles: dict[int, list] = {}  # rid -> its handles (for the counters), until all finished
        self._send = send

    def flush(self) -> None:
        """On the scheduler thread, after a step's tokens were delivered: one ``step`` event (if any)."""
        if not self.items:
            return
        grouped: dict[tuple[int, int], list] = {}
        items = self.items
        while items:
            rid, (index, item, logprob) = items.popleft()
            entry = grouped.get((rid, index))
            if entry is None:
                entry = grouped[(rid, index)] = [rid, index, [], [], None, "", None, None, None]
            if isinstance(item, int):
                entry[2].append(item)
                entry[3].append(None if logprob is None else
                                [float(logprob.logprob), list(logprob.top_ids), list(logprob.top_logprobs)])
            else:  # handles._Finish
                entry[4], entry[5] = item.reason, item.error
        entries, ended = [], []
        for (rid, index), entry in grouped.items():
            # The handles are registered right after submit returns; a first step that beats that sends no
            # counters (None: the front counts the ids itself until the next step brings them).
            handles = self.handles.get(rid)
            if handles is not None and index < len(handles):
                h = handles[index]
                entry[6], entry[7], entry[8] = h.completion_tokens, h.cached_tokens, h.ttft_s
                if entry[4] is not None and all(x.finish_reason is not None for x in handles):
                    ended.append(rid)
            if not any(lp is not None for lp in entry[3]):
                entry[3] = []
            entries.append(entry)
        for rid in ended:
            self.handles.pop(rid, None)
        self._send(["step", entries])


class _EngineServer:
    """One replica's engine served to the front (module docstring)."""

    def __init__(self, engine, front_address: str, token: str, replica: int, ranks: Sequence[int],
                 host: str) -> None:
        self.engine, self.replica, self.ranks = engine, replica, list(ranks)
        self.ctx = zmq.Context.instance()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 2000)
        self.push.connect(front_address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.input_address = f"tcp://{host}:{port}"
        self.token = token
        self.outq: queue.SimpleQueue = queue.SimpleQueue()
        self.output = _StepOutput(self.outq.put)
        self.done = threading.Event()
        self.last_heard = time.monotonic()

    # ---- sending ---------------------------------------------------------------------------------------------
    def send_loop(self) -> None:
        while True:
            events = [self.outq.get()]
            while True:
                try:
                    events.append(self.outq.get_nowait())
                except queue.Empty:
                    break
            stop = None in events
            events = [e for e in events if e is not None]
            if events:
                self.push.send(wire.dumps([self.replica, events]), copy=False)
            if stop:
                return

    def status(self, hello: bool = False) -> dict:
        """Health and stats; with ``hello`` also what never changes after the start (ranks, memory report,
        model info), sent once."""
        stats = dict(self.engine.stats())
        if isinstance(stats.get("gpu_memory_bytes"), (list, tuple)):  # this process's, by global rank
            stats["gpu_memory_bytes"] = {self.ranks[0] + i: v for i, v in enumerate(stats["gpu_memory_bytes"])}
        status = {"health": self.engine.health(), "stats": stats}
        if hello:
            status.update(replica=self.replica, ranks=self.ranks, memory=self.engine.memory_report(),
                          info=wire.pack_info(self.engine.info))
        return status

    def status_loop(self) -> None:
        while not self.done.wait(wire.STATUS_INTERVAL_S):
            try:
                self.outq.put(["status", self.status()])
            except Exception:  # noqa: BLE001 - the next snapshot may work; a stale one turns health red
                log.exception("replica %d: status snapshot failed", self.replica)

    # ---- receiving -------------------------------------------------------------------------------------------
    def input_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self.done.is_set():
            if poller.poll(200):
                message = wire.loads(self.pull.recv())
                self.last_heard = time.monotonic()
                try:
                    self.dispatch(message)
                except Exception:  # noqa: BLE001 - one bad message must not end the engine
                    log.exception("replica %d: could not handle %r", self.replica, message[:1])
            elif time.monotonic() - self.last_heard > wire.FRONT_SILENT_S:
                log.critical("replica %d: nothing heard from the web front for %.0f s", self.replica,
                             wire.FRONT_SILENT_S)
                lifecycle.die_unless_stopping(f"replica {self.replica}: lost the web front; exiting so that the "
                                              "whole group restarts", FRONT_GONE_GRACE_S)
                return

    def dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "prompt":
            self.prompt(*message[1:])
        elif kind == "cancel":  # closing a request's handles takes it out of the batch at the next step
            for handle in self.output.handles.get(message[1], ()):
                handle.close()
        elif kind == "close":
            self.done.set()

    def prompt(self, rid: int, packed_prompt: dict, settings: dict) -> None:
        """Queue a request whose prompt the front built; answer ``accepted`` or ``refused``."""
        cancel = CancelToken()
        sink = _RequestSink(rid, self.output)
        try:
            prompt = unpack_prompt(packed_prompt)
            handles = self.engine.submit_prepared(prompt, wire.unpack_settings(settings), cancel, sink)
        except Exception as exc:  # noqa: BLE001 - the front raises it for its caller
            self.outq.put(["refused", rid, wire.pack_error(exc)])
            return
        if not all(h.finish_reason is not None for h in handles):  # else its finish went out already
            self.output.handles[rid] = handles
        self.outq.put(["accepted", rid, prompt.num_tokens, prompt.notice, prompt.dropped_messages])

    def shutdown(self) -> bool:
        """Close the engine (open streams end "cancelled"; their last updates go out), then say "closed".
        Returns ``ChatEngine.close``'s answer (False: a worker rank was already gone)."""
        clean = self.engine.close()
        self.output.flush()
        self.outq.put(["closed"])
        self.outq.put(None)
        return clean is not False


def serve_engine(engine, front_address: str, token: str, replica: int, ranks: Sequence[int], host: str,
                 setup: Optional[dict] = None, until=None) -> bool:
    """Serve ``engine`` (a ``ChatEngine``) to the web front at ``front_address`` (its PULL socket) until the
    front's "close", this process's SIGTERM (which returns from here: ``lifecycle.stop_polled``), or ``until()``
    turning True (both checked every 0.2 s; rank 0 passes "the front process exited").  The engine is closed on the
    way out, whatever signals arrive meanwhile; returns False when a worker rank of this replica was already
    gone by then (the process should leave with ``lifecycle.FAILURE_EXIT_CODE``), else True.  ``token``: the link's
    secret (the front ignores engines that do not know it); ``host``: where this engine's input socket binds;
    ``setup``: what the front needs to decode (checkpoint folder, special token ids; ``engine_setup``)."""
    server = _EngineServer(engine, front_address, token, replica, ranks, host)
    engine.scheduler.on_step = server.output.flush
    sender = threading.Thread(target=server.send_loop, name="front-send", daemon=True)
    sender.start()
    server.outq.put(["hello", token, server.input_address, server.status(hello=True),
                     setup if setup is not None else engine_setup(engine)])
    threading.Thread(target=server.input_loop, name="front-recv", daemon=True).start()
    threading.Thread(target=server.status_loop, name="engine-status", daemon=True).start()
    log.info("replica %d: serving the web front (input %s)", replica, server.input_address)
    # A stop signal only sets STOPPING, polled below: raised as SystemExit it could land inside the shutdown
    # (when the front's "close" came first) and leave the engine generating until the web server cut the
    # connections.
    with lifecycle.stop_polled():
        try:
            while not server.done.wait(0.2):
                if lifecycle.STOPPING.is_set() or (until is not None and until()):
                    break
        finally:
            server.done.set()
            clean = server.shutdown()
            sender.join(CLOSE_TIMEOUT_S)
    return clean


def engine_setup(engine) -> dict:
    """What the front's output processing needs from an engine: the checkpoint folder (its tokenizer) and the
    special token ids (end of sequence, ``<think>``/``</think>``, ``<tool_call>``/``</tool_call>``)."""
    return {"checkpoint": str(getattr(engine.loaded, "checkpoint", "") or ""),
            "image_token_budget": engine.image_token_budget, "max_context": engine.max_context,
            "eos_ids": list(engine.eos_ids), "think_ids": list(engine.think_ids),
            "tool_ids": list(engine.tool_ids) if engine.tool_ids is not None else None}
