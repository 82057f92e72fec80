"""Hugging Face Spaces detection.

ZeroGPU (``@spaces.GPU``) lends a GPU to one function call at a time; our engine holds the model in a
process of its own for the server's lifetime, so Spaces need dedicated GPU hardware and nothing is
decorated.
"""

from __future__ import annotations

import os


def on_spaces() -> bool:
    """True inside a Hugging Face Space (where share links are not supported)."""
    return bool(os.environ.get("SPACE_ID"))
