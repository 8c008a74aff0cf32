"""One scripted ``ChatBackend`` for the UI, API and ops tests: no model, deterministic words, real cancellation.

It keeps the contract of ``qwen_chat.chat_types.ChatBackend`` the way the engine does:

- errors are raised by ``stream_chat`` itself, before the first update: ``NotReady`` while ``ready`` is False,
  ``InvalidInput`` from ``settings.validate()``, ``fail_with`` when set, ``ValueError`` when the last message is
  not the user's, ``ContextTooLong`` when the prompt (one token per whitespace-separated word, 16 per image)
  exceeds ``info.context_length``, ``Busy`` when ``capacity`` streams are already accepted and not finished;
- one token per update: the ``reasoning`` words then ``reasoning_words`` filler words when thinking is on, then
  the ``answer`` words then ``answer_words`` filler words.  ``answer`` is a template (see ``FakeBackend``);
  filler words are drawn from ``random.Random(settings.seed)`` when temperature > 0 (a fresh seed when None)
  and fixed when temperature == 0;
- ``settings.max_new_tokens`` (or ``max_steps``, whichever is smaller) tokens in total -> finish_reason
  "length" (with a notice when it cut the reasoning); a ``settings.stop`` string in the answer cuts it there ->
  "stop"; the cancel token or closing the generator -> "cancelled" within one step of ``step_delay_s`` seconds.

Two scripts are used by the tests: ``FakeBackend()`` (the API and ops tests: answer
``You said: <last user text> [<n> image(s) WxH ...] [<m> messages]`` plus six filler words) and
``FakeBackend.for_ui()`` (the UI tests: ``You said: <last user text> (<n> image(s))``, fixed reasoning, no filler).

Usage::

    backend = FakeBackend.for_ui(answer="Hello there", reasoning="Let me think", step_delay_s=0.01)
    for update in backend.stream_chat(messages, GenerationSettings.preset(True), CancelToken()): ...
    backend.calls[-1].messages   # what the caller sent, images included
"""
from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from PIL import Image

from qwen_chat.chat_types import (
    Busy,
    CancelToken,
    ChatError,
    ChatMessage,
    ContextTooLong,
    GenerationSettings,
    ModelInfo,
    NotReady,
    StreamUpdate,
)

FILLER_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
                "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")
TOKENS_PER_IMAGE = 16
THINKING_CUT_NOTICE = "stopped: token limit reached while thinking"
API_ANSWER = "You said: {last_user} [{images} image(s){sizes}] [{messages} messages]"
UI_ANSWER = "You said: {last_user} ({images} image(s))"
UI_REASONING = "The user wrote something; I will repeat it."
# A space splits two tokens unless it stands inside [...]: "[1 image(s) 64x48]" is one token.
_TOKEN_BREAK = re.compile(r" (?![^\[\]]*\])")


@dataclass
class FakeCall:
    """One ``stream_chat`` call as received, and how it ended.

    ``finish_reason``: None while running, else the last update's; "cancelled" also when the generator was
    closed (then ``closed`` is True).  ``steps``: tokens streamed.  ``prompt_tokens``: the fake token count.
    """

    messages: tuple[ChatMessage, ...]
    settings: GenerationSettings
    finish_reason: Optional[str] = None
    steps: int = 0
    closed: bool = False
    prompt_tokens: int = 0


def _tokens(text: str) -> list[str]:
    return _TOKEN_BREAK.split(text) if text else []


def _image_sizes(paths: Sequence[str]) -> str:
    sizes = []
    for path in paths:
        with Image.open(path) as im:
            sizes.append(f" {im.size[0]}x{im.size[1]}")
    return "".join(sizes)


