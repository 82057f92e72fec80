"""The tiny test model (being split into modules; the next commit re-exports each name)."""

from vlm_demo.models.tiny.data import *  # noqa: F403
