"""Pixel-level steps of ``qwen_chat.images.normalize_image``: the target shape, EXIF orientation, conversion to RGB.

Pillow only (no torch).  The shape rules follow the processor the model's images go through: one visual token
per 32x32 pixel block (docs/facts.md, "Images") and transformers' ``smart_resize``, which refuses an aspect
ratio above 200 and sides below its factor.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from PIL import ExifTags, Image, ImageFile, ImageMath, ImageOps

log = logging.getLogger(__name__)

# Qwen3.5 vision tower: patch 16 x 2x2 spatial merge = one visual token per 32x32 pixel block
# (docs/facts.md, "Images"; processor factor = patch_size * merge_size).
PIXELS_PER_TOKEN = 32 * 32
MIN_SIDE_PX = 32
# transformers' smart_resize raises "absolute aspect ratio must be smaller than 200" above this
# (transformers/models/qwen2_vl/image_processing_qwen2_vl.py).
PROCESSOR_MAX_ASPECT = 200.0

WHITE = (255, 255, 255)


@dataclass(frozen=True)
class ShapePlan:
    """Target geometry in orientation-free terms: content long/short side and canvas long/short side."""

    content_long: int
    content_short: int
    canvas_long: int
    canvas_short: int


def plan_shape(long_side: int, short_side: int, max_pixels: int) -> ShapePlan:
    """Choose the content size and padded canvas size for a ``long_side x short_side`` image.

    Guarantees: canvas_long * canvas_short <= max_pixels (max_pixels >= 1024); both canvas sides >= 32;
    canvas_long / canvas_short <= 200; the content keeps the source aspect ratio (to rounding) and is
    never upscaled.
    """
    aspect = long_side / short_side
    target = long_side
    if long_side * short_side > max_pixels:
        target = max(1, math.floor(long_side * math.sqrt(max_pixels / (long_side * short_side))))

    def canvas(content_long: int) -> tuple[int, int, int]:
        if content_long == long_side:
            content_short = short_side
        else:
            content_short = max(1, min(short_side, math.floor(content_long / aspect)))
        canvas_short = max(content_short, MIN_SIDE_PX, math.ceil(content_long / PROCESSOR_MAX_ASPECT))
        return content_short, max(content_long, MIN_SIDE_PX), canvas_short

    content_short, canvas_long, canvas_short = canvas(target)
    # Padding the short side (to 32 px, or to keep the aspect <= 200) can push the canvas over the budget:
    # shrink the long side until it fits.  canvas_short never grows as target shrinks, so this converges.
    while canvas_long * canvas_short > max_pixels:
        target = max(1, min(target - 1, max_pixels // canvas_short))
        content_short, canvas_long, canvas_short = canvas(target)
    return ShapePlan(target, content_short, canvas_long, canvas_short)


def to_rgb(im: Image.Image) -> tuple[Image.Image, bool]:
    """Convert any decoded mode to 8-bit RGB; transparent pixels are composited onto white.

    Handles 1, L, P, RGB, CMYK, YCbCr, I;16 / I (16-bit greyscale PNG, scaled 0..65535 -> 0..255 because
    Pillow's own ``convert`` clips at 255), LA, PA, RGBA and the tRNS transparency of P, L, RGB and 16-bit
    greyscale.  Returns ``(rgb_image, had_transparency)``; ``had_transparency`` is True only when some pixel
    was not fully opaque.
    """
    if im.mode.startswith("I"):
        as_int = im.convert("I")
        # ``point`` on an "I" image returns "I"; the values are already in 0..255, so convert("L") is exact.
        grey = as_int.point(lambda v: v / 256).convert("L")
        trns = im.info.get("transparency")
        if isinstance(trns, int):
            equal = ImageMath.lambda_eval(lambda a: a["equal"](a["im"], trns), im=as_int)  # 1 where transparent
            grey = grey.convert("LA")
            grey.putalpha(equal.point(lambda v: v * -255 + 255).convert("L"))
        im = grey
    has_alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
    if not has_alpha:
        return (im if im.mode == "RGB" else im.convert("RGB")), False
    rgba = im.convert("RGBA")
    alpha = rgba.getchannel("A")
    if alpha.getextrema()[0] == 255:  # an alpha channel, but every pixel opaque (common for screenshots)
        return rgba.convert("RGB"), False
    background = Image.new("RGB", rgba.size, WHITE)
    background.paste(rgba, mask=alpha)
    return background, True


def frame_count(im: ImageFile.ImageFile) -> int:
    """Frames in the file (GIF/WEBP/APNG), counted by parsing, not decoding; 1 if it cannot be counted."""
    try:
        return max(1, int(getattr(im, "n_frames", 1)))
    except Exception:  # noqa: BLE001 - a broken later frame must not reject a usable first frame
        return 1
    finally:
        try:
            im.seek(0)
        except Exception:  # noqa: BLE001
            pass


def apply_exif_orientation(im: Image.Image) -> tuple[Image.Image, int]:
    """Turn ``im`` upright per its EXIF Orientation tag with ``ImageOps.exif_transpose``.

    Returns ``(image, orientation)``: ``orientation`` is the applied tag value 2-8 (5-8 swap width and
    height), or 1 with ``im`` itself when there was nothing to do.  A malformed EXIF block is ignored (the
    pixels are still valid).
    """
    try:
        orientation = im.getexif().get(ExifTags.Base.Orientation, 1)
        if orientation not in (2, 3, 4, 5, 6, 7, 8):
            return im, 1
        return ImageOps.exif_transpose(im), orientation
    except Exception as exc:  # noqa: BLE001 - broken metadata must not reject a decodable image
        log.info("EXIF orientation ignored: %r", exc)
        return im, 1
