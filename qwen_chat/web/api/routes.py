"""The API's routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``.

``create_router(backend, cfg)`` wires ``protocol`` (keys, request parsing, refusals, errors) to the backend
and answers either one JSON completion or an SSE stream (``streaming``), with ``n`` choices (``choices``).
Every completion carries the header ``X-Dropped-Messages``: how many of the request's messages the context
policy left out (oldest turns first; 0 when all fit).  The API has its own worker-thread
pool so that waiting requests never starve the rest of the server.
"""
from __future__ import annotations

import functools
import logging
import time
import uuid
from pathlib import Path, PurePath
from typing import Optional

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qwen_chat.chat_types import CancelToken, ChatBackend, ChatError
from qwen_chat.config import DEFAULT_MAX_SLOTS, ServiceConfig
from qwen_chat.history.api_images import ApiImageStore
from qwen_chat.images import ImageLimits
from qwen_chat.web.api.body import parse_body, read_body, request_body_limit
from qwen_chat.web.api.browsers import check_json_body, check_origin, preflight
from qwen_chat.web.api.protocol import (
    APIRequestError,
    check_key,
    error_response,
    parse_messages,
    settings_from_request,
)
from qwen_chat.web.api.choices import collect_choices, dropped_messages, logprobs_body, usage
from qwen_chat.web.api.tools import message_tool_fields
from qwen_chat.web.api.streaming import (
    ClientGone,
    Reply,
    await_watching,
    open_updates,
    SHUTDOWN_ERROR,
    cut_by_shutdown,
    event_stream,
    openai_finish_reason,
)

log = logging.getLogger(__name__)

SHOWN_ID_CHARS = 200  # characters of an unknown model id that its 404 repeats
API_SPARE_THREADS = 16  # API worker threads beyond max_queue + max_batch (image decoding, requests on their way)


def model_id_of(cfg: ServiceConfig) -> str:
    """The model id the API shows and echoes: ``--model`` as given (hub id, local path or ``tiny``), like vLLM's
    default served model name; the display name (``ModelInfo.name``) is the card's ``root``."""
    return str(cfg.model)


def model_aliases(cfg: ServiceConfig, display_name: Optional[str] = None) -> tuple[str, ...]:
    """The model ids a request may name: the served id (``model_id_of``), the last part of ``--model`` (the
    checkpoint's folder name, e.g. ``Qwen3.5-9B`` for ``/models/Qwen3.5-9B`` or ``Qwen/Qwen3.5-9B``), the hub
    id ``Qwen/<folder name>`` when that name starts with "Qwen", and the display name (``ModelInfo.name``)."""
    served = model_id_of(cfg)
    folder = PurePath(served.rstrip("/")).name or served
    names = [served, folder]
    if folder.lower().startswith("qwen"):
        names.append(f"Qwen/{folder}")
    if display_name:
        names.append(display_name)
    return tuple(dict.fromkeys(names))


def model_not_found(model: str, served: str) -> APIRequestError:
    """The 404 (code ``model_not_found``, param ``model``) for a model id that is neither served nor an alias (a
    long one shown cut to ``SHOWN_ID_CHARS`` characters)."""
    shown = repr(model) if len(model) <= SHOWN_ID_CHARS else repr(model[:SHOWN_ID_CHARS]) + "..."
    return APIRequestError(f"model {shown} does not exist; this server has {served!r}", status=404,
                           param="model", code="model_not_found")


