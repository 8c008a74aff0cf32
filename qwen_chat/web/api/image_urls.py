"""Image bytes from the URLs of an API request: ``data:`` URLs, and http(s) URLs with ``--allow-remote-images``.

Both raise ``InvalidImage`` naming the request field (``param``); ``protocol.parse_messages`` stores the bytes in
the ``history.api_images.ApiImageStore`` after the upload checks of ``qwen_chat.images``.
"""
from __future__ import annotations

import base64
import binascii
import urllib.parse

import httpx

from qwen_chat.chat_types import InvalidImage

REMOTE_FETCH_TIMEOUT_S = 15.0  # seconds for one remote image download (--allow-remote-images)


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
