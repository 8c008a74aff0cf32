"""Tests of qwen_chat.images: upload intake (extreme aspect ratios, EXIF rotation, formats, GIF/WEBP frames,
HEIC and fake images, decompression bombs).

Every variant is generated at test time from tests/fixtures/images/*.  Each test checks what a user would see:
the error message, or the size / pixel values of the normalised image (which is also the chat thumbnail).
"""
from __future__ import annotations

import io
import random
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image, ImageChops, ImageDraw, ImageStat

from qwen_chat.chat_types import InvalidImage, InvalidInput
from qwen_chat.images import (
    ALLOWED_FORMATS,
    PROCESSOR_MAX_ASPECT,
    ImageLimits,
    NormalizedImage,
    _open_header,
    normalize_image,
    sniff_format,
)
from qwen_chat.image_pixels import plan_shape

FIXTURES = Path(__file__).parents[1] / "fixtures" / "images"
ALLOWED_TEXT = "allowed: JPEG, PNG, GIF, WEBP"
RED, GREEN, BLUE, WHITE, BLACK = (255, 0, 0), (0, 160, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0)


def fixture(name: str) -> Image.Image:
    with Image.open(FIXTURES / name) as im:
        return im.convert("RGB")


def encode(im: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def decode(result: NormalizedImage) -> Image.Image:
    """The normalised PNG as the UI / model would load it."""
    im = Image.open(io.BytesIO(result.png))
    assert im.format == "PNG"
    assert im.mode == "RGB"
    assert im.size == (result.width, result.height)
    return im


def header_of(data: bytes) -> tuple[str, int, int]:
    """(format, width, height) as the file's header states them: stored orientation, no pixel decoded."""
    im = _open_header(data)
    try:
        return im.format, im.size[0], im.size[1]
    finally:
        im.close()


def close(pixel, expected, tol=12) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(pixel, expected))


def mean_abs_diff(a: Image.Image, b: Image.Image) -> float:
    """Mean absolute difference per RGB channel value, 0..255."""
    assert a.size == b.size
    diff = ImageChops.difference(a.convert("RGB"), b.convert("RGB"))
    return sum(ImageStat.Stat(diff).mean) / 3


def qwen_processor_tokens(result: NormalizedImage, budget: int, min_pixels: int) -> int:
    """Run transformers' Qwen2-VL image processor (Qwen3.5 settings: patch 16, merge 2) on the result.

    Returns the number of visual tokens (grid_t * grid_h * grid_w / merge**2); raises whatever the processor
    raises (an extreme aspect ratio used to make it raise).
    """
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": budget * 1024},
    )
    out = processor(images=[decode(result)], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    return t * h * w // 4


# ---------------------------------------------------------------- formats and modes (upper-case WEBP, GIF frames)


def test_fixtures_pass_through_unchanged_in_size_and_colour():
    for name in ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "hubble_deep_field.jpg"):
        data = (FIXTURES / name).read_bytes()
        original = fixture(name)
        result = normalize_image(data)
        assert (result.width, result.height) == original.size, name
        assert result.source_format == ("JPEG" if name.endswith(".jpg") else "PNG")
        assert result.frames == 1
        assert result.note == ""
        assert decode(result).tobytes() == original.tobytes(), name  # lossless: same pixels the file holds


