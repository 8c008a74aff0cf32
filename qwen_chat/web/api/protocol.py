"""The API's request protocol: reading a chat-completions body, refusing what is not supported, OpenAI errors.

* ``check_key``: the ``Authorization: Bearer <key>`` check (401);
* ``parse_messages``: OpenAI ``messages`` -> ``ChatMessage``s, images from data URLs (or, with
  ``--allow-remote-images``, http(s) URLs) normalised into the ``history.api_images.ApiImageStore``;
* ``settings_from_request``: sampling fields -> validated ``GenerationSettings`` (the API's one check; the
  engine checks again as part of its contract), unsupported OpenAI features refused with 400;
* ``APIRequestError`` and ``error_response``: every refusal rendered as ``{"error": {...}}``.

What is accepted is listed in the package docstring (``qwen_chat.web.api``).
"""
from __future__ import annotations

import hmac
from dataclasses import replace
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from qwen_chat.chat_types import (
    ChatError,
    ChatMessage,
    ContextTooLong,
    GenerationSettings,
    InvalidImage,
    InvalidInput,
    conversation_problem,
)
from qwen_chat.config import ServiceConfig
from qwen_chat.history.api_images import ApiImageStore
from qwen_chat.images import TooManyImages, check_image_count
from qwen_chat.web.api.image_urls import decode_data_url, fetch_remote_image
from qwen_chat.web.api.tools import check_tool_turns, message_tool_calls, tool_settings

NOT_READY_RETRY_AFTER_S = 10  # Retry-After (seconds) of a 503 while the model loads (the 9B takes minutes)


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status, the one rule for every error the API sends: 401
    ``authentication_error``, 403 ``permission_error``, 429 ``rate_limit_error``, other 4xx
    ``invalid_request_error``, 5xx ``server_error`` (OpenAI's API reference, "Error codes"); the specific
    reason is ``error.code``."""
    fixed = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
    return fixed.get(status, "invalid_request_error" if status < 500 else "server_error")


class APIRequestError(Exception):
    """A request refused at the API boundary (before the engine), rendered as an OpenAI error.

    ``status`` HTTP status (``type``: ``error_type(status)``); ``param`` the offending request field (JSON path
    like ``messages[1].content[0].image_url``) or None; ``code`` a stable machine-readable code (default
    ``invalid_input`` for a 400, else None).
    """

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = error_type(status)
        self.param = param
        self.code = code if code is not None or status != 400 else "invalid_input"


def error_response(exc: BaseException, param: Optional[str] = None) -> JSONResponse:
    """Render ``APIRequestError``/``ChatError``/anything else as ``{"error": {...}}`` with its HTTP status.

    ``ContextTooLong`` gets code ``context_length_exceeded`` and its token counts in the message; ``Busy``
    adds ``Retry-After: 1``, ``NotReady`` (503: loading) ``Retry-After: NOT_READY_RETRY_AFTER_S``.  Other
    exception types become a generic 500 (the caller logs them).
    """
    headers = None
    if isinstance(exc, APIRequestError):
        status, message, type_, code = exc.status, exc.message, exc.type, exc.code
        param = exc.param or param
        if status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
    elif isinstance(exc, ChatError):
        status, message, code = exc.http_status, str(exc) or exc.kind, exc.kind
        type_ = error_type(status)
        param = param or getattr(exc, "param", None)
        if isinstance(exc, ContextTooLong):
            code, param = "context_length_exceeded", param or "messages"
            message = context_message(exc, message)
        if status == 429:
            headers = {"Retry-After": "1"}
        elif status == 503:
            headers = {"Retry-After": str(NOT_READY_RETRY_AFTER_S)}
    else:
        status, message, code = 500, "internal server error; see the service log", "internal_error"
        type_ = error_type(status)
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


#: What the API tells a program whose prompt does not fit (the engine's message may carry the UI's advice).
CONTEXT_ADVICE = "Shorten the messages (or send fewer or smaller images) or lower max_tokens."
UI_ADVICE = "start a new chat"  # the last sentence of the engine's message, for the UI only


def context_message(exc: ContextTooLong, message: str) -> str:
    """The API's message of a ``ContextTooLong``: the engine's text without the UI's advice ("... or start a
    new chat."), the token counts when the text lacks them, then ``CONTEXT_ADVICE``."""
    head, sep, tail = message.rpartition(". ")
    if sep and UI_ADVICE in tail:
        message = head + "."
    if f"{exc.prompt_tokens} tokens" not in message:
        message = (f"{message} (the prompt has {exc.prompt_tokens} tokens; "
                   f"the context holds {exc.context_length} tokens)")
    return f"{message.rstrip()} {CONTEXT_ADVICE}"


def check_key(request: Request, cfg: ServiceConfig) -> None:
    """Raise APIRequestError(401) unless keys are off or ``Authorization: Bearer <key>`` matches one."""
    if not cfg.api_key_required:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise APIRequestError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                              code="invalid_api_key")
    given = token.encode("utf-8")
    # Compare against every key (no early exit) so timing does not tell which prefix matched.
    matched = False
    for key in cfg.api_keys:
        matched |= hmac.compare_digest(given, key.encode("utf-8"))
    if not matched:
        raise APIRequestError("invalid API key", status=401, code="invalid_api_key")


