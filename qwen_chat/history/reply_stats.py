"""Per-reply statistics: tokens, time to first token, decode speed and cached prompt tokens of one reply.

``ReplyStats`` watches a reply's ``StreamUpdate``s as they arrive and gives ``record()``, the plain JSON dict
saved with the assistant message (``records.StoredMessage.stats``) and shown under it::

    {"prompt_tokens": 130, "cached_tokens": 120, "completion_tokens": 42, "ttft_s": 0.31, "tokens_per_s": 18.2}

* ``prompt_tokens`` / ``completion_tokens`` / ``cached_tokens``: the engine's counts of the last update, the same
  numbers the OpenAI-compatible API returns as ``usage.prompt_tokens``, ``usage.completion_tokens`` and
  ``usage.prompt_tokens_details.cached_tokens`` for the same request (tokens);
* ``ttft_s``: time to first token in seconds: the engine's own ``ttft_s`` when it reports one, else the wall
  time from ``ReplyStats()`` (made when the request is sent) to the first update that carries text or tokens;
* ``tokens_per_s``: decode speed, ``(completion_tokens - 1) / (t_last - t_first)`` over the updates seen (the
  first token's time excluded, so prefill does not count: the same definition as the service's
  ``qwen_chat_decode_tokens_per_second`` metric); None until two tokens have arrived.

No torch, no Gradio.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

#: The keys of a saved record and their types (``check_stats`` enforces them).
STATS_KEYS = {"prompt_tokens": int, "cached_tokens": int, "completion_tokens": int, "ttft_s": float,
              "tokens_per_s": float}


class ReplyStats:
    """The statistics of one reply while it streams (see the module docstring for the definitions).

    ``clock``: monotonic seconds (``time.monotonic``; tests pass their own).  Not thread-safe: one reply is fed
    by one thread; ``record()`` returns a fresh dict that other threads may read.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self.first_at: Optional[float] = None
        self.last_at: Optional[float] = None
        self.ttft_s: Optional[float] = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0

    def see(self, update: Any) -> None:
        """Take the counts and times of one ``StreamUpdate`` (the final one included)."""
        now = self._clock()
        produced = bool(update.reasoning_delta or update.answer_delta or update.completion_tokens)
        if self.first_at is None and produced:
            self.first_at = now
            self.ttft_s = update.ttft_s if update.ttft_s is not None else now - self.started
        if produced and update.completion_tokens > self.completion_tokens:
            self.last_at = now
        self.prompt_tokens = max(self.prompt_tokens, int(update.prompt_tokens or 0))
        self.completion_tokens = max(self.completion_tokens, int(update.completion_tokens or 0))
        self.cached_tokens = max(self.cached_tokens, int(getattr(update, "cached_tokens", 0) or 0))

    def tokens_per_s(self) -> Optional[float]:
        """Decode speed in tokens per second after the first token; None before two tokens arrived."""
        if self.first_at is None or self.last_at is None or self.completion_tokens < 2:
            return None
        elapsed = self.last_at - self.first_at
        return (self.completion_tokens - 1) / elapsed if elapsed > 0 else None

    def record(self) -> dict:
        """The JSON dict saved with the reply (module docstring); ``ttft_s``/``tokens_per_s`` may be None."""
        speed = self.tokens_per_s()
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens,
                "ttft_s": None if self.ttft_s is None else round(float(self.ttft_s), 3),
                "tokens_per_s": None if speed is None else round(speed, 2)}


def check_stats(value: Any) -> Optional[dict]:
    """Validate a saved ``stats`` record: None, or a dict whose known keys (``STATS_KEYS``) hold non-negative
    numbers (or None); unknown keys are dropped (a newer writer's extra fields).  Returns the cleaned dict.

    Raises:
        ValueError: not a dict, or a known key holding something else.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("stats must be an object")
    clean: dict = {}
    for key, kind in STATS_KEYS.items():
        number = value.get(key)
        if number is None:
            clean[key] = None if kind is float else 0
            continue
        if isinstance(number, bool) or not isinstance(number, (int, float)) or number != number or number < 0:
            raise ValueError(f"stats.{key} must be a non-negative number, got {number!r}")
        clean[key] = int(number) if kind is int else float(number)
    return clean
