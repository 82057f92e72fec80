"""The test pictures: solid-colour images of the colours the tiny model knows (what the tests and benchmarks send)."""

from __future__ import annotations

import numpy as np
from PIL import Image

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}


def solid_image(colour: str, width: int, height: int, noise: int = 0, seed: int = 0) -> Image.Image:
    """A ``width`` x ``height`` RGB image of one of ``COLOURS``, with optional uniform noise of +-``noise``."""
    pixels = np.empty((height, width, 3), dtype=np.int16)
    pixels[...] = COLOURS[colour]
    if noise:
        rng = np.random.default_rng(seed)
        pixels += rng.integers(-noise, noise + 1, size=pixels.shape, dtype=np.int16)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
