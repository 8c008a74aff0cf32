"""OpenAI-compatible HTTP API (``/v1/models``, ``/v1/chat/completions``) on the same server as the UI.

Wiring (in the web server)::

    app.include_router(api.create_router(backend, cfg))   # the router's paths already start with /v1

Requests go through the same ``ChatBackend`` (engine queue, rank-0 broadcast) as the UI.  What is accepted:

- ``messages``: roles ``system`` (``developer`` is read as system), ``user``, ``assistant``; ``content`` a string
  or a list of parts ``{"type": "text", "text": ...}`` / ``{"type": "image_url", "image_url": {"url": ...}}``
  (user messages only).  Image URLs must be ``data:image/...;base64,...`` unless the server was started with
  ``--allow-remote-images`` (then http(s) URLs are fetched).  An assistant message's ``reasoning_content`` is
  ignored (Qwen3.5 never sees earlier reasoning).  The last message must be a user message.
- ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``presence_penalty``,
  ``seed``, ``stop`` (string or list of up to 4), ``stream``, ``stream_options.include_usage``,
  ``chat_template_kwargs.enable_thinking`` (default true, like the model).  Unset sampling values take the
  Qwen3.5 model-card preset of the mode (``GenerationSettings.preset``); out-of-range values are refused with
  400 naming the allowed range (never clamped; public case C13).  The model id is ``--model`` as given
  (``/v1/models``); ``model`` in a request may be any string: the one loaded model answers.
- Unsupported OpenAI features are refused with 400 rather than ignored: ``n`` > 1, ``tools``, ``logprobs``,
  non-zero ``frequency_penalty``, non-empty ``logit_bias``, ``response_format`` other than text.

Replies follow vLLM's Qwen3 reasoning parser: the thinking goes to ``message.reasoning_content`` (streaming:
``delta.reasoning_content``), the answer to ``content``.  Streaming is server-sent events: a role chunk, delta
chunks, a chunk with ``finish_reason`` ("stop"/"length"), an optional usage chunk, then ``data: [DONE]``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; ``type`` is the
``ChatError.kind``.  Status: 400 bad input (incl. prompt too long, code ``context_length_exceeded``, with the
token counts), 401 missing/wrong API key when keys are required (``Authorization: Bearer KEY``), 429 queue
full, 503 still loading, 500 unexpected failure (logged, no traceback to the client).  A client that
disconnects (streaming or not) cancels its generation through the ``CancelToken``.

API images are normalised by ``qwen_chat.images.normalize_image`` and written, by content hash, to
``<history_dir>/api_images/`` (never into a user's conversations); files unused for a day are deleted.
"""
from __future__ import annotations

import asyncio
import base64
import functools
import binascii
import hashlib
import hmac
import json
import logging
import os
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Optional

import anyio
import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qwen_chat.chat_types import (
    CancelToken,
    ChatBackend,
    ChatError,
    ChatMessage,
    ContextTooLong,
    GenerationSettings,
    InvalidImage,
    InvalidInput,
    StreamUpdate,
)
from qwen_chat.config import ServiceConfig
from qwen_chat.images import ImageLimits, normalize_image

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2  # how often a waiting request checks whether its client is still connected
IMAGE_MAX_AGE_S = 24 * 3600.0  # API image files unused this long are deleted
IMAGE_PRUNE_EVERY_S = 600.0
REMOTE_FETCH_TIMEOUT_S = 15.0
API_SPARE_THREADS = 16  # API worker threads beyond max_queue + max_batch (image decoding, requests on their way)


