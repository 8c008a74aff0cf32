"""What a web browser may do with the API.

Any page a user opens can make the browser send requests to the service on ``127.0.0.1:7860``: a form or a
``fetch`` with a "simple" content type (``text/plain``, a form encoding, or none) goes out without the CORS
preflight, so without these rules a page could make the service generate, or send it a huge body, with the
user's browser.  So every API request that carries an ``Origin`` header (browsers send it on every
cross-origin request and on their own same-origin POSTs; scripts and SDKs do not) must come from the service's
own origin (the ``Host`` it was sent to) or from one of ``--allowed-origins``, else it is refused with 403
(``check_origin``); and a request body must be declared as JSON (``application/json`` or ``...+json``), else
415 (``check_json_body``), so that no request a browser can send without a preflight is ever read.  Pages of
an allowed origin get the CORS headers (``CorsHeaders``) and their preflight is answered (``preflight``).
Answers are OpenAI error bodies (``protocol.APIRequestError``).
"""
from __future__ import annotations

from typing import Optional, Sequence

from fastapi import Request
from fastapi.responses import Response

from qwen_chat.web.api.protocol import APIRequestError
from qwen_chat.web.origins import origin_allowed

#: Headers a page of an allowed origin may send when its preflight does not list them: what the OpenAI SDKs
#: send.  A preflight that lists headers gets them allowed (the SDKs add ``X-Stainless-*`` headers of their own).
ALLOWED_HEADERS = "Authorization, Content-Type, OpenAI-Organization, OpenAI-Project, X-Stainless-Lang"
#: Response headers a page of an allowed origin may read.
EXPOSED_HEADERS = "X-Dropped-Messages, Retry-After"
#: Seconds a browser may cache a preflight's answer.
PREFLIGHT_MAX_AGE_S = 600


def check_origin(request: Request, allowed: Sequence[str]) -> None:
    """Raise APIRequestError(403, code ``origin_not_allowed``) when the request carries an ``Origin`` that is
    neither the service's own nor in ``allowed`` (module docstring)."""
    origin = request.headers.get("origin")
    if origin is None or origin_allowed(origin, request.headers, allowed):
        return
    raise APIRequestError(f"requests from the web page at {origin} are refused: start the service with "
                          f"--allowed-origins {origin} to let that site's pages use the API", status=403,
                          code="origin_not_allowed")


def check_json_body(request: Request) -> None:
    """Raise APIRequestError(415, code ``unsupported_media_type``) unless the ``Content-Type`` is
    ``application/json`` or a ``+json`` type (parameters such as ``charset`` allowed)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return
    raise APIRequestError(f"the request body must be JSON sent with 'Content-Type: application/json' (got "
                          f"{kind or 'no Content-Type'})", status=415,
                          code="unsupported_media_type")


def preflight(request: Request, allowed: Sequence[str], methods: str) -> Optional[Response]:
    """The answer to a CORS preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed
    origin other than the service's own: 204 with the CORS headers (``methods``: the route's methods); None
    when the request is not such a preflight (it is then answered as any other ``OPTIONS``)."""
    origin = request.headers.get("origin")
    if (origin is None or "access-control-request-method" not in request.headers
            or not origin_allowed(origin, None, allowed)):
        return None
    asked = request.headers.get("access-control-request-headers", "").strip()
    return Response(status_code=204, headers={
        "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": methods,
        "Access-Control-Allow-Headers": asked or ALLOWED_HEADERS, "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})


class CorsHeaders:
    """ASGI middleware: responses under ``/v1/`` to a request whose ``Origin`` is in ``allowed`` (not the
    service's own: a same-origin page needs no CORS headers) carry ``Access-Control-Allow-Origin`` for it, so
    that the page may read them.  Nothing is added for other origins (their requests are refused anyway)."""

    def __init__(self, app, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = tuple(allowed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.allowed or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), None)
        if origin is None or not origin_allowed(origin, None, self.allowed):
            await self.app(scope, receive, send)
            return

        async def with_cors(message) -> None:
            if message["type"] == "http.response.start":
                drop = (b"access-control-allow-origin", b"access-control-expose-headers")
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in drop]
                headers += [(b"access-control-allow-origin", origin.encode("latin-1")),
                            (b"access-control-expose-headers", EXPOSED_HEADERS.encode()), (b"vary", b"Origin")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_cors)
