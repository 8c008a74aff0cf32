"""The front's receiving side of the engine link: ``EngineHub`` binds the one PULL socket every engine process
pushes to, makes an ``engine_client.EngineClient`` per engine that says hello with the link's secret, feeds
each message's events to its client on one receiver thread (output processing: ``engine_client``), and wakes
each consumer event loop once per message.  It also pings the engines and notices one that went silent.  No
torch.

Usage (``front_process``)::

    hub = EngineHub("tcp://127.0.0.1:40123", token, replicas=1, stream_interval=1)
    clients = hub.wait_ready(timeout_s)          # [EngineClient] in replica order
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import zmq

from qwen_chat.chat_types import GenerationSettings
from qwen_chat.engine import wire
from qwen_chat.engine.client.engine_client import EngineClient
# (imported here, not by the first request: its first token waited ~50-80 ms for it on 2 CPU cores)
from qwen_chat.engine.output.replies import ReplyAssembler
from qwen_chat.engine.output.updates import TokenTable

log = logging.getLogger(__name__)
#: Longest wait (s) for the first prompt worker's token strings at start-up: it loads the processor first
#: (imports included: tens of seconds on 2 busy CPU cores); a worker that fails ends the wait at once.
TOKEN_TABLE_WAIT_S = 600.0


def _apply(batch: list) -> None:
    """Hand one message's updates to their inboxes: on the consumers' event loop for async inboxes, on the
    receiver thread for thread inboxes."""
    for req, updates, answer, done in batch:
        req.inbox.deliver(updates, answer, done)


class EngineHub:
    """The front's receiving side of every engine process (module docstring).

    Args:
        address: where the PULL socket binds (``tcp://host:port``; the engines connect to it).
        token: the link's secret: a hello without it is ignored.
        replicas: how many engine processes to wait for.
        stream_interval: tokens per update at most for a reader that keeps up (``--stream-interval``).
        prompt_workers: processes that build prompts (``prompt_worker.PromptPool``; ``--prompt-workers``).
        on_engine_gone: called (reason) when an engine process is gone after its hello, or says it failed.
    """

    def __init__(self, address: str, token: str, replicas: int, stream_interval: int = 1,
                 on_engine_gone: Optional[Callable[[str], None]] = None, prompt_workers: int = 2) -> None:
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(address)
        self.token, self.replicas = token, int(replicas)
        self.stream_interval = max(1, int(stream_interval))
        self.on_engine_gone = on_engine_gone
        self.clients: dict[int, EngineClient] = {}
        self.failure: Optional[str] = None
        self.silent: set[int] = set()  # replicas whose engine process stopped sending status (frozen, or gone)
        self.ready = threading.Event()
        self._tokens = None
        self.prompt_workers = int(prompt_workers)
        self.prompts = None  # PromptPool: made by start_prompts, or at replica 0's hello (its checkpoint folder)
        self._prompts_key: Optional[tuple[str, int]] = None  # (folder, image token budget) of self.prompts
        self._prompts_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-recv", daemon=True)
        self._thread.start()
        threading.Thread(target=self._ping, name="engine-ping", daemon=True).start()

    def start_prompts(self, checkpoint: Path, image_token_budget: int) -> None:
        """Run the prompt workers on ``checkpoint``'s processor (kept when they run on it already).  The front
        calls it with ``--model`` a local folder, while the engine still loads (they take seconds to import and
        load: started at the hello, /healthz would wait for them after the engine is ready); the hello calls
        it with the folder the engine loaded.  Workers whose start failed (``PromptPool.failed``: the early start
        found the folder before it was whole) are started again.  Nothing is started after ``close``."""
        from qwen_chat.engine.text.prompt_worker import PromptPool

        key = (str(Path(checkpoint).expanduser().resolve()), int(image_token_budget))
        with self._prompts_lock:
            if self._stop.is_set():
                return
            if self._prompts_key == key:
                if not self.prompts.failed():
                    return
                log.warning("front: the prompt workers started early on %s failed to load it; started again",
                            key[0])
            elif self.prompts is not None:
                log.info("front: the engine loaded %s; prompt workers restarted on it", key[0])
            if self.prompts is not None:
                self.prompts.close()
            self.prompts = PromptPool(Path(key[0]), self.prompt_workers, image_token_budget)
            self._prompts_key = key

    def assembler(self, settings: GenerationSettings, prompt_tokens: int, notice: str, dropped: int, rid: int):
        """A ``ReplyAssembler`` for an accepted request (the token table of replica 0's checkpoint, loaded before
        ready: ``_finish_setup``)."""
        setup = self.clients[min(self.clients)].setup
        tool_ids = tuple(setup["tool_ids"]) if setup.get("tool_ids") else None
        return ReplyAssembler(settings.n, settings, prompt_tokens=prompt_tokens, notice=notice,
                              dropped_messages=dropped, tokenizer=self._tokens, think_ids=tuple(setup["think_ids"]),
                              eos_ids=tuple(setup["eos_ids"]), tool_ids=tool_ids, request_id=rid)

    def _finish_setup(self) -> None:
        """Once every engine said hello (and the prompt workers run on replica 0's checkpoint): the token table
        the replies are decoded with, loaded now rather than by the first request, from a prompt worker (the
        tokenizer parsed there, not under this process's GIL: ``TokenTable``); then ready."""
        setup = self.clients[0].setup
        try:
            if self.prompts.wait_warm(TOKEN_TABLE_WAIT_S) and self.prompts.failed():  # (still loading at the hello)
                self.start_prompts(Path(setup["checkpoint"]), int(setup["image_token_budget"]))
            if self._tokens is None:
                self._tokens = TokenTable(self.prompts.token_strings(TOKEN_TABLE_WAIT_S))
        except Exception as exc:  # noqa: BLE001 - reported as the front's start-up failure
            log.exception("front: loading the checkpoint's tokenizer failed")
            self.failure = f"the web front could not load the tokenizer of {setup['checkpoint']}: {exc}"
            return
        self.ready.set()

    def wait_ready(self, timeout_s: float, stop: Optional[Callable[[], bool]] = None) -> list[EngineClient]:
        """Wait until every engine said hello; their clients in replica order.  Raises RuntimeError with the
        engine's reason when one reported a failed start, TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if self.failure:
                raise RuntimeError(self.failure)
            if stop is not None and stop():
                raise RuntimeError("stopped while waiting for the engine")
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.replicas)) - set(self.clients))
                raise TimeoutError(f"engine process(es) of replica(s) {missing} did not connect within "
                                   f"{timeout_s:.0f} s")
        return [self.clients[r] for r in range(self.replicas)]

    def close(self) -> None:
        """Stop the receiver and ping threads and the prompt workers."""
        with self._prompts_lock:
            self._stop.set()
            if self.prompts is not None:
                self.prompts.close()

    def _ping(self) -> None:
        while not self._stop.wait(wire.PING_INTERVAL_S):
            for client in list(self.clients.values()):
                if not client.lost and not client._closing:
                    try:
                        client.send(["ping"])
                    except zmq.ZMQError:
                        pass
            self._check_silent()

    def _check_silent(self) -> None:
        now = time.monotonic()
        for client in list(self.clients.values()):
            if not client.lost and not client._closing and now - client._status_at > wire.ENGINE_SILENT_S:
                self.silent.add(client.replica)
                self._lose(client, f"no status for {now - client._status_at:.0f} s (frozen?)")

    def lose_all(self, reason: str) -> None:
        """Every engine counts as gone (the front saw its engine process exit)."""
        for client in list(self.clients.values()):
            self._lose(client, reason)

    def _lose(self, client: EngineClient, reason: str) -> None:
        deliveries: dict = {}
        client.on_lost(reason, deliveries)
        self._flush(deliveries)
        if self.on_engine_gone is not None and not client._closing:
            self.on_engine_gone(f"replica {client.replica}: {reason}")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                replica, events = wire.loads(self.pull.recv())
            except Exception:  # noqa: BLE001 - not one of ours
                log.warning("engine link: dropped a message that is not ours")
                continue
            deliveries: dict = {}
            try:
                self._dispatch(int(replica), events, deliveries)
            except Exception:  # noqa: BLE001 - the next message may be fine; this one's requests may stall
                log.exception("engine link: could not handle a message of replica %s", replica)
            self._flush(deliveries)

    def _dispatch(self, replica: int, events: list, deliveries: dict) -> None:
        client = self.clients.get(replica)
        if client is None:
            for event in events:
                if event[0] == "failed":
                    self.failure = event[1]
                    if self.on_engine_gone is not None:
                        self.on_engine_gone(f"replica {replica}: {event[1]}")
                elif event[0] == "hello" and event[1] == self.token and 0 <= replica < self.replicas:
                    _, _, input_address, status, setup = event
                    # the client first: its pings start now (the engine waits for them), the loading below is
                    # done beside it
                    client = self.clients[replica] = EngineClient(self, replica, input_address, status, setup)
                    log.info("replica %d: its engine process connected (%s)", replica,
                             status["health"].get("reason"))
                    if len(self.clients) == self.replicas:
                        # the prompt workers are started from this long-lived thread: their parent-death signal
                        # (prompt_worker) fires when the thread that started them ends, not only the process
                        setup = self.clients[0].setup
                        self.start_prompts(Path(setup["checkpoint"]), int(setup["image_token_budget"]))
                        threading.Thread(target=self._finish_setup, name="front-setup", daemon=True).start()
                elif client is not None:
                    client.on_events([event], deliveries)
            return
        client.on_events(events, deliveries)

    @staticmethod
    def _flush(deliveries: dict) -> None:
        for loop, batch in deliveries.items():
            if loop is None:
                _apply(batch)
            else:
                try:
                    loop.call_soon_threadsafe(_apply, batch)
                except RuntimeError:  # the loop is closed: the server is gone
                    pass


def link_address(host: str) -> str:
    """A ``tcp://host:port`` address with a port free now on ``host`` (the front binds it)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"


def parent_watch() -> Callable[[], bool]:
    """A function telling whether this process's parent (the engine process of replica 0) has gone."""
    parent = os.getppid()
    return lambda: os.getppid() != parent