class APIRequestError(Exception):
    """A request refused at the API boundary (before the engine), rendered as an OpenAI error.

    ``status`` HTTP status; ``type`` OpenAI ``error.type``; ``param`` the offending request field (JSON path
    like ``messages[1].content[0].image_url``) or None; ``code`` a stable machine-readable code or None.
    """

    def __init__(self, message: str, status: int = 400, type: str = "invalid_input",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code


def error_response(exc: BaseException, param: Optional[str] = None) -> JSONResponse:
    """Render ``APIRequestError``/``ChatError``/anything else as ``{"error": {...}}`` with its HTTP status.

    ``ContextTooLong`` gets code ``context_length_exceeded`` and its token counts in the message; ``Busy``
    adds ``Retry-After: 1``.  Other exception types become a generic 500 (the caller logs them).
    """
    headers = None
    if isinstance(exc, APIRequestError):
        status, message, type_, code = exc.status, exc.message, exc.type, exc.code
        param = exc.param or param
        if status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
    elif isinstance(exc, ChatError):
        status, message, type_, code = exc.http_status, str(exc) or exc.kind, exc.kind, exc.kind
        if isinstance(exc, ContextTooLong):
            code, param = "context_length_exceeded", param or "messages"
            counts = f"{exc.prompt_tokens} tokens"
            if counts not in message:
                message = (f"{message} (the prompt has {exc.prompt_tokens} tokens; "
                           f"the context holds {exc.context_length} tokens)")
        if status == 429:
            headers = {"Retry-After": "1"}
    else:
        status, message, type_, code = 500, "internal server error; see the service log", "internal_error", None
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# --------------------------------------------------------------------------------------------- images


class ApiImageStore:
    """Normalises API images and keeps them as PNG files named by the SHA-256 of the uploaded bytes.

    ``directory``: folder for the files (created on demand).  ``limits``: ``qwen_chat.images.ImageLimits``.
    The same upload sent again (clients resend every image on every turn) reuses the file without decoding.
    """

    def __init__(self, directory: Path, limits: ImageLimits, max_age_s: float = IMAGE_MAX_AGE_S):
        self.directory = Path(directory)
        self.limits = limits
        self.max_age_s = max_age_s
        self._last_prune = 0.0
        self._lock = threading.Lock()
        # Normalised output depends on the limits: keep caches of different limits apart.
        self._suffix = hashlib.sha256(repr(limits).encode()).hexdigest()[:8]

    def put(self, data: bytes) -> str:
        """Return the path (str) of the normalised PNG of ``data``.

        Raises:
            InvalidImage: from ``normalize_image`` (not an image, unsupported format, too big...).
        """
        name = f"{hashlib.sha256(data).hexdigest()}-{self._suffix}.png"
        path = self.directory / name
        if path.exists():
            try:
                os.utime(path)
                return str(path)
            except FileNotFoundError:  # pruned in between: normalise again
                pass
        png = normalize_image(data, self.limits).png
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".png", dir=str(self.directory))
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(png)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self._maybe_prune()
        return str(path)

    def _maybe_prune(self) -> None:
        now = time.time()
        with self._lock:
            if now - self._last_prune < IMAGE_PRUNE_EVERY_S:
                return
            self._last_prune = now
        for entry in self.directory.glob("*.png"):
            try:
                if now - entry.stat().st_mtime > self.max_age_s:
                    entry.unlink()
            except FileNotFoundError:
                pass


def decode_data_url(url: str, max_bytes: int, param: str) -> bytes:
    """Bytes of a ``data:image/<type>[;base64],<payload>`` URL (base64 or percent-encoded).

    Raises:
        InvalidImage: not an image MIME type, payload not valid base64, or larger than ``max_bytes`` (bytes).
    """
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise InvalidImage(f"{param}: malformed data URL (expected data:image/png;base64,...)")
    fields = [f.strip().lower() for f in header.split(";")]
    mime = fields[0]
    if mime and not mime.startswith("image/"):
        raise InvalidImage(f"{param}: data URL type {mime!r} is not an image (expected image/png, image/jpeg, ...)")
    if "base64" in fields[1:]:
        compact = "".join(payload.split())
        if len(compact) * 3 // 4 > max_bytes + 3:
            raise InvalidImage(f"{param}: image file is too large; max {max_bytes / 2**20:g} MB")
        try:
            data = base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidImage(f"{param}: image data is not valid base64") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise InvalidImage(f"{param}: image file is too large; max {max_bytes / 2**20:g} MB")
    return data


def fetch_remote_image(url: str, max_bytes: int, param: str) -> bytes:
    """Download an http(s) image of at most ``max_bytes`` bytes (only with ``--allow-remote-images``).

    Raises:
        InvalidImage: network error, non-200 status, or too large.
    """
    try:
        with httpx.stream("GET", url, timeout=REMOTE_FETCH_TIMEOUT_S, follow_redirects=True) as resp:
            if resp.status_code != 200:
                raise InvalidImage(f"{param}: fetching the image failed with HTTP {resp.status_code}")
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise InvalidImage(f"{param}: image file is too large; max {max_bytes / 2**20:g} MB")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise InvalidImage(f"{param}: could not fetch the image ({type(exc).__name__})") from None


