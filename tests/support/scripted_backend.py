"""A scripted ``ChatBackend`` for UI tests: no model, deterministic replies, real cancellation semantics.

It implements the protocol of ``qwen_chat.chat_types.ChatBackend`` the way the engine does (validate before
the first update, reasoning first when thinking is on, ``finish_reason`` on the last update, Stop/close ends
the stream within one step), so the UI can be tested without torch.

Usage::

    backend = ScriptedBackend(answer="Hello there", reasoning="Let me think", step_delay_s=0.01)
    for update in backend.stream_chat(messages, GenerationSettings.preset(True), CancelToken()): ...
    backend.calls[-1].messages   # what the UI sent, images included
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from qwen_chat.chat_types import (
    CancelToken,
    ChatError,
    ChatMessage,
    GenerationSettings,
    ModelInfo,
    StreamUpdate,
)


@dataclass
class Call:
    """One ``stream_chat`` call as the backend received it."""

    messages: tuple[ChatMessage, ...]
    settings: GenerationSettings
    finish_reason: Optional[str] = None
    steps: int = 0


@dataclass
class ScriptedBackend:
    """Streams ``reasoning`` (when thinking is on) then ``answer``, one whitespace-separated word per step.

    ``answer`` may contain ``{last_user}``, replaced by the last user message's text, and ``{images}``, replaced
    by the number of images in that message.  ``step_delay_s`` (seconds) is slept before every update.
    ``fail_with``: a ``ChatError`` raised before the first update (as the engine does for bad requests).
    ``max_steps``: the reply is cut off after this many words in total (finish_reason "length").
    """

    answer: str = "You said: {last_user} ({images} image(s))"
    reasoning: str = "The user wrote something; I will repeat it."
    step_delay_s: float = 0.0
    fail_with: Optional[ChatError] = None
    max_steps: Optional[int] = None
    notice: str = ""
    info: ModelInfo = field(
        default_factory=lambda: ModelInfo(name="scripted", demo=True, context_length=4096)
    )
    calls: list[Call] = field(default_factory=list)
    active: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def health(self) -> dict:
        """Always healthy: ``{"ok": True, "reason": "scripted"}``."""
        return {"ok": True, "reason": "scripted"}

    def stream_chat(
        self, messages: Sequence[ChatMessage], settings: GenerationSettings, cancel: CancelToken
    ) -> Iterator[StreamUpdate]:
        """Validate, then return the update generator (errors surface before the first update)."""
        settings.validate()
        if self.fail_with is not None:
            raise self.fail_with
        if not messages or messages[-1].role != "user":
            raise ValueError("the last message must be a user message")
        call = Call(messages=tuple(messages), settings=settings)
        self.calls.append(call)
        return self._stream(call, cancel)

    def _stream(self, call: Call, cancel: CancelToken) -> Iterator[StreamUpdate]:
        last = call.messages[-1]
        answer_words = self.answer.format(last_user=last.text, images=len(last.images)).split(" ")
        reasoning_words = self.reasoning.split(" ") if call.settings.enable_thinking else []
        plan = [("r", w) for w in reasoning_words] + [("a", w) for w in answer_words]
        budget = self.max_steps if self.max_steps is not None else len(plan)
        reasoning, answer = "", ""
        with self._lock:
            self.active += 1
        try:
            for i, (part, word) in enumerate(plan[:budget]):
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
                if cancel.cancelled:
                    call.finish_reason = "cancelled"
                    yield StreamUpdate(reasoning=reasoning, answer=answer, finish_reason="cancelled",
                                       thinking=part == "r")
                    return
                delta = word if i == 0 or (part == "a" and not answer) else " " + word
                if part == "r":
                    reasoning += delta
                    update = StreamUpdate(reasoning=reasoning, reasoning_delta=delta, thinking=True)
                else:
                    answer += delta
                    update = StreamUpdate(reasoning=reasoning, answer=answer, answer_delta=delta)
                call.steps += 1
                yield update
            cut = budget < len(plan)
            still_thinking = cut and plan[budget][0] == "r"
            call.finish_reason = "length" if cut else "stop"
            yield StreamUpdate(
                reasoning=reasoning,
                answer=answer,
                thinking=still_thinking,
                finish_reason=call.finish_reason,
                notice=self.notice or ("stopped: token limit reached while thinking" if still_thinking else ""),
                completion_tokens=call.steps,
            )
        finally:
            if call.finish_reason is None:
                call.finish_reason = "closed"
            with self._lock:
                self.active -= 1


# Re-exported for the UI tests that import them from here.
from tests.support.service_harness import RunningServer, free_port  # noqa: E402,F401
