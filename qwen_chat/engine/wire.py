"""The wire format between the web front and the engine processes: msgpack, and nothing that runs code on
unpacking (no pickle: the sockets listen on ``MASTER_ADDR``).  No torch.

Every message is one msgpack array.  Front -> engine (``core.link``):

  ``["prompt", rid, prompt, settings]``          a request: its prompt built by the front's prompt workers
                                                 (``prompt_worker.pack_prompt``: token ids and pixels as
                                                 bytes), ``settings`` as ``pack_settings``
  ``["cancel", rid]``                            Stop, a closed stream, a client that went away
  ``["ping"]``                                   every ``PING_INTERVAL_S``: the front is alive
  ``["close"]``                                  orderly stop: close the engine, answer ``closed``

Engine -> front (``engine_client``), ``[replica, events]``, the events of one flush (one engine step, or what
the input and status threads queued since the last send):

  ``["hello", token, input_address, status, setup]``    first; ``setup``: checkpoint folder, special token ids
  ``["status", status]``                                every ``STATUS_INTERVAL_S``: health and stats (the hello's
                                                        status also has ranks, memory report and model info)
  ``["accepted", rid, prompt_tokens, notice, dropped]`` / ``["refused", rid, error]``   the answer to "chat"
  ``["step", entries]``                                 one engine step; per choice that produced something:
                                                        ``[rid, index, ids, logprobs, finish, error,
                                                        completion_tokens, cached_tokens, ttft_s]``
  ``["failed", reason]``                                the engine could not start (the front reports it)
  ``["closed"]``                                        the engine closed after the front's "close"
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import msgpack

from qwen_chat.chat_types import (
    ChatError,
    ChatMessage,
    GenerationSettings,
    ModelInfo,
    ToolCall,
    ToolSpec,
)

#: Seconds between two status snapshots of an engine process.
STATUS_INTERVAL_S = 0.25
#: Seconds between the front's pings to each engine process.
PING_INTERVAL_S = 0.5
#: An engine process that heard nothing from the front for this long (seconds) leaves: the front is frozen
#: (a front that exited is noticed within 0.2 s as the engine's child process).  Generous: during start-up the
#: front imports Gradio and loads the tokenizer while it pings; on 2 busy cores 5 s were not enough, and at load
#: average 10-13 (2 cores, 2026-12-02) 15 s twice ended a starting service.  Only a frozen front waits this long.
FRONT_SILENT_S = 30.0
#: A front whose engine sent no status for this long (seconds) after its hello counts it as gone.
ENGINE_SILENT_S = 15.0


def dumps(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (lists, dicts, str, bytes, numbers, None)."""
    return msgpack.packb(obj, use_bin_type=True)


def loads(data: bytes) -> Any:
    """The object ``dumps`` packed (arrays come back as lists; integer map keys allowed)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---- errors --------------------------------------------------------------------------------------------------
def pack_error(exc: BaseException) -> list:
    """``[class name, message, attributes]`` of a ``ChatError`` (``ContextTooLong`` keeps its token counts);
    any other exception becomes a ``RuntimeError`` naming its class."""
    if isinstance(exc, ChatError):
        attrs = {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, float, bool, type(None)))}
        return [type(exc).__name__, str(exc), attrs]
    return ["RuntimeError", f"{type(exc).__name__}: {exc}", {}]


def _chat_error_classes() -> dict:
    found, todo = {}, [ChatError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def unpack_error(packed: Sequence) -> Exception:
    """The exception ``pack_error`` described (its class when that is a known ``ChatError``, else RuntimeError)."""
    name, message, attrs = packed
    cls = _chat_error_classes().get(name)
    if cls is None:
        return RuntimeError(message)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(attrs)
    return exc


# ---- settings and messages -----------------------------------------------------------------------------------
def pack_settings(settings: GenerationSettings) -> dict:
    """``GenerationSettings`` as a plain dict (tools as dicts, tuples as lists)."""
    out = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    out["tools"] = [dataclasses.asdict(t) for t in settings.tools]
    out["stop"] = list(settings.stop)
    return out


def unpack_settings(packed: dict) -> GenerationSettings:
    """The ``GenerationSettings`` ``pack_settings`` packed (validated later, by the engine)."""
    known = {f.name for f in dataclasses.fields(GenerationSettings)}
    values = {k: v for k, v in packed.items() if k in known}
    values["tools"] = tuple(ToolSpec(**t) for t in values.get("tools", ()))
    values["stop"] = tuple(values.get("stop", ()))
    return GenerationSettings(**values)


def pack_messages(messages: Sequence[ChatMessage]) -> list:
    """Messages as dicts (image paths as they are: the prompt workers run on the front's host)."""
    return [{"role": m.role, "text": m.text, "images": list(m.images), "reasoning": m.reasoning,
             "tool_calls": [[c.id, c.name, c.arguments] for c in m.tool_calls]} for m in messages]


def unpack_messages(packed: list) -> list[ChatMessage]:
    """The ``ChatMessage``s of ``pack_messages``' dicts."""
    return [ChatMessage(role=m["role"], text=m["text"], images=tuple(m["images"]), reasoning=m["reasoning"],
                        tool_calls=tuple(ToolCall(*c) for c in m["tool_calls"])) for m in packed]


def pack_info(info: ModelInfo) -> dict:
    """``ModelInfo`` as a dict."""
    return dataclasses.asdict(info)


def unpack_info(packed: dict) -> ModelInfo:
    """The ``ModelInfo`` of ``pack_info``."""
    return ModelInfo(**packed)
