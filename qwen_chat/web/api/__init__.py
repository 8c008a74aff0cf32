"""OpenAI-compatible HTTP API (``/v1/models``, ``/v1/chat/completions``) on the same server as the UI.

Wiring (in the web server)::

    app.include_router(api.create_router(backend, cfg))   # the router's paths already start with /v1

Modules: ``routes`` (the endpoints), ``protocol`` (keys, request parsing, refusals, errors), ``streaming``
(the sync-to-async bridge and server-sent events); API images are kept by ``history.api_images``.

Requests go through the same ``ChatBackend`` (engine queue, rank-0 broadcast) as the UI.  What is accepted:

- ``messages``: roles ``system`` (``developer`` is read as system), ``user``, ``assistant``; ``content`` a string
  or a list of parts ``{"type": "text", "text": ...}`` / ``{"type": "image_url", "image_url": {"url": ...}}``
  (user messages only).  Image URLs must be ``data:image/...;base64,...`` unless the server was started with
  ``--allow-remote-images`` (then http(s) URLs are fetched).  An assistant message's ``reasoning_content`` is
  ignored (Qwen3.5 never sees earlier reasoning).  The last message must be a user message with text that
  is not blank (``chat_types.is_blank``) or with an image.
- ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``presence_penalty``,
  ``seed``, ``stop`` (string or list of up to 4), ``stream``, ``stream_options.include_usage``,
  ``chat_template_kwargs.enable_thinking`` (default true, like the model).  Unset sampling values take the
  Qwen3.5 model-card preset of the mode (``GenerationSettings.preset``); out-of-range values are refused with
  400 naming the allowed range (never clamped: top_p = 0 or top_k = 0 is refused).  The model id is
  ``--model`` as given (``/v1/models``); ``model`` in a request may be any string: the one loaded model answers.
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

from qwen_chat.web.api.routes import create_router

__all__ = ["create_router"]
