"""Prompt building in worker processes of the web front, so that templating and tokenizing a large request
never holds the GIL of the engine process or of the front's event loop (tokenizing 16 MB of text holds the
GIL for about 26 s on one CPU core, measured here: docs/architecture.md, "Processes").

``PromptPool`` (the front) runs ``build_prompt`` (``text.prompt``) in ``workers`` single-process pools, each
of which loads the checkpoint's processor once; a conversation goes to the same worker every time (its first
message picks it), so the worker's cache of long message texts (``text_ids``) keeps its hits.  The result
travels to the engine as plain bytes (``pack_prompt``: no pickle), where ``unpack_prompt`` turns it back into
a ``PreparedPrompt``.  The front process itself never imports torch: only its workers and the engine do.

Usage::

    pool = PromptPool(checkpoint, workers=2, image_token_budget=1024)
    packed = await pool.prepare(messages, settings, context_length=262144)   # raises the ChatErrors of
    prompt = unpack_prompt(packed)                                           # build_prompt (engine side)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from qwen_chat.chat_types import ChatMessage, GenerationSettings
from qwen_chat.engine import wire

_PROCESSOR: Any = None
_CONTROL: tuple = ()
#: Seconds between a worker's checks that the front is still there.
PARENT_POLL_S = 0.5


def _leave_with_parent() -> None:
    """End this worker as soon as the front that started it is gone (even by ``kill -9``): the kernel's
    parent-death signal on Linux, and a poll of the parent's pid everywhere (a pool's pipes never report it).
    Linux sends the signal when the *thread* that started the worker ends: start pools from a thread that
    lives as long as the front (``EngineHub``)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _init(checkpoint: str) -> None:
    """Worker start: load the checkpoint's processor (tokenizer, image processor, chat template) once."""
    global _PROCESSOR, _CONTROL
    _leave_with_parent()
    import torch

    from qwen_chat.engine.checkpoints.loading import load_processor

    torch.set_num_threads(1)  # one core per worker: the engine's own threads keep theirs
    _PROCESSOR = load_processor(Path(checkpoint))
    _CONTROL = tuple(_PROCESSOR.tokenizer.get_added_vocab())


def _build(messages: list, settings: dict, image_token_budget: int, context_length: int) -> tuple:
    """In a worker: ``("ok", packed prompt)`` or ``("error", wire.pack_error(exc))`` (exceptions are not
    pickled: a ``ContextTooLong`` keeps its token counts this way)."""
    from qwen_chat.engine.text.prompt import build_prompt

    try:
        s = wire.unpack_settings(settings)  # a tokenizer without tool-call tokens: the engine refuses the tools
        prompt = build_prompt(
            _PROCESSOR, wire.unpack_messages(messages), enable_thinking=s.enable_thinking,
            image_token_budget=image_token_budget, context_length=context_length,
            max_new_tokens=s.max_new_tokens, tools=s.tools if s.tool_choice != "none" else (),
            control_tokens=_CONTROL)
        return "ok", pack_prompt(prompt)
    except Exception as exc:  # noqa: BLE001 - the caller raises it
        return "error", wire.pack_error(exc)
    finally:
        if sum(len(m["text"]) for m in messages) > LARGE_TEXT_CHARS:
            _give_memory_back()


#: Characters of message text above which a worker hands the memory its tokenizer took back to the system
#: afterwards (a 16 MB message left a worker at 2.8 GB resident instead of about 0.75 GB).
LARGE_TEXT_CHARS = 1 << 20


def _give_memory_back() -> None:
    """Collect garbage and return freed heap pages to the system (glibc's ``malloc_trim``; elsewhere a no-op)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _token_strings() -> list:
    """In a worker: every token string of the processor's tokenizer by id (``updates.token_strings``), for the
    front's ``TokenTable``."""
    from qwen_chat.engine.output.updates import token_strings

    return token_strings(_PROCESSOR.tokenizer.backend_tokenizer)


#: Side (px) of the photo each worker's warm-up builds a prompt with: the size of a downscaled phone photo, so
#: that the image processor runs the resizing a real photo needs before the first one comes.
WARM_PHOTO_SIDE = 448


def _warm(image_token_budget: int) -> bool:
    """In a worker, once at start: build a prompt with a system message and a ``WARM_PHOTO_SIDE`` px photo at
    the service's ``image_token_budget``, so that the chat template is compiled and the image processor's code
    paths are loaded before the first request (the first request through the front waited about half a second
    more than the next ones: docs/performance.md, "First use after ready").  True when the processor is
    loaded."""
    from qwen_chat.engine.text.prompt import photo_prompt

    photo_prompt(_PROCESSOR, side=WARM_PHOTO_SIDE, image_token_budget=image_token_budget, context_length=1 << 16,
                 system="Warm-up.", control_tokens=_CONTROL)
    return _PROCESSOR is not None


def pack_tensor(t) -> Optional[dict]:
    """A CPU tensor as ``{"dtype", "shape", "data"}`` (raw little-endian bytes); None stays None."""
    if t is None:
        return None
    t = t.detach().contiguous().cpu()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.numpy().tobytes()}


