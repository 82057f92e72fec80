"""Image loading: specific errors for every bad upload, and normalisation to upright 8-bit RGB."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlm_demo.errors import InvalidRequestError
from vlm_demo.images import load_image


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width``×``height`` but whose pixel data is garbage.

    If the loader decoded pixels before checking the size it would report "corrupt"; the size
    message proves the cap is applied from the header alone (cheaply, before any allocation).
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"garbage") + chunk(b"IEND", b"")


RED_PNG = encode(Image.new("RGB", (32, 32), (255, 0, 0)))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (None, "upload an image"),
        ("", "upload an image"),
        ({"path": None, "url": None}, "upload an image"),
        (b"", "empty"),
        (b"hello, I am a text file", "not an image"),
        (b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>', "not an image"),
        (RED_PNG[:8], "looks like a PNG but is corrupt"),
        (RED_PNG[: len(RED_PNG) // 2], "corrupt or truncated"),
        (png_header_only(10, 10), "corrupt or truncated"),
        (png_header_only(8000, 8000), r"8000×8000 \(64.0 megapixels\); the limit is 40 megapixels"),
        (png_header_only(100_000, 100_000), r"100000×100000 \(10000.0 megapixels\); the limit is 40 megapixels"),
        (12345, "Unsupported image input"),
        ({"path": None, "url": "data:image/png,notbase64"}, "not base64"),
        ({"path": None, "url": "data:image/png;base64,@@@"}, "not valid base64"),
    ],
)
def test_bad_uploads_get_specific_messages(source, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        load_image(source)


def test_missing_file_and_byte_cap(tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match="could not be read"):
        load_image(str(tmp_path / "gone.png"))
    big = tmp_path / "big.png"
    big.write_bytes(RED_PNG)
    with pytest.raises(InvalidRequestError, match="limit is"):
        load_image(str(big), max_bytes=10)
    with pytest.raises(InvalidRequestError, match="limit is"):
        load_image(RED_PNG, max_bytes=10)


def test_pixel_cap_applies_to_pil_images_too() -> None:
    with pytest.raises(InvalidRequestError, match="megapixels"):
        load_image(Image.new("RGB", (100, 100)), max_pixels=5000)


def test_every_source_kind_gives_the_same_rgb_image(tmp_path) -> None:
    path = tmp_path / "red.png"
    path.write_bytes(RED_PNG)
    data_url = "data:image/png;base64," + base64.b64encode(RED_PNG).decode()
    for source in (str(path), path, RED_PNG, {"path": str(path)}, {"path": None, "url": data_url}):
        image = load_image(source)
        assert image.mode == "RGB" and image.size == (32, 32)
        assert image.getpixel((5, 5)) == (255, 0, 0)


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 20, 20))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    out = load_image(encode(image, "JPEG", exif=exif.tobytes(), quality=95))
    assert out.size == (20, 40)
    r, _, b = out.getpixel((10, 5))  # the red half is now on top
    assert r > 200 and b < 60


def test_transparency_is_flattened_onto_white() -> None:
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    assert load_image(encode(rgba)).getpixel((0, 0)) == (255, 255, 255)
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 255, 0] * 256)
    palette.info["transparency"] = 0
    assert load_image(encode(palette, transparency=0)).getpixel((0, 0)) == (255, 255, 255)
    grey_alpha = Image.new("LA", (8, 8), (0, 255))
    assert load_image(encode(grey_alpha)).getpixel((0, 0)) == (0, 0, 0)


@pytest.mark.parametrize(
    ("image", "fmt", "expected"),
    [
        (Image.new("L", (8, 8), 100), "PNG", (100, 100, 100)),
        (Image.new("1", (8, 8), 1), "PNG", (255, 255, 255)),
        (Image.new("P", (8, 8), 3), "GIF", None),
        (Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", "red"),
        (Image.new("YCbCr", (8, 8), (76, 85, 255)), "JPEG", "red"),
        (Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)), "PNG", (127, 127, 127)),
        (Image.new("F", (8, 8), 0.5), "TIFF", (0, 0, 0)),
    ],
)
def test_colour_modes_become_8bit_rgb(image: Image.Image, fmt: str, expected) -> None:
    out = load_image(encode(image, fmt))
    assert out.mode == "RGB" and out.size == (8, 8)
    pixel = out.getpixel((4, 4))
    if expected == "red":
        assert pixel[0] > 200 and pixel[1] < 60 and pixel[2] < 60, pixel
    elif expected is not None:
        assert all(abs(a - b) <= 2 for a, b in zip(pixel, expected, strict=True)), pixel


def test_sixteen_bit_is_scaled_not_clipped_to_white() -> None:
    ramp = np.linspace(0, 65535, 64, dtype=np.uint16).reshape(8, 8)
    out = np.asarray(load_image(encode(Image.fromarray(ramp))))
    assert out.min() == 0 and out.max() == 255 and 100 < out.mean() < 155


def test_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    r, g, b = load_image(buf.getvalue()).getpixel((4, 4))
    assert r > 200 and b < 60


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_fuzz_damaged_files_give_an_image_or_a_specific_error(data) -> None:
    """Flipped, cut or random bytes never escape as anything but InvalidRequestError."""
    base = data.draw(
        st.sampled_from([RED_PNG, encode(Image.new("RGB", (16, 16)), "JPEG"), encode(Image.new("P", (8, 8)), "GIF")])
    )
    blob = bytearray(base[: data.draw(st.integers(0, len(base)))])
    for _ in range(data.draw(st.integers(0, 6))):
        if blob:
            blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    try:
        image = load_image(bytes(blob), max_pixels=1_000_000)
    except InvalidRequestError as err:
        assert str(err)
    else:
        assert image.mode == "RGB" and image.width * image.height <= 1_000_000


@pytest.mark.parametrize("width, height", [(8000, 6000), (12000, 9000), (16330, 12247)])  # 48, 108, 200 MP
def test_camera_jpegs_are_decoded_at_reduced_scale_to_what_the_model_uses(width: int, height: int) -> None:
    """A phone's photo is accepted: decoded at 1/2-1/8 scale straight from the JPEG data, never below the
    2240-px long side four 560-px tiles can use, and the cap checks what was decoded."""
    photo = Image.new("RGB", (width, height), (200, 30, 30))
    data = encode(photo, "JPEG", quality=85)
    del photo
    image = load_image(data)
    assert image.mode == "RGB" and 2240 <= max(image.size) < max(width, height) / 1.9
    assert image.size[0] * image.size[1] <= 40_000_000
    assert image.getpixel((10, 10))[0] > 150  # the colour survives


def test_a_jpeg_too_big_even_at_an_eighth_and_a_png_bomb_are_refused_before_decoding() -> None:
    """The PNG has a header and no pixel data: it is refused from its header, before any decoding."""
    with pytest.raises(InvalidRequestError, match=r"40000×40000 \(1600.0 megapixels\); the limit is 40 megapixels"):
        load_image(png_header_only(40_000, 40_000))
    with pytest.raises(InvalidRequestError, match="even decoded at reduced scale"):
        load_image(encode(Image.new("RGB", (60_000, 6000), (1, 2, 3)), "JPEG"), max_pixels=1_000_000)