# ------------------------------------------------------------------------------------------- requests


def _field_error(param: str, message: str) -> APIRequestError:
    return APIRequestError(f"{param}: {message}", param=param)


def _text_of_parts(parts: list, param: str, allow_images: bool) -> tuple[str, list[tuple[str, str]]]:
    """Split a content-part list into (joined text, [(image url, its param path)])."""
    texts: list[str] = []
    images: list[tuple[str, str]] = []
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _field_error(where, "each content part must be an object with a 'type'")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _field_error(f"{where}.text", "must be a string")
            texts.append(text)
        elif kind == "image_url":
            if not allow_images:
                raise _field_error(where, "images are only accepted in user messages")
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise _field_error(f"{where}.image_url", "must be an object with a 'url' string")
            images.append((url, f"{where}.image_url"))
        else:
            raise _field_error(where, f"content part type {kind!r} is not supported (use 'text' or 'image_url')")
    return "\n".join(texts), images


def parse_messages(raw: Any, cfg: ServiceConfig, images: ApiImageStore) -> list[ChatMessage]:
    """OpenAI ``messages`` -> ``ChatMessage`` list, with every image normalised and written to a file.

    Raises:
        APIRequestError (400): wrong structure, unsupported role or part, last message not from the user,
            remote URL while remote images are off, more than ``cfg.max_images_per_turn`` images in a message.
        InvalidImage (400): an image that cannot be decoded or is not allowed.
    """
    if not isinstance(raw, list) or not raw:
        raise APIRequestError("messages must be a non-empty list", param="messages")
    max_bytes = int(cfg.max_upload_mb * 1024 * 1024)
    out: list[ChatMessage] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _field_error(where, "must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise _field_error(f"{where}.role", f"role {role!r} is not supported (system, user, assistant)")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            text, urls = content, []
        elif isinstance(content, list):
            text, urls = _text_of_parts(content, f"{where}.content", allow_images=(role == "user"))
        else:
            raise _field_error(f"{where}.content", "must be a string or a list of content parts")
        if len(urls) > cfg.max_images_per_turn:
            raise _field_error(
                f"{where}.content", f"{len(urls)} images in one message; max {cfg.max_images_per_turn}"
            )
        paths = []
        for url, param in urls:
            paths.append(_load_image(url, param, cfg, max_bytes, images))
        out.append(ChatMessage(role=role, text=text, images=tuple(paths)))
    # Qwen3.5's chat template accepts one system message, first: merge leading ones, refuse later ones.
    lead = 0
    while lead < len(out) and out[lead].role == "system":
        lead += 1
    if lead > 1:
        out[:lead] = [ChatMessage(role="system", text="\n\n".join(m.text for m in out[:lead]))]
        lead = 1
    for i, msg in enumerate(out[lead:], start=lead):
        if msg.role == "system":
            raise APIRequestError("a system message may only come before the conversation (first)",
                                  param=f"messages[{i + len(raw) - len(out)}].role")
    if out[-1].role != "user":
        raise APIRequestError("the last message must be a user message", param=f"messages[{len(out) - 1}].role")
    last = out[-1]
    if not last.images and not last.text.translate(_INVISIBLE).strip():
        raise APIRequestError("the last user message is empty (no text and no image)",
                              param=f"messages[{len(out) - 1}].content")
    return out


_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))  # zero-width characters


def _load_image(url: str, param: str, cfg: ServiceConfig, max_bytes: int, images: ApiImageStore) -> str:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = decode_data_url(url, max_bytes, param)
    elif scheme in ("http", "https"):
        if not cfg.allow_remote_images:
            raise APIRequestError(
                f"{param}: remote image URLs are disabled on this server; send the image inline as a data URL "
                "(data:image/png;base64,...) or start the server with --allow-remote-images",
                param=param, code="remote_images_disabled",
            )
        data = fetch_remote_image(url, max_bytes, param)
    else:
        raise APIRequestError(f"{param}: unsupported image URL scheme {scheme!r}; use a data: URL", param=param)
    try:
        return images.put(data)
    except InvalidImage as exc:
        raise InvalidImage(f"{param}: {exc}") from None


