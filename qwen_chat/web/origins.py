"""Web origins (``scheme://host[:port]``) as ``--allowed-origins`` names them: what makes a value one.

Kept apart from ``web/api/browsers`` (which uses the list on requests) so that the command-line check does
not import the web framework.
"""
from __future__ import annotations

from typing import Optional
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