def test_cmyk_jpeg_becomes_rgb_with_the_same_colours():
    original = fixture("rocket.jpg")
    data = encode(original.convert("CMYK"), "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    result = normalize_image(data)
    assert (result.width, result.height) == original.size
    assert mean_abs_diff(decode(result), original) < 8


def test_16_bit_greyscale_png_is_scaled_not_clipped_to_white():
    grey = fixture("chelsea.png").convert("L")
    sixteen = grey.convert("I").point(lambda v: v * 257).convert("I;16")  # 0..255 -> 0..65535
    data = encode(sixteen, "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    out = decode(normalize_image(data))
    assert out.size == grey.size
    expected = grey.convert("RGB")
    assert mean_abs_diff(out, expected) <= 1.0
    dark = min(range(grey.width), key=lambda x: grey.getpixel((x, 150)))
    assert out.getpixel((dark, 150))[0] < 128  # a dark pixel stays dark (Pillow's own convert gives 255)


def test_16_bit_greyscale_png_with_trns_colour_is_white_there():
    im = Image.new("I;16", (40, 40), 1000)
    im.paste(Image.new("I;16", (20, 40), 30000), (0, 0))
    assert im.getpixel((5, 20)) == 30000
    data = encode(im, "PNG", transparency=1000)
    out = decode(normalize_image(data))
    assert out.getpixel((30, 20)) == WHITE  # the tRNS grey value is transparent -> white
    assert out.getpixel((5, 20)) == (117, 117, 117)  # 30000 / 256


def _palette_card() -> Image.Image:
    """P-mode 40x40 image: index 0 = red (left half), index 1 = blue (right half, marked transparent)."""
    im = Image.new("P", (40, 40), 0)
    im.putpalette([*RED, *BLUE] + [0, 0, 0] * 254)
    im.paste(1, (20, 0, 40, 40))
    return im


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_with_transparency_is_composited_on_white(fmt):
    data = encode(_palette_card(), fmt, transparency=1)
    result = normalize_image(data)
    out = decode(result)
    assert result.source_format == fmt
    assert out.getpixel((5, 20)) == RED
    assert out.getpixel((30, 20)) == WHITE  # transparent blue must not show as blue (or black)
    assert "white" in result.note


def test_rgba_png_transparent_pixel_comes_out_white():
    im = Image.new("RGBA", (40, 40), (*RED, 255))
    im.paste((0, 0, 0, 0), (20, 0, 40, 20))  # fully transparent black
    im.paste((*BLUE, 128), (20, 20, 40, 40))  # half-transparent blue
    out = decode(normalize_image(encode(im, "PNG")))
    assert out.getpixel((5, 5)) == RED
    assert out.getpixel((30, 5)) == WHITE
    assert close(out.getpixel((30, 30)), (127, 127, 255), tol=2)


@pytest.mark.parametrize(
    "mode,fill,params,expect_left,expect_right",
    [
        ("LA", (90, 0), {}, WHITE, (200, 200, 200)),
        ("RGB", GREEN, {"transparency": GREEN}, WHITE, (200, 200, 200)),
        ("L", 90, {"transparency": 90}, WHITE, (200, 200, 200)),
        ("1", 0, {}, BLACK, WHITE),
        ("L", 90, {}, (90, 90, 90), (200, 200, 200)),
    ],
)
def test_other_png_modes_become_rgb(mode, fill, params, expect_left, expect_right):
    im = Image.new(mode, (40, 40), fill)
    right = {"LA": (200, 255), "RGB": (200, 200, 200), "L": 200, "1": 1}[mode]
    im.paste(right, (20, 0, 40, 40))
    out = decode(normalize_image(encode(im, "PNG", **params)))
    assert out.getpixel((5, 20)) == expect_left
    assert out.getpixel((30, 20)) == expect_right


def test_animated_gif_uses_the_first_frame():
    frames = [Image.new("RGB", (480, 270), RED)] + [
        Image.new("RGB", (480, 270), (0, 0, 10 * i)) for i in range(1, 20)
    ]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 20
    result = normalize_image(data)
    out = decode(result)
    assert (result.width, result.height) == (480, 270)
    assert result.frames == 20
    assert result.note == "first frame of 20 used"
    assert out.getpixel((0, 0)) == RED and out.getpixel((479, 269)) == RED


def test_animated_gif_with_broken_later_frames_still_answers_with_the_first():
    """Only the first frame is decoded: damage after it does not matter (and memory does not grow)."""
    frames = [Image.new("RGB", (64, 64), RED)] + [
        Image.effect_noise((64, 64), 60 + i).convert("RGB") for i in range(10)
    ]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    first_frame_end = len(encode(frames[0], "GIF"))
    damaged = data[: first_frame_end + (len(data) - first_frame_end) // 2]
    out = decode(normalize_image(damaged))
    assert out.getpixel((32, 32)) == RED


def test_single_frame_gif():
    im = fixture("coffee.png").quantize(256).convert("RGB")
    result = normalize_image(encode(im, "GIF"))
    assert (result.source_format, result.frames, result.note) == ("GIF", 1, "")
    assert mean_abs_diff(decode(result), im) < 1.0


def test_webp_with_alpha_is_composited_on_white():
    im = Image.new("RGBA", (40, 40), (*GREEN, 255))
    im.paste((*BLUE, 0), (20, 0, 40, 40))
    result = normalize_image(encode(im, "WEBP", lossless=True))
    out = decode(result)
    assert result.source_format == "WEBP"
    assert out.getpixel((5, 20)) == GREEN
    assert out.getpixel((30, 20)) == WHITE


def test_animated_webp_uses_the_first_frame():
    frames = [Image.new("RGB", (96, 64), c) for c in (RED, GREEN, BLUE)]
    data = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True, duration=100)
    result = normalize_image(data)
    assert (result.source_format, result.frames, result.note) == ("WEBP", 3, "first frame of 3 used")
    assert (result.width, result.height) == (96, 64)
    assert decode(result).getpixel((48, 32)) == RED


@pytest.mark.parametrize(
    "filename,fmt",
    [("photo.webp", "WEBP"), ("PHOTO.WEBP", "WEBP"), ("IMG.JPG", "JPEG"), ("x.jpeg", "PNG"), ("x.gif", "WEBP")],
)
def test_format_comes_from_content_not_from_the_file_name(tmp_path, filename, fmt):
    path = tmp_path / filename
    path.write_bytes(encode(fixture("chelsea.png"), fmt))
    data = path.read_bytes()
    assert sniff_format(data) == fmt
    assert header_of(data) == (fmt, 451, 300)
    assert normalize_image(data).source_format == fmt


def test_allowed_formats_constant():
    assert ALLOWED_FORMATS == ("JPEG", "PNG", "GIF", "WEBP")


# ---------------------------------------------------------------- EXIF orientation

CARD_W, CARD_H = 120, 80
# Transpose that undoes each EXIF orientation, i.e. what a viewer applies to the stored pixels (EXIF 2.3,
# tag 0x0112): stored = upright transformed by the inverse of it.
VIEWER_OP = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
INVERSE = {
    Image.Transpose.ROTATE_90: Image.Transpose.ROTATE_270,
    Image.Transpose.ROTATE_270: Image.Transpose.ROTATE_90,
}


def make_card() -> Image.Image:
    """Upright test card: red band on the top edge, black arrow pointing up, green block on the left."""
    card = Image.new("RGB", (CARD_W, CARD_H), WHITE)
    draw = ImageDraw.Draw(card)
    draw.rectangle((0, 0, CARD_W - 1, 11), fill=RED)
    draw.polygon([(60, 18), (44, 40), (76, 40)], fill=BLACK)  # arrow head (tip at the top)
    draw.rectangle((55, 40, 65, 74), fill=BLACK)  # shaft
    draw.rectangle((4, 30, 20, 74), fill=GREEN)  # makes a left/right mirror visible
    return card



def stored_with_orientation(orientation: int, fmt: str = "JPEG") -> bytes:
    upright = make_card()
    stored = upright
    if orientation in VIEWER_OP:
        op = VIEWER_OP[orientation]
        stored = upright.transpose(INVERSE.get(op, op))
    exif = Image.Exif()
    exif[0x0112] = orientation
    params = {"quality": 95} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}
    return encode(stored, fmt, exif=exif.tobytes(), **params)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_gives_an_upright_card(orientation):
    data = stored_with_orientation(orientation)
    stored_size = header_of(data)[1:]
    assert stored_size == ((CARD_W, CARD_H) if orientation < 5 else (CARD_H, CARD_W))
    result = normalize_image(data)
    out = decode(result)
    assert out.size == (CARD_W, CARD_H)
    top = out.crop((0, 0, CARD_W, 8)).resize((1, 1), Image.Resampling.BOX).getpixel((0, 0))
    assert close(top, RED, tol=25), f"top edge is {top}, not red"
    bottom = out.crop((0, CARD_H - 4, CARD_W, CARD_H)).resize((1, 1), Image.Resampling.BOX).getpixel((0, 0))
    assert close(bottom, WHITE, tol=25)
    assert out.getpixel((60, 22))[0] < 80 and out.getpixel((48, 22))[0] > 200  # narrow tip at the top: points up
    assert close(out.getpixel((12, 50)), GREEN, tol=40)  # not mirrored
    assert mean_abs_diff(out, make_card()) < 6
    assert ("rotated upright" in result.note) == (orientation != 1)


@pytest.mark.parametrize("orientation", [6, 8])
def test_exif_orientation_of_a_large_jpeg_that_is_also_downscaled(orientation):
    """The JPEG draft (reduced-scale decode) and the downscale keep the orientation right."""
    upright = make_card().resize((CARD_W * 20, CARD_H * 20), Image.Resampling.NEAREST)  # 2400x1600
    op = VIEWER_OP[orientation]
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(upright.transpose(INVERSE[op]), "JPEG", quality=90, exif=exif.tobytes())
    result = normalize_image(data, ImageLimits(token_budget=64))
    out = decode(result)
    assert result.width > result.height  # landscape again, as the viewer shows it
    assert result.width * result.height <= 64 * 1024
    assert mean_abs_diff(out, make_card().resize(out.size, Image.Resampling.LANCZOS)) < 8
    assert result.note == f"rotated upright (EXIF orientation); downscaled from 2400x1600 to {out.width}x{out.height}"


def test_opaque_rgba_screenshot_gets_no_transparency_note():
    im = fixture("coffee.png").convert("RGBA")
    result = normalize_image(encode(im, "PNG"))
    assert result.note == ""
    assert decode(result).tobytes() == fixture("coffee.png").tobytes()


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_exif_orientation_in_png_and_webp(fmt):
    out = decode(normalize_image(stored_with_orientation(6, fmt)))
    assert out.size == (CARD_W, CARD_H)
    assert mean_abs_diff(out, make_card()) < 2


# ---------------------------------------------------------------- not an image / broken (HEIC, fake images)


def test_truncated_jpeg_is_rejected():
    data = (FIXTURES / "rocket.jpg").read_bytes()
    with pytest.raises(InvalidImage) as err:
        normalize_image(data[: len(data) // 2])
    assert str(err.value).startswith("not a valid image (the file is truncated)")


def test_truncated_png_is_rejected():
    data = (FIXTURES / "coffee.png").read_bytes()
    with pytest.raises(InvalidImage, match="not a valid image"):
        normalize_image(data[: len(data) // 2])


def test_empty_file():
    with pytest.raises(InvalidImage) as err:
        normalize_image(b"")
    assert str(err.value) == f"not a valid image (the file is empty); {ALLOWED_TEXT}"


def test_text_named_jpg():
    with pytest.raises(InvalidImage) as err:
        normalize_image(b"Meeting notes\n- buy milk\n- call Bob\n")
    assert str(err.value) == f"not a valid image; {ALLOWED_TEXT}"


def test_svg_with_script_named_png():
    svg = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="64" '
        b'height="64"><script>alert(document.cookie)</script><rect width="64" height="64" fill="red"/></svg>'
    )
    with pytest.raises(InvalidImage) as err:
        normalize_image(svg)
    assert str(err.value) == f"not a valid image (SVG drawings are not supported); {ALLOWED_TEXT}"


def test_heic_renamed_jpg_names_the_allowed_formats():
    ftyp = struct.pack(">I", 24) + b"ftypheic" + struct.pack(">I", 0) + b"mif1heic"
    data = ftyp + b"\x00\x00\x00\x08free" + bytes(range(256)) * 40
    with pytest.raises(InvalidImage) as err:
        normalize_image(data)
    assert str(err.value) == "HEIC is not supported; allowed: JPEG, PNG, GIF, WEBP"
    with pytest.raises(InvalidImage, match="^HEIC is not supported"):
        sniff_format(data)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF"])
def test_other_raster_formats_are_named(fmt):
    with pytest.raises(InvalidImage) as err:
        normalize_image(encode(Image.new("RGB", (8, 8)), fmt))
    assert str(err.value) == f"{fmt} is not supported; {ALLOWED_TEXT}"


def test_invalid_image_is_an_invalid_input_with_http_400():
    with pytest.raises(InvalidInput) as err:
        normalize_image(b"GIF89a\x00")
    assert err.value.http_status == 400 and err.value.kind == "invalid_image"


def test_file_over_the_byte_limit():
    data = (FIXTURES / "astronaut.png").read_bytes()
    with pytest.raises(InvalidImage) as err:
        normalize_image(data, ImageLimits(max_file_bytes=512 * 1024))
    assert str(err.value) == "image file is too large: 0.8 MB; max 0.5 MB"


def test_fuzzed_bytes_only_ever_raise_invalid_image():
    rng = random.Random(1234)
    small = fixture("chelsea.png").resize((48, 32))
    seeds = [encode(small, f) for f in ("PNG", "JPEG", "GIF", "WEBP")]
    seeds.append(stored_with_orientation(6))
    cases = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(50)]
    for seed in seeds:
        for _ in range(40):
            mutated = bytearray(seed)
            for _ in range(rng.randrange(1, 8)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            cut = rng.choice([len(mutated), rng.randrange(1, len(mutated))])
            cases.append(bytes(mutated[:cut]))
    accepted = 0
    for data in cases:
        try:
            result = normalize_image(data)
        except InvalidImage as exc:
            assert str(exc), data[:16]
        else:
            accepted += 1
            assert decode(result).size == (result.width, result.height)
    assert 0 < accepted < len(cases)


# ---------------------------------------------------------------- huge pixel counts (decompression bombs)


def solid_png_header_claiming(width: int, height: int) -> bytes:
    """A real, valid 1-bit single-colour PNG of width x height, a few KB on disk (zlib of identical rows)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" + b"\xff" * ((width + 7) // 8)  # filter byte 0 + white pixels
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_20000_square_png_bomb_is_refused_from_the_header():
    data = solid_png_header_claiming(20000, 20000)
    assert len(data) < 200_000
    assert header_of(data) == ("PNG", 20000, 20000)
    with pytest.raises(InvalidImage) as err:
        normalize_image(data)
    assert str(err.value) == "image is too large: 20000x20000 pixels (400.0 MP); max 50 MP"


def test_png_over_pillows_179_megapixel_bomb_limit_gets_our_message():
    data = solid_png_header_claiming(15000, 12000)  # 180 MP > Pillow's 2 * MAX_IMAGE_PIXELS
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(data))
    with pytest.raises(InvalidImage) as err:
        normalize_image(data)
    assert str(err.value) == "image is too large: 15000x12000 pixels (180.0 MP); max 50 MP"


@pytest.mark.slow  # reason: encodes a real 8000x6000 JPEG and loads transformers' image processor (~5-10 s)
def test_48_megapixel_photo_is_accepted_and_downscaled_to_the_token_budget():
    photo = fixture("rocket.jpg").resize((8000, 6000), Image.Resampling.BILINEAR)
    data = encode(photo, "JPEG", quality=80)
    result = normalize_image(data)
    assert result.width * result.height <= 1024 * 1024
    assert result.width * result.height > 0.98 * 1024 * 1024
    assert abs(result.width / result.height - 4 / 3) < 0.01
    assert result.note == f"downscaled from 8000x6000 to {result.width}x{result.height}"
    reference = fixture("rocket.jpg").resize((result.width, result.height), Image.Resampling.LANCZOS)
    assert mean_abs_diff(decode(result), reference) < 10
    assert qwen_processor_tokens(result, budget=1024, min_pixels=65536) <= 1024


# ---------------------------------------------------------------- shape policy (extreme aspect ratios)


def test_aspect_ratio_218_is_refused_before_the_processor():
    data = encode(Image.new("RGB", (1093, 5), BLUE), "PNG")
    with pytest.raises(InvalidImage) as err:
        normalize_image(data)
    assert str(err.value) == "image aspect ratio too extreme; max 200:1 (this image is 1093x5)"


@pytest.mark.parametrize("min_pixels", [65536, 32 * 32])
def test_long_screenshot_690x15420_is_accepted_by_the_qwen_processor(min_pixels):
    shot = fixture("coffee.png").resize((690, 15420))
    result = normalize_image(encode(shot, "PNG", compress_level=1))
    assert result.width * result.height <= 1024 * 1024
    assert min(result.width, result.height) >= 32
    assert result.height > result.width * 20  # still a tall screenshot, not squashed
    assert 0 < qwen_processor_tokens(result, budget=1024, min_pixels=min_pixels) <= 1024


def test_31x639_with_a_64_token_budget_is_padded_to_32_wide():
    im = Image.new("RGB", (31, 639), BLUE)
    limits = ImageLimits(token_budget=64)
    result = normalize_image(encode(im, "PNG"), limits)
    out = decode(result)
    assert (result.width, result.height) == (32, 639)
    assert result.width * result.height <= 64 * 1024
    assert out.getpixel((0, 300)) == BLUE and out.getpixel((31, 300)) == WHITE  # one white column added
    assert "padded with white to 32x639" in result.note
    assert 0 < qwen_processor_tokens(result, budget=64, min_pixels=32 * 32) <= 64


def test_very_long_image_with_a_small_budget_keeps_the_budget_and_32_px():
    """Aspect 150 > budget 64: downscaling alone would leave the short side under 32 px, so it is padded."""
    im = Image.new("RGB", (100, 15000), RED)
    result = normalize_image(encode(im, "PNG"), ImageLimits(token_budget=64))
    out = decode(result)
    assert result.width == 32
    assert result.width * result.height <= 64 * 1024
    assert result.height == 64 * 1024 // 32
    assert out.getpixel((16, 1000)) == RED and out.getpixel((0, 1000)) == WHITE
    assert 0 < qwen_processor_tokens(result, budget=64, min_pixels=32 * 32) <= 64


def test_aspect_exactly_200_stays_within_the_processor_limit_after_downscaling():
    im = Image.new("RGB", (250, 50_000), GREEN)
    result = normalize_image(encode(im, "PNG"))
    assert max(result.width, result.height) / min(result.width, result.height) <= 200
    assert qwen_processor_tokens(result, budget=1024, min_pixels=65536) <= 1024


def test_tiny_5x5_image_is_padded_to_32x32():
    im = Image.new("RGB", (5, 5), RED)
    result = normalize_image(encode(im, "PNG"))
    out = decode(result)
    assert (result.width, result.height) == (32, 32)
    assert out.getpixel((16, 16)) == RED
    assert out.getpixel((0, 0)) == WHITE and out.getpixel((31, 31)) == WHITE
    assert result.note == "padded with white to 32x32"
    assert qwen_processor_tokens(result, budget=1024, min_pixels=65536) > 0


def test_one_pixel_wide_image_within_aspect_is_padded():
    result = normalize_image(encode(Image.new("RGB", (1, 150), BLUE), "PNG"))
    assert (result.width, result.height) == (32, 150)
    row = [decode(result).getpixel((x, 75)) for x in range(32)]
    assert row.count(BLUE) == 1 and row.count(WHITE) == 31


def test_shape_plan_is_always_legal_for_the_qwen_processor():
    """Over many shapes and budgets the planned canvas satisfies smart_resize (factor 32) and the budget."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = random.Random(7)
    shapes = [(690, 15420), (31, 639), (5, 5), (1, 200), (250, 50_000), (8000, 6000), (1, 1), (33, 6600)]
    shapes += [(rng.randint(1, 300), rng.randint(1, 60_000)) for _ in range(400)]
    shapes += [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(400)]
    for short, long in shapes:
        short, long = min(short, long), max(short, long)
        if long / short > PROCESSOR_MAX_ASPECT:
            continue  # refused before planning
        for budget in (1, 64, 256, 1024, 16384):
            plan = plan_shape(long, short, budget * 1024)
            shape = (long, short, budget, plan)
            assert plan.canvas_long * plan.canvas_short <= budget * 1024, shape
            assert min(plan.canvas_long, plan.canvas_short) >= 32, shape
            assert plan.canvas_long / plan.canvas_short <= PROCESSOR_MAX_ASPECT, shape
            assert plan.content_long <= min(long, plan.canvas_long), shape
            assert plan.content_short <= min(short, plan.canvas_short), shape
            if plan.canvas_long == plan.content_long and plan.canvas_short == plan.content_short:
                assert abs(plan.content_long / plan.content_short - long / short) <= long / short * 0.05 + 1 / short
            h, w = smart_resize(plan.canvas_long, plan.canvas_short, factor=32, min_pixels=32 * 32,
                                max_pixels=budget * 1024)
            assert h % 32 == 0 and w % 32 == 0 and h * w <= budget * 1024, shape
