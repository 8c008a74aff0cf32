"""Reading an API request body within its limits, before anything parses or recurses over it: its size
(``read_body``: 413 from the ``Content-Length``, before the body is read), the nesting of its objects and
arrays (``json_depth``, on the raw text), the JSON itself without ``NaN`` / ``Infinity``, and the number of
messages (``parse_body``).  Every refusal is an ``APIRequestError`` (``protocol``)."""
from __future__ import annotations

import json
import re
from itertools import accumulate

from fastapi import Request

from qwen_chat.config import ServiceConfig
from qwen_chat.web.api.protocol import APIRequestError


def request_body_limit(cfg: ServiceConfig) -> int:
    """The largest API request body in bytes: ``--max-request-mb``, or by default room for
    ``--max-images-per-turn`` images of ``--max-upload-mb`` each as base64 (4/3 of the bytes) plus 1 MiB of
    text and JSON (8 x 20 MB: 214 MiB)."""
    if cfg.max_request_mb > 0:
        return int(cfg.max_request_mb * 2**20)
    return int(cfg.max_images_per_turn * cfg.max_upload_mb * 2**20 * 4 / 3) + 2**20


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 (code ``request_too_large``, naming the limit) when its
    ``Content-Length`` says more than ``limit`` bytes (before any of it is read) or when more arrives."""
    def too_large() -> APIRequestError:
        return APIRequestError(f"the request body is larger than the limit of {limit / 2**20:.1f} MB "
                               "(--max-request-mb)", status=413,
                               code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large()
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large()
        parts.append(part)
    return b"".join(parts)


#: Deepest nesting of objects and arrays a request body may have (a JSON schema of tools or ``response_format``
#: included): a deeper one is refused with 400 before anything recurses over it.
MAX_JSON_DEPTH = 64
#: Most messages one request may carry.
MAX_MESSAGES = 4096


class _NotJsonNumber(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity`` in a request body (Python's parser reads them; JSON has none)."""


def _not_json_number(name: str):
    raise _NotJsonNumber(name)


def _non_number_error(raw: bytes, name: str) -> APIRequestError:
    """The 400 of a body holding the non-number ``name``: it names the field it is the value of (the first
    ``"field": NAME`` in the text), when there is one."""
    found = re.search(rb'"([^"\\]{1,200})"\s*:\s*' + re.escape(name.encode()) + rb"(?![A-Za-z])", raw)
    if found is None:
        return APIRequestError(f"the request body is not valid JSON: {name} is not a JSON number")
    field = found.group(1).decode("utf-8", "replace")
    return APIRequestError(f"{field}: {name} is not a JSON number (the request body is not valid JSON)",
                           param=field)


def json_depth(raw: bytes) -> int:
    """How deeply the objects and arrays of the JSON text ``raw`` nest (0 for a scalar), without parsing it:
    escapes and then strings are cut out with regular expressions, and the remaining brackets are summed at C
    speed (no Python loop per character, no recursion)."""
    text = re.sub(rb'"[^"]*"', b"", re.sub(rb"\\.", b"", raw, flags=re.S))
    steps = text.translate(_BRACKET_STEPS, _NOT_BRACKETS)  # 2 for an opening bracket, 0 for a closing one
    return max(accumulate(b - 1 for b in steps), default=0)


_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object.  Raises APIRequestError (400) for invalid JSON (``NaN`` and
    ``Infinity`` included: not JSON numbers), a body that is not an object, nesting deeper than
    ``MAX_JSON_DEPTH`` (checked on the text, before the parser recurses), or more than ``MAX_MESSAGES``
    messages."""
    deepest = json_depth(raw)
    if deepest > MAX_JSON_DEPTH:
        raise APIRequestError(f"the request body is nested {deepest} levels deep; at most {MAX_JSON_DEPTH} are "
                              "allowed", code="nesting_too_deep")
    try:
        body = json.loads(raw, parse_constant=_not_json_number)
    except _NotJsonNumber as exc:
        raise _non_number_error(raw, str(exc)) from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIRequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIRequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise APIRequestError(f"messages: {len(messages)} messages; at most {MAX_MESSAGES} are allowed",
                              param="messages", code="too_many_messages")
    return body
