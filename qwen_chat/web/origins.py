"""Web origins (``scheme://host[:port]``): what makes a ``--allowed-origins`` value one (``origin_problem``),
and whether a request's ``Origin`` is the service's own or an allowed one (``same_origin``,
``origin_allowed``), for the API (``web/api/browsers``) and the login form (``web/login_guard``).  No web
framework is imported here, so the command-line check stays light.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence
from urllib.parse import urlsplit


def origin_problem(origin: str) -> Optional[str]:
    """Why ``origin`` (a value of ``--allowed-origins``) is not a web origin ``scheme://host[:port]`` (http or
    https, nothing after the host), or None when it is one; ``*`` (any origin) is accepted too."""
    if origin == "*":
        return None
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected scheme://host[:port] with http or https"
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return "an origin has no path, query or user part"
    try:
        parts.port
    except ValueError:
        return "the port is not a number 1..65535"
    return None


def _normal(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def same_origin(origin: str, headers: Mapping[str, str]) -> bool:
    """True when the ``Origin`` ``origin`` names the host the request was sent to: its ``Host`` header, or the
    ``X-Forwarded-Host`` a reverse proxy in front set (a page cannot set that header on a request the browser
    sends without a preflight).  ``headers``: the request's headers, lower-case names."""
    netloc = urlsplit(_normal(origin)).netloc
    hosts = [headers.get("host"), headers.get("x-forwarded-host")]
    return bool(netloc) and any(h and netloc == h.split(",")[0].strip().lower() for h in hosts)


def origin_allowed(origin: str, headers: Optional[Mapping[str, str]], allowed: Sequence[str]) -> bool:
    """True when a request with the ``Origin`` header ``origin`` comes from the service's own origin
    (``same_origin`` over its ``headers``; None: not checked) or from one of ``allowed`` (``*``: any).  The
    literal origin ``null`` (sandboxed frames, local files) is allowed only by ``*``."""
    allowed = [_normal(a) for a in allowed]
    if "*" in allowed:
        return True
    o = _normal(origin)
    if o == "null":
        return False
    return o in allowed or (headers is not None and same_origin(o, headers))
