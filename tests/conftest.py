"""Shared fixtures: the tiny model is built once per machine (cached) and loaded once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    """Path of the trained tiny model folder (built on first use, then cached)."""
    from vlm_demo.models.tiny import ensure_tiny

    return ensure_tiny()


@pytest.fixture(scope="session")
def worker(tiny_dir):
    """One loaded tiny-model worker shared by the engine tests (loading twice wastes CPU)."""
    from vlm_demo.engine.loader import load

    return load(tiny_dir, device="cpu")
