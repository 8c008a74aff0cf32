"""A scripted ``ChatBackend`` for the API and ops tests: no model, deterministic words, real cancellation.

Also ``serve_app(app)`` (a real uvicorn server on a free loopback port, in a background thread) and
``build_app(backend, cfg)`` (the API + ops part of the web server) for the HTTP tests.

Behaviour of ``FakeBackend`` (the engine's contract from ``qwen_chat.chat_types.ChatBackend``):

- errors are raised before the first update: ``NotReady`` while ``ready`` is False, ``InvalidInput`` from
  ``settings.validate()``, ``ContextTooLong`` when the prompt (one token per whitespace word, 16 per image)
  exceeds ``info.context_length``, ``Busy`` when ``capacity`` streams are already running;
- one token per update: ``reasoning_words`` reasoning tokens when thinking is on, then the answer
  ``You said: <last user text> [<n> image(s) WxH ...] [<m> messages]`` followed by ``answer_words`` filler
  words; filler words are drawn from ``random.Random(seed)`` when temperature > 0 (fresh seed when None),
  and fixed when temperature == 0;
- ``max_new_tokens`` tokens in total -> finish_reason "length"; a ``stop`` string in the answer cuts it there
  -> "stop"; ``cancel`` or closing the generator -> "cancelled" within one step of ``step_delay_s`` seconds.
"""
from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from fastapi import FastAPI
from PIL import Image

from qwen_chat.chat_types import (
    Busy,
    CancelToken,
    ChatMessage,
    ContextTooLong,
    GenerationSettings,
    ModelInfo,
    NotReady,
    StreamUpdate,
)
from qwen_chat.config import ServiceConfig
from qwen_chat.web import api, ops
from tests.support.service_harness import RunningServer

VOCAB = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")
TOKENS_PER_IMAGE = 16


@dataclass
class FakeCall:
    """One ``stream_chat`` call as received, and how it ended."""

    messages: tuple[ChatMessage, ...]
    settings: GenerationSettings
    finish_reason: Optional[str] = None
    steps: int = 0
    closed: bool = False


@dataclass
class FakeBackend:
    reasoning_words: int = 4
    answer_words: int = 6
    step_delay_s: float = 0.0
    capacity: int = 4
    ready: bool = True
    info: ModelInfo = field(default_factory=lambda: ModelInfo(name="fake-qwen", demo=True, context_length=256))
    calls: list[FakeCall] = field(default_factory=list)
    gpu_memory_bytes: tuple[int, ...] = (1000, 2000)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0

    # ---- ChatBackend
    def health(self) -> dict:
        return {"ok": self.ready, "reason": "" if self.ready else "loading model"}

    def stats(self) -> dict:
        with self._lock:
            running = self.active
        return {"queue_depth": 0, "running": running, "gpu_memory_bytes": list(self.gpu_memory_bytes)}

    def stream_chat(
        self, messages: Sequence[ChatMessage], settings: GenerationSettings, cancel: CancelToken
    ) -> Iterator[StreamUpdate]:
        call = FakeCall(tuple(messages), settings)
        self.calls.append(call)
        if not self.ready:
            raise NotReady("the model is still loading")
        settings.validate()
        prompt_tokens = sum(len(m.text.split()) + TOKENS_PER_IMAGE * len(m.images) for m in messages)
        if prompt_tokens > self.info.context_length:
            raise ContextTooLong(
                f"prompt is {prompt_tokens} tokens; the context holds {self.info.context_length}",
                prompt_tokens, self.info.context_length,
            )
        with self._lock:
            if self.active >= self.capacity:
                raise Busy("the generation queue is full; retry in a moment")
            self.active += 1
        return self._generate(call, messages, settings, cancel, prompt_tokens)

    # ---- script
    @staticmethod
    def _answer_head(messages: Sequence[ChatMessage]) -> list[str]:
        last = messages[-1]
        sizes = []
        for path in last.images:
            with Image.open(path) as im:
                sizes.append(f"{im.size[0]}x{im.size[1]}")
        head = ["You", "said:", *last.text.split(), f"[{len(last.images)} image(s) {' '.join(sizes)}]".replace(" ]", "]")]
        head.append(f"[{len(messages)} messages]")
        return head

    def _generate(self, call: FakeCall, messages, settings: GenerationSettings, cancel: CancelToken,
                  prompt_tokens: int) -> Iterator[StreamUpdate]:
        rng = random.Random(settings.seed if settings.seed is not None else random.SystemRandom().random())

        def filler(n: int) -> list[str]:
            if settings.temperature == 0:
                return [VOCAB[i % len(VOCAB)] for i in range(n)]
            return [rng.choice(VOCAB) for _ in range(n)]

        reasoning_tokens = (["Thinking", "about", "it:"] + filler(self.reasoning_words)) if settings.enable_thinking else []
        answer_tokens = self._answer_head(messages) + filler(self.answer_words)
        reasoning = answer = ""
        produced = 0
        finish = "stop"
        start = time.monotonic()
        try:
            plan = [("r", t) for t in reasoning_tokens] + [("a", t) for t in answer_tokens]
            for index, (part, token) in enumerate(plan):
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
                if cancel.cancelled:
                    finish = "cancelled"
                    break
                if produced >= settings.max_new_tokens:
                    finish = "length"
                    break
                produced += 1
                call.steps = produced
                piece = token + ("" if index + 1 == len(plan) or plan[index + 1][0] != part else " ")
                if part == "r":
                    reasoning += piece
                    update = StreamUpdate(reasoning=reasoning, answer=answer, reasoning_delta=piece, thinking=True,
                                          prompt_tokens=prompt_tokens, completion_tokens=produced,
                                          ttft_s=time.monotonic() - start if produced == 1 else None)
                else:
                    new_answer = answer + piece
                    cut = min((new_answer.find(s) for s in settings.stop if s in new_answer), default=-1)
                    if cut >= 0:
                        piece = new_answer[len(answer):cut]
                        answer = new_answer[:cut]
                        finish = "stop"
                        if piece:
                            yield StreamUpdate(reasoning=reasoning, answer=answer, answer_delta=piece,
                                               prompt_tokens=prompt_tokens, completion_tokens=produced)
                        break
                    answer = new_answer
                    update = StreamUpdate(reasoning=reasoning, answer=answer, answer_delta=piece,
                                          prompt_tokens=prompt_tokens, completion_tokens=produced,
                                          ttft_s=time.monotonic() - start if produced == 1 else None)
                yield update
            call.finish_reason = finish
            yield StreamUpdate(reasoning=reasoning, answer=answer, finish_reason=finish,
                               thinking=False, prompt_tokens=prompt_tokens, completion_tokens=produced)
        except GeneratorExit:
            call.closed = True
            call.finish_reason = call.finish_reason or "cancelled"
            raise
        finally:
            with self._lock:
                self.active -= 1


@contextlib.contextmanager
def serve_app(app: FastAPI, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """``RunningServer`` (tests/support/service_harness.py) yielding the base URL without a trailing slash."""
    with RunningServer(app, timeout_s=startup_timeout_s) as server:
        yield server.url.rstrip("/")


def build_app(backend, cfg: ServiceConfig) -> tuple[FastAPI, ops.InstrumentedBackend]:
    """The API + ops part of the real server: instrumented backend, /v1 routes, /healthz, /metrics."""
    instrumented = ops.instrument(backend)
    app = FastAPI()
    app.include_router(api.create_router(instrumented, cfg))
    app.include_router(ops.create_router(instrumented))
    return app, instrumented