# ------------------------------------------------------------------------------------------- requests


def _field_error(param: str, message: str) -> APIRequestError:
    return APIRequestError(f"{param}: {message}", param=param)


def _checked_text(text: str, param: str) -> str:
    """``text``, unless it holds a lone UTF-16 surrogate (JSON ``"\\ud800"`` without its pair), which is no
    Unicode text and cannot be tokenized: APIRequestError (400) naming ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _field_error(param, f"contains a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X} at "
                                  f"character {exc.start}), which is not valid Unicode text") from None
    return text


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
            texts.append(_checked_text(text, f"{where}.text"))
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
            remote URL while remote images are off, more than ``cfg.max_images_per_turn`` images in a message,
            a last message that is blank (``chat_types.is_blank``) and has no image.
        APIRequestError (400, type ``invalid_image``, ``param`` naming the part): an image that cannot be
            decoded, is not allowed or is larger than ``images.limits.max_file_bytes``; text with a lone
            UTF-16 surrogate.
    """
    if not isinstance(raw, list) or not raw:
        raise APIRequestError("messages must be a non-empty list", param="messages")
    max_bytes = images.limits.max_file_bytes
    out: list[ChatMessage] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _field_error(where, "must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise _field_error(f"{where}.role", f"role {role!r} is not supported (system, user, assistant, tool)")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            text, urls = _checked_text(content, f"{where}.content"), []
        elif isinstance(content, list):
            text, urls = _text_of_parts(content, f"{where}.content", allow_images=(role == "user"))
        else:
            raise _field_error(f"{where}.content", "must be a string or a list of content parts")
        try:
            check_image_count(len(urls), cfg.max_images_per_turn)
        except TooManyImages as exc:
            raise _field_error(f"{where}.content", f"{exc.count} image{'' if exc.count == 1 else 's'} in one message; max {exc.max_images}") \
                from None
        paths = []
        for url, param in urls:
            paths.append(_load_image(url, param, cfg, max_bytes, images))
        out.append(ChatMessage(role=role, text=text, images=tuple(paths),
                               tool_calls=message_tool_calls(msg, role, where)))
    # Qwen3.5's chat template accepts one system message, first: merge leading ones, refuse later ones.
    lead = 0
    while lead < len(out) and out[lead].role == "system":
        lead += 1
    if lead > 1:
        out[:lead] = [ChatMessage(role="system", text="\n\n".join(m.text for m in out[:lead]))]
        lead = 1
    merged = len(raw) - len(out)  # leading system messages merged into one
    problem = conversation_problem(out)
    if problem is not None:
        index, field, message = problem
        param = f"messages[{index + merged if index else 0}].{field}"
        raise APIRequestError(f"{param}: {message}", param=param)
    check_tool_turns(out, merged)
    return out


def _load_image(url: str, param: str, cfg: ServiceConfig, max_bytes: int, images: ApiImageStore) -> str:
    """The stored path of the image at ``url`` (data URL, or http(s) with ``--allow-remote-images``).

    Raises: APIRequestError (400) with ``param`` (the part's path, e.g. ``messages[1].content[0].image_url``):
    a disabled or unknown URL scheme, or an image that cannot be used (type and code ``invalid_image``).
    """
    try:
        return _stored_image(url, param, cfg, max_bytes, images)
    except InvalidImage as exc:
        raise APIRequestError(str(exc), param=param, code=exc.kind) from None


def _stored_image(url: str, param: str, cfg: ServiceConfig, max_bytes: int, images: ApiImageStore) -> str:
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


#: Request fields that go to the ``GenerationSettings`` field of the same name as given.
SETTINGS_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed", "n",
                   "thinking_token_budget")


