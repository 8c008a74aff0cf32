"""OpenAI-compatible HTTP API (``/v1/models``, ``/v1/chat/completions``) on the same server as the UI.

Wiring (in the web server)::

    api.install(app, backend, cfg)   # the /v1 routes and the CORS headers of --allowed-origins

Modules: ``routes`` (the endpoints), ``protocol`` (keys, request parsing, refusals, errors), ``streaming``
(the sync-to-async bridge and server-sent events), ``choices`` (n choices, ``usage``, OpenAI's ``logprobs``
shape), ``tools`` (tools, tool_choice, response_format, tool messages; ``tool_calls`` out); API images are kept
by ``history.api_images``.

Requests go through the same ``ChatBackend`` (engine queue, rank-0 broadcast) as the UI.  What is accepted:

- ``messages``: roles ``system`` (``developer`` is read as system), ``user``, ``assistant``, ``tool``; ``content`` a string
  or a list of parts ``{"type": "text", "text": ...}`` / ``{"type": "image_url", "image_url": {"url": ...}}``
  (user messages only).  Image URLs must be ``data:image/...;base64,...`` unless the server was started with
  ``--allow-remote-images`` (then http(s) URLs are fetched).  An assistant message's ``reasoning_content`` is
  ignored (Qwen3.5 never sees earlier reasoning).  An assistant message may carry ``tool_calls``; a ``tool``
  message follows one (``tools`` module).  The last message must be a user message with text that is not blank
  (``chat_types.is_blank``) or with an image, or a tool result.
- ``max_tokens`` / ``max_completion_tokens`` (1-8192; both only with the same value), ``temperature``,
  ``top_p``, ``top_k``, ``presence_penalty``, ``frequency_penalty``, ``seed``, ``n`` (1-8 choices sharing one
  prefill), ``logprobs`` / ``top_logprobs`` (0-20; the model's raw distribution, answer tokens only),
  ``thinking_token_budget``, ``stop`` (string or list of up to 4), ``stream``, ``stream_options.include_usage``,
  ``chat_template_kwargs.enable_thinking`` (default true, like the model).  Unset sampling values take the
  Qwen3.5 model-card preset of the mode (``GenerationSettings.preset``); out-of-range values are refused with
  400 naming the allowed range (never clamped: top_p = 0 or top_k = 0 is refused).  The model id is
  ``--model`` as given (``/v1/models``); a request may name it or an alias (``routes.model_aliases``), any
  other id gets 404 ``model_not_found``.
- ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format`` (text, json_object, json_schema): see
  the ``tools`` module; "required"/named tool choices and JSON formats are enforced by constrained decoding.
- Unsupported OpenAI features are refused with 400 rather than ignored: ``functions`` / ``function_call`` and
  non-empty ``logit_bias`` (code ``unsupported_parameter``), non-function tools and other ``response_format``
  types (code ``invalid_input``).

Replies follow vLLM's Qwen3 reasoning parser: the thinking goes to ``message.reasoning_content`` (streaming:
``delta.reasoning_content``), the answer to ``content``.  Streaming is server-sent events: a role chunk, delta
chunks (``delta.tool_calls`` for calls), a chunk with ``finish_reason`` ("stop"/"length"/"tool_calls") per choice, an optional usage chunk (with
``completion_tokens_details.reasoning_tokens``), then ``data: [DONE]``.  Every completion carries the header
``X-Dropped-Messages`` (messages the context policy left out; non-streamed replies also ``dropped_messages``).

Browsers (``browsers``): a request whose ``Origin`` is neither the service's own nor one of
``--allowed-origins`` is refused with 403 ``origin_not_allowed``, a POST body not declared as JSON with 415
``unsupported_media_type``; pages of an allowed origin get their CORS preflight answered and
``Access-Control-Allow-Origin`` on every answer.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; ``type`` is the
``ChatError.kind``.  Status: 400 bad input (incl. prompt too long, code ``context_length_exceeded``, with the
token counts; ``param`` names the field, e.g. ``messages[1].content[0].image_url``), 401 missing/wrong API key
when keys are required (``Authorization: Bearer KEY``), 404 unknown model, 429 queue full (``Retry-After``),
503 still loading (``Retry-After``), 500 unexpected failure (logged, no traceback to the client).  A client that
disconnects (streaming or not) cancels its generation through the ``CancelToken``.  A reply the engine cuts
off because the service is shutting down (``streaming.cut_by_shutdown``) is a 503 ``service_unavailable``, or,
streamed, an error event of that shape before ``[DONE]`` (no finish chunk).

API images are normalised by ``qwen_chat.images.normalize_image`` and written, by content hash, to
``<history_dir>/api_images/`` (never into a user's conversations); files unused for a day are deleted.
"""
from __future__ import annotations

from qwen_chat.web.api.browsers import CorsHeaders
from qwen_chat.web.api.routes import create_router


def install(app, backend, cfg) -> None:
    """Put the API on ``app`` (a FastAPI app): the ``/v1`` routes over ``backend`` (``create_router``) and the
    CORS headers for the pages of ``cfg.allowed_origins`` (``browsers.CorsHeaders``)."""
    app.include_router(create_router(backend, cfg))
    app.add_middleware(CorsHeaders, allowed=cfg.allowed_origins)


__all__ = ["create_router", "install"]
