"""Open an uploaded image safely and normalise it to the plain RGB picture the model expects.

Uploads are taken unprocessed (a file path, bytes or Gradio's file payload) so that *we* decide what
is too big and say exactly what is wrong: the pixel count is checked from the header before any
pixel is decoded (decompression bombs), and every failure is an :class:`InvalidRequestError` whose
message the visitor can act on. A camera JPEG (a phone's 48-200 megapixels) is decoded at reduced
scale (JPEG draft mode: 1/2, 1/4 or 1/8 straight from the compressed data) to what the model can use
— at most four 560-px tiles side by side, so a long side of 2240 px — and the cap applies to the pixels
actually decoded; other formats cannot be decoded smaller, so their cap applies to the file's size. Normalising here (EXIF orientation, alpha, palette, CMYK, 16-bit,
animation) means the engine only ever sees ``RGB`` images.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import os
import warnings
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from vlm_demo.errors import InvalidRequestError

log = logging.getLogger(__name__)

DEFAULT_MAX_PIXELS = 40_000_000
DRAFT_LONG_SIDE = 2240  # the most pixels a tile layout uses along one side (4 tiles of 560)
# Our own caps decide, before anything is decoded (PIL's guard would refuse a 200 MP camera JPEG that
# draft mode decodes at a quarter of its size).
Image.MAX_IMAGE_PIXELS = None
DEFAULT_MAX_BYTES = 50 * 1024 * 1024
SUPPORTED = "PNG, JPEG, WebP, GIF, BMP or TIFF"


def image_digest(image: Image.Image) -> str:
    """A digest of a decoded picture (mode, size, pixels): equal pictures, equal digests, whatever file
    they came in. The image-state and response caches key on it."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def load_image(source: Any, max_pixels: int = DEFAULT_MAX_PIXELS, max_bytes: int = DEFAULT_MAX_BYTES) -> Image.Image:
    """Return ``source`` as a fully decoded RGB image, or raise :class:`InvalidRequestError`.

    ``source`` may be a file path, raw bytes, a ``PIL.Image``, or a Gradio file payload (a dict
    with ``path`` or a ``data:`` ``url``), which is what an event with ``preprocess=False`` gets.
    """
    if isinstance(source, Image.Image):
        _check_pixels(source.size, max_pixels)
        return _decode(source)
    data = _read_bytes(source, max_bytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own cap decides
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        kind = _looks_like(data)
        if kind:
            raise InvalidRequestError(f"The file looks like a {kind} but is corrupt or truncated.") from None
        raise InvalidRequestError(f"That file is not an image we can read. Please upload a {SUPPORTED} file.") from None
    except Exception as err:  # a header so broken PIL fails while identifying it
        log.info("image header unreadable: %r", err)
        raise InvalidRequestError("The image file is corrupt (its header cannot be read).") from None
    original = image.size
    if image.format == "JPEG":
        _draft(image)
    _check_pixels(image.size, max_pixels, original)
    return _decode(image)


def _draft(image: Image.Image) -> None:
    """Let the JPEG decoder scale down (by 2, 4 or 8) as far as the long side stays >= DRAFT_LONG_SIDE."""
    width, height = image.size
    longest = max(width, height)
    if longest <= DRAFT_LONG_SIDE:
        return
    wanted = (max(1, width * DRAFT_LONG_SIDE // longest), max(1, height * DRAFT_LONG_SIDE // longest))
    try:
        image.draft(image.mode, wanted)
    except (OSError, ValueError) as err:  # a JPEG whose header draft mode cannot use: decode it whole
        log.info("JPEG draft mode unavailable: %r", err)


def _decode(image: Image.Image) -> Image.Image:
    """Decode the pixels (a lazily opened image may be truncated) and normalise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image.load()
        return normalise(image)
    except InvalidRequestError:
        raise
    except Exception as err:  # truncated or damaged pixel data
        log.info("image data undecodable: %r", err)
        raise InvalidRequestError("The image file is corrupt or truncated; its pixels cannot be decoded.") from None


def _read_bytes(source: Any, max_bytes: int) -> bytes:
    """The file's bytes, with specific messages for a missing, empty or oversized upload."""
    if isinstance(source, dict):
        url = source.get("url") or ""
        if not source.get("path") and url.startswith("data:"):
            return _decode_data_url(url, max_bytes)
        source = source.get("path")
    if source is None or (isinstance(source, str) and not source.strip()):
        raise InvalidRequestError("Please upload an image first.")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        try:
            size = os.path.getsize(source)
            if size > max_bytes:
                raise InvalidRequestError(_too_many_bytes(size, max_bytes))
            with open(source, "rb") as f:
                data = f.read()
        except OSError:
            raise InvalidRequestError("The uploaded image could not be read; please upload it again.") from None
    else:
        raise InvalidRequestError(f"Unsupported image input of type {type(source).__name__}; send an image file.")
    if not data:
        raise InvalidRequestError("The uploaded file is empty.")
    if len(data) > max_bytes:
        raise InvalidRequestError(_too_many_bytes(len(data), max_bytes))
    return data


_SIGNATURES = {
    b"\x89PNG": "PNG",
    b"\xff\xd8\xff": "JPEG",
    b"GIF8": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
}


def _looks_like(data: bytes) -> str | None:
    """The format a file claims by its magic bytes (to tell "corrupt PNG" from "not an image")."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return next((kind for magic, kind in _SIGNATURES.items() if data.startswith(magic)), None)


def _decode_data_url(url: str, max_bytes: int) -> bytes:
    head, _, payload = url.partition(",")
    if ";base64" not in head or len(payload) * 3 // 4 > max_bytes:
        raise InvalidRequestError("The image data URL is not base64 or is too large.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("The image data URL is not valid base64.") from None


def _too_many_bytes(size: int, max_bytes: int) -> str:
    return f"The file is {size / 2**20:.1f} MiB; the limit is {max_bytes / 2**20:.0f} MiB."


def _too_big_message(size: tuple[int, int], max_pixels: int, decoded: tuple[int, int] | None = None) -> str:
    limit = f"the limit is {max_pixels / 1e6:g} megapixels"
    w, h = size
    if decoded is not None and decoded != size:  # a JPEG too big even at an eighth of its size
        limit += f" ({decoded[0]}×{decoded[1]} even decoded at reduced scale)"
    return f"The image is {w}×{h} ({w * h / 1e6:.1f} megapixels); {limit}. Please resize it."


def _check_pixels(size: tuple[int, int], max_pixels: int, original: tuple[int, int] | None = None) -> None:
    """``size``: what will be decoded; ``original``: the file's own size, for the message."""
    w, h = size
    if w < 1 or h < 1:
        raise InvalidRequestError("The image has no pixels.")
    if w * h > max_pixels:
        raise InvalidRequestError(_too_big_message(original or size, max_pixels, size if original else None))


def normalise(image: Image.Image) -> Image.Image:
    """First frame, upright (EXIF), 8-bit RGB; transparency is flattened onto white."""
    if getattr(image, "n_frames", 1) > 1:
        image.seek(0)
    try:
        image = ImageOps.exif_transpose(image) or image
    except Exception as err:  # broken EXIF must not cost the visitor their answer
        log.info("ignoring unreadable EXIF orientation: %r", err)
    mode = image.mode
    if mode == "RGB":
        return image.copy()
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        return _high_bit_depth_to_rgb(image)
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    try:
        return image.convert("RGB")
    except (ValueError, OSError):
        raise InvalidRequestError(f"Images in colour mode {mode} are not supported; please send RGB.") from None


def _high_bit_depth_to_rgb(image: Image.Image) -> Image.Image:
    """Scale 16-bit/32-bit/float greyscale to 8 bits (PIL's own convert clips everything to white)."""
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        low, high = float(np.nanmin(values)), float(np.nanmax(values))
        scaled = (values - low) / (high - low) * 255 if high > low else np.zeros_like(values)
    else:
        scaled = values / 257.0  # 16-bit range 0..65535 onto 0..255
    grey = np.nan_to_num(scaled).clip(0, 255).astype(np.uint8)
    return Image.fromarray(grey, mode="L").convert("RGB")
