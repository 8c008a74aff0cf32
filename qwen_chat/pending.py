"""A ``ChatBackend`` that stands in for the engine while it loads, so the port is served from the first second.

``app.py`` binds the port and starts the web server before the model loads (minutes for the 9B): meanwhile
``/healthz`` answers 503 ``{"reason": "loading"}``, the API answers 503 and the UI shows a "still loading"
message; once ``attach(engine)`` is called every call goes to the engine.  Serving early also makes a busy port
fail the start-up at once instead of after the model load.  No torch here (the web layer uses it).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

from qwen_chat.chat_types import (
    CancelToken,
    ChatBackend,
    ChatMessage,
    GenerationSettings,
    ModelInfo,
    NotReady,
    StreamUpdate,
)

# Marker file that the built-in tiny checkpoint carries (qwen_chat.engine.checkpoints.tiny writes it; defined here, in the
# torch-free module, so the page can show the demo badge before the engine has loaded).
DEMO_MARKER = "QWEN_CHAT_DEMO"


def provisional_info(model: str) -> ModelInfo:
    """What the UI can show before the model is loaded: the ``--model`` value and whether it is the demo.

    ``context_length`` is 0 until the engine reports the real one.
    """
    demo = model == "tiny" or (Path(model).expanduser() / DEMO_MARKER).is_file()
    return ModelInfo(name=model, demo=demo, context_length=0)


class PendingBackend:
    """Forwards to the engine once attached; before that reports "loading" (or the start-up failure).

    Thread-safe: ``attach``/``fail`` are called by the start-up thread while the web server's threads call
    ``stream_chat``/``health``.
    """

    def __init__(self, info: ModelInfo) -> None:
        self._lock = threading.Lock()
        self._engine: Optional[ChatBackend] = None
        self._failure: Optional[str] = None
        self._warming = False
        self._info = info

    def attach(self, engine: ChatBackend, warming: bool = False) -> None:
        """Route every later call to ``engine`` (the started ``ChatEngine``).  With ``warming`` the engine
        serves requests but ``health()`` still reports ``"warming up"`` until ``warmed()`` (the front's own
        first requests: ``web.self_warm``)."""
        with self._lock:
            self._warming = warming
            self._engine = engine

    def warmed(self) -> None:
        """End the warm-up ``attach(..., warming=True)`` began: ``health()`` is the engine's from now on."""
        with self._lock:
            self._warming = False

    def fail(self, reason: str) -> None:
        """Record that the start-up failed; health and requests report ``reason`` until the process exits."""
        with self._lock:
            self._failure = reason

    @property
    def engine(self) -> Optional[ChatBackend]:
        return self._engine

    @property
    def info(self) -> ModelInfo:
        engine = self._engine
        return engine.info if engine is not None else self._info

    def _not_ready(self) -> NotReady:
        if self._failure:
            return NotReady(f"the model failed to start: {self._failure}")
        return NotReady("the model is still loading; try again in a moment")

    def stream_chat(
        self, messages: Sequence[ChatMessage], settings: GenerationSettings, cancel: CancelToken
    ) -> Iterator[StreamUpdate]:
        """The engine's ``stream_chat``; raises ``NotReady`` (HTTP 503) while loading."""
        engine = self._engine
        if engine is None:
            raise self._not_ready()
        return engine.stream_chat(messages, settings, cancel)

    @property
    def supports_async(self) -> bool:
        """True when the engine has ``astream_chat`` (the engine client); before attaching, True as well:
        ``astream_chat`` then raises NotReady."""
        engine = self._engine
        return engine is None or bool(getattr(engine, "supports_async", False))

    async def astream_chat(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                           cancel: CancelToken) -> AsyncIterator[StreamUpdate]:
        """The engine's ``astream_chat`` (only when ``supports_async``); raises ``NotReady`` (HTTP 503) while
        loading."""
        engine = self._engine
        if engine is None:
            raise self._not_ready()
        return await engine.astream_chat(messages, settings, cancel)

    def health(self) -> dict:
        """The engine's health, or ``{"ok": False, "reason": "loading"}`` before it is attached."""
        engine = self._engine
        if engine is None:
            return {"ok": False, "reason": f"start-up failed: {self._failure}" if self._failure else "loading"}
        if self._warming:
            return {"ok": False, "reason": "warming up"}
        return engine.health()

    def stats(self) -> dict:
        engine = self._engine
        stats = getattr(engine, "stats", None)
        return stats() if stats is not None else {}

    def close(self) -> None:
        engine = self._engine
        close = getattr(engine, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:
        # Only for attributes not defined here (e.g. prepare, sampling_params): the engine's once attached.
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise AttributeError(f"{name} is not available while the model is loading")
        return getattr(engine, name)