def create_router(backend: ChatBackend, cfg: ServiceConfig,
                  image_store: Optional[ApiImageStore] = None) -> APIRouter:
    """The OpenAI-compatible routes, with paths ``/v1/models``, ``/v1/models/{id}``, ``/v1/chat/completions``.

    ``backend``: the (preferably ``ops.instrument``-ed) chat backend shared with the UI.  ``cfg``: API keys,
    remote-image switch, image limits, ``history_dir`` (API images go to ``history_dir/api_images``).
    ``image_store``: override where/how API images are kept (tests).

    Raises:
        ValueError: from ``ImageLimits.from_config`` for a non-positive upload size or token budget.
    """
    store = image_store or ApiImageStore(Path(cfg.history_dir) / "api_images", ImageLimits.from_config(cfg))
    started = int(time.time())
    router = APIRouter(prefix="/v1", tags=["openai"])
    # Worker threads of the API, apart from the shared default pool (40 threads) that Starlette and /healthz
    # use: a request holds one while it waits for its next update, so up to every queued and running request
    # can wait here and the engine, not this pool, is what says Busy (429).
    limiter = anyio.CapacityLimiter(cfg.max_queue + (cfg.max_batch or DEFAULT_MAX_SLOTS) + API_SPARE_THREADS)
    run = functools.partial(anyio.to_thread.run_sync, limiter=limiter)

    def admit(request: Request) -> None:
        """The checks of every API request: a browser's page of another origin is refused (``browsers``), then
        the API key."""
        check_origin(request, cfg.allowed_origins)
        check_key(request, cfg)

    def record_rejection(kind: str) -> None:
        hook = getattr(backend, "record_rejection", None)
        if callable(hook):
            hook(kind)

    def aliases() -> tuple[str, ...]:
        info = getattr(backend, "info", None)
        return model_aliases(cfg, info.name if info is not None else None)

    def model_card() -> dict:
        info = getattr(backend, "info", None)
        card = {"id": model_id_of(cfg), "object": "model", "created": started, "owned_by": "qwen_chat"}
        if info is not None:
            card["root"] = info.name
            card["max_model_len"] = info.context_length
        if cfg.adapter is not None:  # the LoRA adapter merged into the weights (--adapter DIR): its folder name
            card["adapter"] = PurePath(cfg.adapter).name
        report = getattr(backend, "memory_report", None)
        engine = report() if callable(report) else None
        if engine:  # what the memory budget holds: state slots, KV blocks and tokens, the longest context
            card["engine"] = engine
        return card

    @router.get("/models")
    def list_models(request: Request) -> JSONResponse:
        try:
            admit(request)
        except APIRequestError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @router.get("/models/{model_id:path}")
    def get_model(model_id: str, request: Request) -> JSONResponse:
        try:
            admit(request)
        except APIRequestError as exc:
            return error_response(exc)
        card = model_card()
        if model_id not in aliases():
            return error_response(model_not_found(model_id, card["id"]))
        return JSONResponse(card)

    body_limit = request_body_limit(cfg)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            admit(request)
            check_json_body(request)
        except APIRequestError as exc:
            record_rejection(exc.code or exc.type)
            return error_response(exc)
        try:
            body = await run(parse_body, await read_body(request, body_limit))
            if body.get("model") is not None and body["model"] not in aliases():
                raise model_not_found(str(body["model"]), model_id_of(cfg))
            settings = await run(settings_from_request, body)  # schemas: checked off the event loop
            messages = await run(parse_messages, body.get("messages"), cfg, store)
        except (APIRequestError, ChatError) as exc:
            record_rejection(exc.kind if isinstance(exc, ChatError) else exc.code or exc.type)
            return error_response(exc)
        except Exception as exc:
            log.exception("chat completion request could not be read")
            return error_response(exc)

        cancel = CancelToken()
        reply = Reply(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_id_of(cfg))
        wants_stream = bool(body.get("stream", False))
        wants_logprobs = settings.top_logprobs is not None
        updates = None
        try:
            updates = await await_watching(request, cancel, open_updates(backend, messages, settings, cancel, run))
            if wants_stream:
                first = await await_watching(request, cancel, anext(updates, None))
            else:
                results = await await_watching(request, cancel, collect_choices(updates, settings.n))
        except ClientGone:
            await _close(updates)
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except ChatError as exc:
            await _close(updates)
            return error_response(exc)
        except Exception as exc:
            await _close(updates)
            log.exception("chat completion failed before the first update")
            return error_response(exc)

        if wants_stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
            events = event_stream(updates, first, cancel, reply, settings.enable_thinking, include_usage,
                                  n=settings.n, logprobs=wants_logprobs)
            dropped = first.dropped_messages if first is not None else 0
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Dropped-Messages": str(dropped)})

        await _close(updates)
        lasts = [r.last for r in results]
        failed = next((last for last in lasts if last is not None and last.finish_reason == "error"), None)
        if failed is not None:
            return error_response(APIRequestError(failed.notice or "generation failed; see the service log",
                                                  status=500, code="generation_error"))
        if any(cut_by_shutdown(last, cancel) for last in lasts):
            return JSONResponse({"error": SHUTDOWN_ERROR}, status_code=503)
        choices = []
        for index, result in enumerate(results):
            last = result.last
            message = {
                "role": "assistant",
                "content": last.answer if last is not None else "",
                "reasoning_content": (last.reasoning if last is not None else "") if settings.enable_thinking
                else None,
                **message_tool_fields(last),
            }
            choices.append({"index": index, "message": message,
                            "logprobs": logprobs_body(result.logprobs) if wants_logprobs else None,
                            "finish_reason": openai_finish_reason(last)})
        body = {"id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
                "choices": choices, "usage": usage(lasts)}
        dropped = dropped_messages(lasts)
        if dropped:
            body["dropped_messages"] = dropped
        return JSONResponse(body, headers={"X-Dropped-Messages": str(dropped)})

    def wrong_method(allowed: str):
        async def refuse(request: Request) -> Response:
            answer = preflight(request, cfg.allowed_origins, allowed) if request.method == "OPTIONS" else None
            if answer is not None:  # a CORS preflight from an allowed origin
                return answer
            response = error_response(APIRequestError(
                f"{request.method} is not allowed on {request.url.path}; use {allowed}", status=405,
                code="method_not_allowed"))
            response.headers["Allow"] = allowed
            return response
        return refuse

    others = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    router.add_api_route("/chat/completions", wrong_method("POST"), methods=[m for m in others if m != "POST"],
                         include_in_schema=False)
    for path in ("/models", "/models/{model_id:path}"):
        router.add_api_route(path, wrong_method("GET"), methods=[m for m in others if m != "GET"],
                             include_in_schema=False)

    @router.api_route("/{path:path}", methods=others, include_in_schema=False)
    async def unknown_route(path: str) -> Response:
        return error_response(APIRequestError(f"unknown API route /v1/{path}; this server has /v1/models and "
                                              "/v1/chat/completions", status=404,
                                              code="unknown_route"))

    return router


async def _close(updates) -> None:
    """Close an update stream (None: none was opened)."""
    if updates is not None:
        await updates.aclose()