def unpack_tensor(d: Optional[dict]):
    """The tensor ``pack_tensor`` packed (a copy that owns its memory), or None."""
    if d is None:
        return None
    import torch

    dtype = getattr(torch, d["dtype"])
    return torch.frombuffer(bytearray(d["data"]), dtype=dtype).reshape(d["shape"])


def pack_prompt(prompt) -> dict:
    """A ``PreparedPrompt`` as plain data (tensors as bytes) for the wire."""
    return {"input_ids": pack_tensor(prompt.input_ids), "pixel_values": pack_tensor(prompt.pixel_values),
            "image_grid_thw": pack_tensor(prompt.image_grid_thw),
            "mm_token_type_ids": pack_tensor(prompt.mm_token_type_ids), "max_new_tokens": prompt.max_new_tokens,
            "notice": prompt.notice, "dropped_messages": prompt.dropped_messages,
            "shared_prefix": prompt.shared_prefix, "system_prefix": prompt.system_prefix}


def unpack_prompt(d: dict):
    """The ``PreparedPrompt`` of ``pack_prompt`` (engine side)."""
    from qwen_chat.engine.types import PreparedPrompt

    return PreparedPrompt(input_ids=unpack_tensor(d["input_ids"]), pixel_values=unpack_tensor(d["pixel_values"]),
                          image_grid_thw=unpack_tensor(d["image_grid_thw"]),
                          mm_token_type_ids=unpack_tensor(d["mm_token_type_ids"]),
                          max_new_tokens=int(d["max_new_tokens"]), notice=d["notice"],
                          dropped_messages=int(d["dropped_messages"]), shared_prefix=int(d["shared_prefix"]),
                          system_prefix=int(d["system_prefix"]))


class PromptPool:
    """``workers`` prompt-building processes of the front (module docstring).

    Args:
        checkpoint: the folder of the checkpoint the engine loaded (its processor).
        workers: processes (each one core, one processor).
        image_token_budget: visual tokens per image (``--image-token-budget``).
    """

    def __init__(self, checkpoint: Path, workers: int, image_token_budget: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.image_token_budget = int(image_token_budget)
        self._pools = [concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=_init,
                                                              initargs=(str(checkpoint),))
                       for _ in range(max(1, int(workers)))]
        self._warming = [pool.submit(_warm, self.image_token_budget) for pool in self._pools]  # start loading now, not with a request

    def wait_warm(self, timeout_s: float) -> bool:
        """Wait until every worker has loaded its processor (True), or ``timeout_s`` seconds passed."""
        done, _ = concurrent.futures.wait(self._warming, timeout=timeout_s)
        return len(done) == len(self._warming)

    def failed(self) -> bool:
        """True when a worker's start ended in an error (its processor did not load, or the process died): a
        pool started early on a folder that was not whole yet is made again rather than kept."""
        return any(f.done() and (f.cancelled() or f.exception() is not None) for f in self._warming)

    def token_strings(self, timeout_s: float) -> list:
        """Every token string of the checkpoint's tokenizer by id, from the first worker (once its processor is
        loaded).  Raises ``concurrent.futures.TimeoutError`` after ``timeout_s`` seconds, and what the worker
        raised."""
        return self._pools[0].submit(_token_strings).result(timeout_s)

    def _pool_for(self, messages: Sequence[ChatMessage]):
        first = next((m.text for m in messages if m.role != "system"), "")
        digest = hashlib.sha256(first.encode("utf-8", "surrogatepass")).digest()
        return self._pools[digest[0] % len(self._pools)]

    def _submit(self, messages, settings: GenerationSettings, context_length: int):
        return self._pool_for(messages).submit(_build, wire.pack_messages(messages), wire.pack_settings(settings),
                                               self.image_token_budget, int(context_length))

    @staticmethod
    def _result(outcome: tuple) -> dict:
        kind, value = outcome
        if kind == "error":
            raise wire.unpack_error(value)
        return value

    async def prepare(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                      context_length: int) -> dict:
        """The packed prompt of ``messages`` (asyncio: the event loop keeps serving meanwhile).  Raises the
        ``ChatError``s of ``build_prompt`` (InvalidInput, InvalidImage, ContextTooLong)."""
        future = self._submit(messages, settings, context_length)
        return self._result(await asyncio.wrap_future(future))

    def prepare_blocking(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                         context_length: int) -> dict:
        """``prepare`` for a thread (the UI's handlers)."""
        return self._result(self._submit(messages, settings, context_length).result())

    def close(self) -> None:
        """Stop the worker processes now (SIGTERM: they hold no state).  Only asking them to leave is not
        enough: a front leaving after its engine died was found waiting forever in the interpreter's exit
        (multiprocessing joins its child processes) for workers still blocked on their call queue."""
        for pool in self._pools:
            processes = list((getattr(pool, "_processes", None) or {}).values())  # (ProcessPoolExecutor's own)
            pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                if process.is_alive():
                    process.terminate()