def settings_from_request(body: dict) -> GenerationSettings:
    """Sampling settings of a chat-completions body: the mode's preset overridden by the given fields.

    ``max_tokens`` and ``max_completion_tokens`` may both be given only with the same value.  ``logprobs:
    true`` asks for the answer tokens' log-probabilities, ``top_logprobs`` (0-20, needs ``logprobs``) for
    that many alternatives each.  ``n``, ``frequency_penalty`` and ``thinking_token_budget`` go to the
    ``GenerationSettings`` fields of those names.

    Raises:
        APIRequestError (400): a value out of its range (message names the field, value and allowed range,
            from ``GenerationSettings.validate``), a wrong type, conflicting fields, or an unsupported OpenAI
            feature.
    """
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIRequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    thinking = kwargs.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise APIRequestError("chat_template_kwargs.enable_thinking must be true or false",
                              param="chat_template_kwargs.enable_thinking")
    _refuse_unsupported(body)
    overrides: dict[str, Any] = tool_settings(body)
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get("max_tokens") is not None and body.get(tokens_field) != body["max_tokens"]:
        raise APIRequestError(f"max_tokens ({body['max_tokens']!r}) and max_completion_tokens "
                              f"({body[tokens_field]!r}) differ; send one of them", param="max_tokens",
                              code="conflicting_parameters")
    api_names = {"max_new_tokens": tokens_field}
    if body.get(tokens_field) is not None:
        overrides["max_new_tokens"] = body[tokens_field]
    for name in SETTINGS_FIELDS:
        if body.get(name) is not None:
            overrides[name] = body[name]
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):  # 1 == True: not a boolean for JSON
        raise APIRequestError("logprobs must be true or false", param="logprobs")
    if logprobs:
        top = body.get("top_logprobs")
        overrides["top_logprobs"] = 0 if top is None else top
    elif body.get("top_logprobs") is not None:
        raise APIRequestError("top_logprobs needs \"logprobs\": true", param="top_logprobs")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIRequestError("stop must be a string or a list of strings", param="stop")
        overrides["stop"] = tuple(_checked_text(s, f"stop[{i}]") for i, s in enumerate(stop))
    settings = GenerationSettings.preset(thinking, **overrides)
    try:
        settings.validate()
    except InvalidInput as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        api_field = api_names.get(field, field)
        if api_field != field:
            message = api_field + message[len(field):]
        known = field in ("max_new_tokens", "stop", "top_logprobs", *SETTINGS_FIELDS)
        raise APIRequestError(message, param=api_field if known else exc.param,
                              code="out_of_range" if known else exc.kind) from None
    # JSON numbers like 100.0 passed validate() as whole numbers; the engine gets ints.
    top, budget = settings.top_logprobs, settings.thinking_token_budget
    return replace(settings, max_new_tokens=int(settings.max_new_tokens), top_k=int(settings.top_k),
                   temperature=float(settings.temperature), top_p=float(settings.top_p),
                   presence_penalty=float(settings.presence_penalty),
                   frequency_penalty=float(settings.frequency_penalty), n=int(settings.n),
                   top_logprobs=None if top is None else int(top),
                   thinking_token_budget=None if budget is None else int(budget))


def _refuse_unsupported(body: dict) -> None:
    def refuse(param: str, what: str) -> APIRequestError:
        return APIRequestError(f"{param}: {what} is not supported by this server", param=param,
                               code="unsupported_parameter")

    if body.get("logit_bias"):
        raise refuse("logit_bias", "logit_bias")
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise APIRequestError(f"{legacy}: the deprecated functions API is not supported by this server; send "
                                  "tools and tool_choice", param=legacy, code="unsupported_parameter")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise APIRequestError("stream must be true or false", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise APIRequestError("stream_options must be an object", param="stream_options")
    if opts is not None and body.get("stream") is not True:
        raise APIRequestError("stream_options is only allowed when stream is true", param="stream_options")
    if opts is not None and not isinstance(opts.get("include_usage", False), bool):
        raise APIRequestError("stream_options.include_usage must be true or false",
                              param="stream_options.include_usage")
