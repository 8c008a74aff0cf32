"""Image intake: check an uploaded file and turn it into the RGB PNG that is stored, shown and sent to the model.

Pillow only (no torch): the web layer imports this module.  Every upload goes through ``normalize_image``
before it enters the history, so the Qwen2-VL image processor (``transformers.models.qwen2_vl``,
``smart_resize``) only ever sees images it accepts, and the chat thumbnail shows exactly the pixels the model
sees: extreme aspect ratios, EXIF rotation, animated GIF/WEBP, HEIC and files that only look like images,
and decompression bombs are all handled here, before the model or the history is touched.

Pipeline of ``normalize_image``:

1. size of the file in bytes (``ImageLimits.max_file_bytes``);
2. format from the magic bytes (``sniff_format``), never from the file name or the client's MIME type;
3. width x height from the header, before any pixel is decoded (``ImageLimits.max_header_pixels``);
4. decode of the first frame only (animated GIF / WEBP / APNG: memory does not grow with the frame count);
   truncated files are refused (``ImageFile.LOAD_TRUNCATED_IMAGES`` is left at False);
5. EXIF orientation (values 1-8) applied with ``ImageOps.exif_transpose``;
6. every mode (CMYK, 16-bit, palette, greyscale, 1-bit, with or without alpha / tRNS) converted to RGB,
   transparent pixels composited onto white;
7. shape policy: aspect ratio above ``max_aspect`` refused; downscaled (Lanczos) to at most
   ``token_budget * 1024`` pixels; white padding so both sides are >= 32 px and the aspect ratio stays
   <= 200 (the limit hard-coded in transformers' ``smart_resize``);
8. encoded as PNG.

Every failure raises ``chat_types.InvalidImage`` with a message meant for the user.  ``ImageLimits.from_config``
builds the limits of the service (UI and API alike) and ``check_image_count`` is the per-message image limit.
"""
from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from typing import Any

from PIL import GifImagePlugin, Image, ImageFile, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

from qwen_chat.chat_types import InvalidImage
from qwen_chat.image_pixels import (
    PIXELS_PER_TOKEN,
    PROCESSOR_MAX_ASPECT,
    WHITE,
    apply_exif_orientation,
    frame_count,
    plan_shape,
    to_rgb,
)

log = logging.getLogger(__name__)

ALLOWED_FORMATS = ("JPEG", "PNG", "GIF", "WEBP")
#: zlib level of the normalised PNG.  Encoding is most of ``normalize_image``'s time, and every new photo waits
#: for it before its prompt is built: level 1 against Pillow's default 6 encoded the test photos in 12-74 ms
#: instead of 39-178 ms (451x300 to 1000x872 px, one core of the 2-core CPU machine, 2026-12-04) for files 7-18 %
#: larger.
PNG_COMPRESS_LEVEL = 1
_ALLOWED_TEXT = ", ".join(ALLOWED_FORMATS)

# Pillow's image classes of the allowed formats.  They are constructed directly instead of through
# ``Image.open`` because ``Image.open`` refuses images above 2 x MAX_IMAGE_PIXELS (179 MP) before we can
# read their size; constructing the class only parses the header, so the user gets the real dimensions
# in the message and our own (lower) limit is what decides.
_IMAGE_CLASSES = {
    "JPEG": JpegImagePlugin.JpegImageFile,
    "PNG": PngImagePlugin.PngImageFile,
    "GIF": GifImagePlugin.GifImageFile,
    "WEBP": WebPImagePlugin.WebPImageFile,
}


@dataclass(frozen=True)
class ImageLimits:
    """Limits applied to every uploaded image.

    Attributes:
        max_file_bytes: largest accepted file, in bytes (default 20 MB = 20 * 1024 * 1024).
        max_header_pixels: largest width * height read from the header before decoding, in pixels
            (default 50 MP: a 48 MP 8000x6000 photo passes, a 20000x20000 PNG bomb does not).
        min_side: smallest accepted side in pixels before padding (default 1: smaller images are padded).
        max_aspect: largest long-side / short-side ratio accepted (default 200.0, the processor's limit).
        token_budget: visual tokens per image (default 1024); the image is downscaled to at most
            ``token_budget * 1024`` pixels because one token covers 32x32 pixels.

    Raises:
        ValueError: on construction, for values that cannot work (programming error, not user input).
    """

    max_file_bytes: int = 20 * 1024 * 1024
    max_header_pixels: int = 50_000_000
    min_side: int = 1
    max_aspect: float = 200.0
    token_budget: int = 1024

    def __post_init__(self) -> None:
        if self.max_file_bytes < 1 or self.max_header_pixels < 1 or self.min_side < 1 or self.token_budget < 1:
            raise ValueError(f"ImageLimits values must be >= 1: {self}")
        if not 1.0 <= self.max_aspect <= PROCESSOR_MAX_ASPECT:
            raise ValueError(f"max_aspect must be in [1, {PROCESSOR_MAX_ASPECT:g}], got {self.max_aspect}")

    @property
    def max_pixels(self) -> int:
        """Largest width * height of a normalised image, in pixels (``token_budget * 32 * 32``)."""
        return self.token_budget * PIXELS_PER_TOKEN

    @classmethod
    def from_config(cls, cfg: Any) -> "ImageLimits":
        """The service's limits from a ``ServiceConfig``: ``max_upload_mb`` (MB = 2**20 bytes) per file and
        ``image_token_budget`` visual tokens per image; the other limits keep their defaults.

        Raises:
            ValueError: for a non-positive upload size or token budget (see the class docstring).
        """
        return cls(max_file_bytes=int(cfg.max_upload_mb * 1024 * 1024), token_budget=cfg.image_token_budget)