def settings_from_request(body: dict) -> GenerationSettings:
    """Sampling settings of a chat-completions body: the mode's preset overridden by the given fields.

    Raises:
        APIRequestError (400): a value out of its range (message names the field, value and allowed range,
            from ``GenerationSettings.validate``), a wrong type, or an unsupported OpenAI feature.
    """
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIRequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    thinking = kwargs.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise APIRequestError("chat_template_kwargs.enable_thinking must be true or false",
                              param="chat_template_kwargs.enable_thinking")
    _refuse_unsupported(body)
    overrides: dict[str, Any] = {}
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    api_names = {"max_new_tokens": tokens_field}
    if body.get(tokens_field) is not None:
        overrides["max_new_tokens"] = body[tokens_field]
    for name in ("temperature", "top_p", "top_k", "presence_penalty", "seed"):
        if body.get(name) is not None:
            overrides[name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIRequestError("stop must be a string or a list of strings", param="stop")
        overrides["stop"] = tuple(stop)
    settings = GenerationSettings.preset(thinking, **overrides)
    try:
        settings.validate()
    except InvalidInput as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        api_field = api_names.get(field, field)
        if api_field != field:
            message = api_field + message[len(field):]
        known = field in ("max_new_tokens", "temperature", "top_p", "top_k", "presence_penalty", "seed", "stop")
        raise APIRequestError(message, param=api_field if known else None, code="out_of_range") from None
    # JSON numbers like 100.0 passed validate() as whole numbers; the engine gets ints.
    return replace(settings, max_new_tokens=int(settings.max_new_tokens), top_k=int(settings.top_k),
                   temperature=float(settings.temperature), top_p=float(settings.top_p),
                   presence_penalty=float(settings.presence_penalty))


def _refuse_unsupported(body: dict) -> None:
    def refuse(param: str, what: str) -> APIRequestError:
        return APIRequestError(f"{param}: {what} is not supported by this server", param=param,
                               code="unsupported_parameter")

    n = body.get("n")
    if n is not None and n != 1:
        raise refuse("n", "more than one choice")
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none", "auto"):
        raise refuse("tools", "tool calling")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise refuse("logprobs", "returning log-probabilities")
    if body.get("frequency_penalty") not in (None, 0, 0.0):
        raise refuse("frequency_penalty", "frequency_penalty (use presence_penalty)")
    if body.get("logit_bias"):
        raise refuse("logit_bias", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise refuse("response_format", "a response_format other than text")
    if body.get("stream") not in (None, True, False):
        raise APIRequestError("stream must be true or false", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise APIRequestError("stream_options must be an object", param="stream_options")


# ------------------------------------------------------------------------------------------- streaming


class _SyncStream:
    """A backend generator driven from worker threads: ``next`` and ``close`` never run at the same time.

    ``close`` may be called from the event loop while a worker thread is inside ``next``: it then closes the
    generator from a helper thread as soon as that ``next`` returns (the cancel token makes that quick).
    """

    def __init__(self, factory: Callable[[], Iterator[StreamUpdate]]):
        self._factory = factory
        self._it: Optional[Iterator[StreamUpdate]] = None
        self._lock = threading.Lock()
        self._closed = False

    def next(self) -> Optional[StreamUpdate]:
        """The next update, or None when the stream has ended or was closed.  Raises what the backend raises."""
        with self._lock:
            if self._closed:
                return None
            if self._it is None:
                self._it = iter(self._factory())
            return next(self._it, None)

    def collect(self) -> Optional[StreamUpdate]:
        """Run to the end; return the last update (full texts and the finish reason), None if there was none."""
        last = None
        while (update := self.next()) is not None:
            last = update
        return last

    def _close_now(self) -> None:
        self._closed = True
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Close the backend generator now, or right after the ``next`` in progress returns."""
        if self._lock.acquire(blocking=False):
            try:
                self._close_now()
            finally:
                self._lock.release()
            return

        def later() -> None:
            with self._lock:
                self._close_now()

        threading.Thread(target=later, name="close-stream", daemon=True).start()


class _ClientGone(Exception):
    """The client disconnected while its request was waiting for the backend."""


RunInThread = Callable[..., Any]  # async (fn, *args) -> fn(*args), in a worker thread


async def _await_watching(request: Request, cancel: CancelToken, fn: Callable[[], Any], run: RunInThread) -> Any:
    """Run ``fn`` in a worker thread; if the client disconnects meanwhile, cancel and raise ``_ClientGone``
    once ``fn`` has returned (so the backend generator is never left half-driven)."""
    task = asyncio.ensure_future(run(fn))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            cancel.cancel()
            try:
                await task
            except Exception:  # the client is gone; nothing to report to
                pass
            raise _ClientGone()


@dataclass(frozen=True)
class _Reply:
    id: str
    created: int
    model: str

    def chunk(self, delta: dict, finish_reason: Optional[str] = None) -> str:
        body = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        return _sse(body)

    def usage_chunk(self, last: Optional[StreamUpdate]) -> str:
        body = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [], "usage": _usage(last),
        }
        return _sse(body)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(last: Optional[StreamUpdate]) -> dict:
    prompt = last.prompt_tokens if last else 0
    completion = last.completion_tokens if last else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(last: Optional[StreamUpdate]) -> str:
    """OpenAI finish_reason of a finished stream: "length" or "stop" (cancelled/ended early read as stop)."""
    return "length" if last is not None and last.finish_reason == "length" else "stop"


def _delta_of(update: StreamUpdate, thinking: bool) -> dict:
    delta: dict = {}
    if update.reasoning_delta and thinking:
        delta["reasoning_content"] = update.reasoning_delta
    if update.answer_delta:
        delta["content"] = update.answer_delta
    return delta


async def _event_stream(stream: _SyncStream, first: Optional[StreamUpdate], cancel: CancelToken, reply: _Reply,
                        thinking: bool, include_usage: bool, run: RunInThread) -> AsyncIterator[str]:
    """SSE body.  Closing it (client gone: Starlette cancels the response task) cancels the generation."""
    try:
        yield reply.chunk({"role": "assistant", "content": ""})
        update, last = first, first
        while update is not None:
            last = update
            delta = _delta_of(update, thinking)
            if delta:
                yield reply.chunk(delta)
            if update.finish_reason is not None:
                break
            # abandon_on_cancel: a client that hangs up cancels at once (finally below), without waiting for
            # the update in progress; the worker thread finishes that next() on its own.
            update = await run(stream.next, abandon_on_cancel=True)
        if last is not None and last.finish_reason == "error":
            message = last.notice or "generation failed; see the service log"
            yield _sse({"error": {"message": message, "type": "generation_error", "param": None, "code": None}})
        else:
            yield reply.chunk({}, finish_reason=_finish(last))
            if include_usage:
                yield reply.usage_chunk(last)
        yield "data: [DONE]\n\n"
    except Exception:
        log.exception("stream failed mid-way")
        yield _sse({"error": {"message": "internal server error; see the service log", "type": "internal_error",
                              "param": None, "code": None}})
        yield "data: [DONE]\n\n"
    finally:
        cancel.cancel()  # no-op if the generation already finished
        stream.close()


# ---------------------------------------------------------------------------------------------- router


def _check_key(request: Request, cfg: ServiceConfig) -> None:
    """Raise APIRequestError(401) unless keys are off or ``Authorization: Bearer <key>`` matches one."""
    if not cfg.api_key_required:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise APIRequestError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                              type="authentication_error", code="invalid_api_key")
    given = token.encode("utf-8")
    # Compare against every key (no early exit) so timing does not tell which prefix matched.
    matched = False
    for key in cfg.api_keys:
        matched |= hmac.compare_digest(given, key.encode("utf-8"))
    if not matched:
        raise APIRequestError("invalid API key", status=401, type="authentication_error", code="invalid_api_key")


def _model_id(cfg: ServiceConfig) -> str:
    """The model id the API shows and echoes: ``--model`` as given (hub id, local path or ``tiny``), like vLLM's
    default served model name; the display name (``ModelInfo.name``) is the card's ``root``."""
    return str(cfg.model)


def create_router(backend: ChatBackend, cfg: ServiceConfig,
                  image_store: Optional[ApiImageStore] = None) -> APIRouter:
    """The OpenAI-compatible routes, with paths ``/v1/models``, ``/v1/models/{id}``, ``/v1/chat/completions``.

    ``backend``: the (preferably ``ops.instrument``-ed) chat backend shared with the UI.  ``cfg``: API keys,
    remote-image switch, image limits, ``history_dir`` (API images go to ``history_dir/api_images``).
    ``image_store``: override where/how API images are kept (tests).
    """
    store = image_store or ApiImageStore(
        Path(cfg.history_dir) / "api_images",
        ImageLimits(max_file_bytes=int(cfg.max_upload_mb * 1024 * 1024), token_budget=cfg.image_token_budget),
    )
    started = int(time.time())
    router = APIRouter(prefix="/v1", tags=["openai"])
    # Worker threads of the API, apart from the shared default pool (40 threads) that Starlette and /healthz
    # use: a request holds one while it waits for its next update, so up to every queued and running request
    # can wait here and the engine, not this pool, is what says Busy (429).
    limiter = anyio.CapacityLimiter(cfg.max_queue + cfg.max_batch + API_SPARE_THREADS)
    run = functools.partial(anyio.to_thread.run_sync, limiter=limiter)

    def record_rejection(kind: str) -> None:
        hook = getattr(backend, "record_rejection", None)
        if callable(hook):
            hook(kind)

    def model_card() -> dict:
        info = getattr(backend, "info", None)
        card = {"id": _model_id(cfg), "object": "model", "created": started, "owned_by": "qwen_chat"}
        if info is not None:
            card["root"] = info.name
            card["max_model_len"] = info.context_length
        return card

    @router.get("/models")
    def list_models(request: Request) -> JSONResponse:
        try:
            _check_key(request, cfg)
        except APIRequestError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @router.get("/models/{model_id:path}")
    def get_model(model_id: str, request: Request) -> JSONResponse:
        try:
            _check_key(request, cfg)
        except APIRequestError as exc:
            return error_response(exc)
        card = model_card()
        if model_id != card["id"]:
            return error_response(APIRequestError(f"model {model_id!r} does not exist; this server has {card['id']!r}",
                                                  status=404, type="not_found", param="model",
                                                  code="model_not_found"))
        return JSONResponse(card)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            _check_key(request, cfg)
        except APIRequestError as exc:
            return error_response(exc)
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError):
                raise APIRequestError("the request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise APIRequestError("the request body must be a JSON object")
            settings = settings_from_request(body)
            messages = await run(parse_messages, body.get("messages"), cfg, store)
        except (APIRequestError, ChatError) as exc:
            record_rejection(exc.kind if isinstance(exc, ChatError) else exc.type)
            return error_response(exc)
        except Exception as exc:
            log.exception("chat completion request could not be read")
            return error_response(exc)

        cancel = CancelToken()
        stream = _SyncStream(lambda: backend.stream_chat(messages, settings, cancel))
        reply = _Reply(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=_model_id(cfg))
        wants_stream = bool(body.get("stream", False))
        try:
            if wants_stream:
                first = await _await_watching(request, cancel, stream.next, run)
            else:
                last = await _await_watching(request, cancel, stream.collect, run)
        except _ClientGone:
            stream.close()
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except ChatError as exc:
            stream.close()
            return error_response(exc)
        except Exception as exc:
            stream.close()
            log.exception("chat completion failed before the first update")
            return error_response(exc)

        if wants_stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
            events = _event_stream(stream, first, cancel, reply, settings.enable_thinking, include_usage, run)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        stream.close()
        if last is not None and last.finish_reason == "error":
            return error_response(APIRequestError(last.notice or "generation failed; see the service log",
                                                  status=500, type="generation_error"))
        message = {
            "role": "assistant",
            "content": last.answer if last is not None else "",
            "reasoning_content": (last.reasoning if last is not None else "") if settings.enable_thinking else None,
        }
        return JSONResponse({
            "id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(last)}],
            "usage": _usage(last),
        })

    return router