@dataclass
class FakeBackend:
    """The scripted backend; every field may be changed between calls (the tests do).

    ``answer``: a template with ``{last_user}`` (the last message's text), ``{images}`` (its number of images),
    ``{sizes}`` (`` WxH`` per image, in pixels) and ``{messages}`` (the number of messages sent).
    ``reasoning``: the reasoning words (thinking on).  ``answer_words`` / ``reasoning_words``: filler words
    appended to each.  ``step_delay_s``: seconds slept before every token.  ``max_steps``: a token limit below
    ``settings.max_new_tokens``.  ``capacity``: streams accepted at once.  ``ready``: False -> ``NotReady``.
    ``fail_with``: a ``ChatError`` raised by ``stream_chat``.  ``notice``: put on the last update.
    ``gpu_memory_bytes``: what ``stats()`` reports per rank.  ``cached_tokens``: the prompt tokens every update
    says the conversation cache held.
    """

    answer: str = API_ANSWER
    reasoning: str = "Thinking about it:"
    reasoning_words: int = 4
    answer_words: int = 6
    step_delay_s: float = 0.0
    max_steps: Optional[int] = None
    capacity: int = 4
    ready: bool = True
    fail_with: Optional[ChatError] = None
    notice: str = ""
    info: ModelInfo = field(default_factory=lambda: ModelInfo(name="fake-qwen", demo=True, context_length=256))
    calls: list[FakeCall] = field(default_factory=list)
    gpu_memory_bytes: tuple[int, ...] = (1000, 2000)
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0  # streams accepted and not finished

    @classmethod
    def for_ui(cls, **overrides) -> "FakeBackend":
        """The UI tests' script: answer ``You said: <text> (<n> image(s))``, reasoning ``UI_REASONING``, no
        filler words, model "scripted" with a 4096-token context; ``overrides`` replace any field."""
        fields = dict(answer=UI_ANSWER, reasoning=UI_REASONING, reasoning_words=0, answer_words=0,
                      info=ModelInfo(name="scripted", demo=True, context_length=4096))
        return cls(**{**fields, **overrides})

    # ---- ChatBackend
    def health(self) -> dict:
        """``{"ok": ready, "reason": "" or "loading model"}``."""
        return {"ok": self.ready, "reason": "" if self.ready else "loading model"}

    def stats(self) -> dict:
        """Queue depth 0, the running streams, ``gpu_memory_bytes`` (bytes per rank)."""
        with self._lock:
            running = self.active
        return {"queue_depth": 0, "running": running, "gpu_memory_bytes": list(self.gpu_memory_bytes)}

    def stream_chat(
        self, messages: Sequence[ChatMessage], settings: GenerationSettings, cancel: CancelToken
    ) -> Iterator[StreamUpdate]:
        """Record the call, check it (errors as in the module docstring), then return the update generator."""
        call = FakeCall(tuple(messages), settings)
        self.calls.append(call)
        if not self.ready:
            raise NotReady("the model is still loading")
        settings.validate()
        if self.fail_with is not None:
            raise self.fail_with
        if not messages or messages[-1].role != "user":
            raise ValueError("the last message must be a user message")
        call.prompt_tokens = sum(len(m.text.split()) + TOKENS_PER_IMAGE * len(m.images) for m in messages)
        if call.prompt_tokens > self.info.context_length:
            raise ContextTooLong(
                f"prompt is {call.prompt_tokens} tokens; the context holds {self.info.context_length}",
                call.prompt_tokens, self.info.context_length,
            )
        with self._lock:
            if self.active >= self.capacity:
                raise Busy("the generation queue is full; retry in a moment")
            self.active += 1
        return self._stream(call, cancel)

    # ---- script
    def _plan(self, call: FakeCall) -> list[tuple[str, str]]:
        """[("r" | "a", token)]: reasoning tokens (thinking on), then answer tokens."""
        settings, last = call.settings, call.messages[-1]
        rng = random.Random(settings.seed if settings.seed is not None else random.SystemRandom().random())

        def filler(n: int) -> list[str]:
            if settings.temperature == 0:
                return [FILLER_WORDS[i % len(FILLER_WORDS)] for i in range(n)]
            return [rng.choice(FILLER_WORDS) for _ in range(n)]

        reasoning = _tokens(self.reasoning) + filler(self.reasoning_words) if settings.enable_thinking else []
        sizes = _image_sizes(last.images) if "{sizes}" in self.answer else ""
        answer = self.answer.format(last_user=last.text, images=len(last.images), sizes=sizes,
                                    messages=len(call.messages))
        return [("r", t) for t in reasoning] + [("a", t) for t in _tokens(answer) + filler(self.answer_words)]

    def _stream(self, call: FakeCall, cancel: CancelToken) -> Iterator[StreamUpdate]:
        settings = call.settings
        limit = settings.max_new_tokens if self.max_steps is None else min(self.max_steps, settings.max_new_tokens)
        reasoning = answer = ""
        finish, cut_in = "stop", ""  # cut_in: the part ("r"/"a") of the token a limit or cancel kept back
        start = time.monotonic()
        try:
            plan = self._plan(call)
            for index, (part, token) in enumerate(plan):
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
                if cancel.cancelled or call.steps >= limit:
                    finish, cut_in = ("cancelled" if cancel.cancelled else "length"), part
                    break
                call.steps += 1
                piece = token if index == 0 or plan[index - 1][0] != part else " " + token
                counts = dict(prompt_tokens=call.prompt_tokens, completion_tokens=call.steps,
                              cached_tokens=min(self.cached_tokens, call.prompt_tokens),
                              ttft_s=time.monotonic() - start if call.steps == 1 else None)
                if part == "r":
                    reasoning += piece
                    yield StreamUpdate(reasoning=reasoning, answer=answer, reasoning_delta=piece, thinking=True,
                                       **counts)
                    continue
                new_answer = answer + piece
                cut = min((new_answer.find(s) for s in settings.stop if s in new_answer), default=-1)
                if cut >= 0:
                    piece, answer = new_answer[len(answer):cut], new_answer[:cut]
                    if piece:
                        yield StreamUpdate(reasoning=reasoning, answer=answer, answer_delta=piece, **counts)
                    break
                answer = new_answer
                yield StreamUpdate(reasoning=reasoning, answer=answer, answer_delta=piece, **counts)
            still_thinking = cut_in == "r"
            notice = "" if finish == "cancelled" else (
                self.notice or (THINKING_CUT_NOTICE if still_thinking else ""))
            call.finish_reason = finish
            yield StreamUpdate(reasoning=reasoning, answer=answer, finish_reason=finish, thinking=still_thinking,
                               notice=notice, prompt_tokens=call.prompt_tokens, completion_tokens=call.steps,
                               cached_tokens=min(self.cached_tokens, call.prompt_tokens))
        except GeneratorExit:
            call.closed = True
            call.finish_reason = call.finish_reason or "cancelled"
            raise
        finally:
            with self._lock:
                self.active -= 1