class TooManyImages(InvalidImage):
    """One message carries more images than allowed.  ``count`` images were sent, ``max_images`` allowed."""

    def __init__(self, count: int, max_images: int):
        noun = "image" if max_images == 1 else "images"
        super().__init__(f"at most {max_images} {noun} per message, got {count}")
        self.count = count
        self.max_images = max_images


def check_image_count(count: int, max_images: int) -> None:
    """The per-message image limit (``--max-images-per-turn``), checked before any image is decoded.

    Raises:
        TooManyImages: when ``count > max_images``.
    """
    if count > max_images:
        raise TooManyImages(count, max_images)


@dataclass(frozen=True)
class NormalizedImage:
    """Result of ``normalize_image``.

    Attributes:
        png: the normalised image (RGB, 8 bit, upright) encoded as PNG.
        width, height: its size in pixels.
        source_format: the sniffed format of the upload, one of ``ALLOWED_FORMATS``.
        frames: number of frames in the upload (1 for still images; only the first one is used).
        note: user-facing remark on what was changed ("" if nothing), e.g.
            "first frame of 20 used; downscaled from 8000x6000 to 1182x886".
    """

    png: bytes
    width: int
    height: int
    source_format: str
    frames: int
    note: str


def _not_allowed(what: str) -> InvalidImage:
    return InvalidImage(f"{what} is not supported; allowed: {_ALLOWED_TEXT}")


def _not_valid(reason: str = "") -> InvalidImage:
    detail = f" ({reason})" if reason else ""
    return InvalidImage(f"not a valid image{detail}; allowed: {_ALLOWED_TEXT}")


def _iso_brands(head: bytes) -> set[bytes]:
    """Major and compatible brands of an ISO-BMFF ``ftyp`` box (HEIC, AVIF, MP4...); empty set if none."""
    if len(head) < 12 or head[4:8] != b"ftyp":
        return set()
    size = int.from_bytes(head[0:4], "big")
    end = min(max(size, 16), len(head))
    brands = {head[8:12]}
    brands.update(head[i : i + 4] for i in range(16, end - 3, 4))
    return brands


def sniff_format(data: bytes) -> str:
    """Return the image format of ``data`` from its magic bytes: one of ``ALLOWED_FORMATS``.

    The file name and the client's MIME type are never consulted (a HEIC renamed ``.jpg`` is still HEIC).
    Signatures: JPEG ``FF D8 FF``; PNG ``89 50 4E 47 0D 0A 1A 0A``; GIF ``GIF87a``/``GIF89a``;
    WEBP ``RIFF....WEBP`` (each format's specification).

    Raises:
        InvalidImage: for anything else.  Known non-allowed image formats are named
            ("HEIC is not supported; allowed: JPEG, PNG, GIF, WEBP"); SVG, text, empty and unknown files get
            "not a valid image (...); allowed: JPEG, PNG, GIF, WEBP".
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _not_valid("no file data")
    head = bytes(data[:512])
    if not head:
        raise _not_valid("the file is empty")
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    brands = _iso_brands(head)
    if brands & {b"avif", b"avis"}:
        raise _not_allowed("AVIF")
    if brands & {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1"}:
        raise _not_allowed("HEIC")
    if head.startswith(b"BM"):
        raise _not_allowed("BMP")
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        raise _not_allowed("TIFF")
    if head.startswith(b"%PDF"):
        raise _not_valid("a PDF document")
    if b"<svg" in head.lower():
        raise _not_valid("SVG drawings are not supported")
    raise _not_valid()


def _open_header(data: bytes) -> ImageFile.ImageFile:
    """Sniff and parse the header only (no pixel decoded).  Raises InvalidImage."""
    fmt = sniff_format(data)
    try:
        return _IMAGE_CLASSES[fmt](io.BytesIO(bytes(data)))
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: Pillow raises SyntaxError, struct.error, ...
        log.info("image header rejected (%s): %r", fmt, exc)
        raise _not_valid(f"the {fmt} header is broken") from None


def normalize_image(data: bytes, limits: ImageLimits = ImageLimits()) -> NormalizedImage:
    """Check an uploaded image and return it as the upright, RGB, size-limited PNG the model will see.

    Args:
        data: the uploaded file's bytes (any name / MIME type; the content decides).
        limits: see ``ImageLimits``.

    Returns:
        ``NormalizedImage`` whose ``png`` has width * height <= ``limits.token_budget * 1024``, both sides
        >= 32 px and an aspect ratio <= 200, so transformers' Qwen2-VL ``smart_resize`` (factor 32) accepts
        it; transparent areas and padding are white.

    Raises:
        InvalidImage: with a user-facing message, for every problem (empty, too large in bytes or pixels,
            not an allowed format, truncated or corrupt, aspect ratio above ``limits.max_aspect``).  No other
            exception type escapes for any byte string.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _not_valid("no file data")
    size = len(data)
    if size == 0:
        raise _not_valid("the file is empty")
    if size > limits.max_file_bytes:
        raise InvalidImage(
            f"image file is too large: {size / 2**20:.1f} MB; max {limits.max_file_bytes / 2**20:g} MB"
        )
    im = _open_header(data)
    fmt = im.format or sniff_format(data)
    try:
        return _normalize_opened(im, fmt, limits)
    except InvalidImage:
        raise
    except Image.DecompressionBombError:
        raise InvalidImage(f"image is too large; max {limits.max_header_pixels / 1e6:g} MP") from None
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: Pillow raises OSError, SyntaxError, ValueError, ...
        log.info("image decode rejected (%s): %r", fmt, exc)
        truncated = isinstance(exc, OSError) and "truncated" in str(exc)
        raise _not_valid("the file is truncated" if truncated else f"the {fmt} data could not be decoded") from None
    finally:
        im.close()


def _normalize_opened(im: ImageFile.ImageFile, fmt: str, limits: ImageLimits) -> NormalizedImage:
    width, height = im.size
    if width < 1 or height < 1:
        raise _not_valid(f"the header says {width}x{height} pixels")
    if width * height > limits.max_header_pixels:
        raise InvalidImage(
            f"image is too large: {width}x{height} pixels ({width * height / 1e6:.1f} MP); "
            f"max {limits.max_header_pixels / 1e6:g} MP"
        )
    if min(width, height) < limits.min_side:
        raise InvalidImage(f"image is too small: {width}x{height} pixels; min {limits.min_side} px per side")
    long_side, short_side = max(width, height), min(width, height)
    if long_side / short_side > limits.max_aspect:
        raise InvalidImage(
            f"image aspect ratio too extreme; max {limits.max_aspect:g}:1 (this image is {width}x{height})"
        )
    plan = plan_shape(long_side, short_side, limits.max_pixels)
    notes = []
    frames = frame_count(im)
    if frames > 1:
        notes.append(f"first frame of {frames} used")

    if fmt == "JPEG" and plan.content_long < long_side:
        # Let libjpeg decode at 1/2, 1/4 or 1/8 scale (never below the target size): less memory and time.
        scale = plan.content_long / long_side
        im.draft(None, (math.ceil(width * scale), math.ceil(height * scale)))
    im.load()  # first frame only; raises OSError("image file is truncated") for truncated data

    upright, orientation = apply_exif_orientation(im)
    if orientation != 1:
        notes.append("rotated upright (EXIF orientation)")
    shown_size = (height, width) if orientation in (5, 6, 7, 8) else (width, height)  # as viewers show it
    rgb, had_alpha = to_rgb(upright)
    if had_alpha:
        notes.append("transparent areas shown on white")

    w, h = rgb.size
    if (plan.content_long, plan.content_short) != (max(w, h), min(w, h)):
        target = (plan.content_long, plan.content_short) if w >= h else (plan.content_short, plan.content_long)
        rgb = rgb.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
    w, h = rgb.size
    if plan.content_long < long_side:
        notes.append(f"downscaled from {shown_size[0]}x{shown_size[1]} to {w}x{h}")
    canvas_size = (plan.canvas_long, plan.canvas_short) if w >= h else (plan.canvas_short, plan.canvas_long)
    if canvas_size != (w, h):
        canvas = Image.new("RGB", canvas_size, WHITE)
        canvas.paste(rgb, ((canvas_size[0] - w) // 2, (canvas_size[1] - h) // 2))
        rgb = canvas
        notes.append(f"padded with white to {canvas_size[0]}x{canvas_size[1]}")

    out = io.BytesIO()
    rgb.save(out, "PNG", compress_level=PNG_COMPRESS_LEVEL)
    return NormalizedImage(
        png=out.getvalue(),
        width=rgb.size[0],
        height=rgb.size[1],
        source_format=fmt,
        frames=frames,
        note="; ".join(notes),
    )
