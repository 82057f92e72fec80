"""Hugging Face Spaces support without depending on the ``spaces`` package.

On Spaces, ``@spaces.GPU`` marks the functions that need a (ZeroGPU) accelerator; elsewhere the
package is usually absent and the decorator must vanish. ``spaces.GPU`` is itself a no-op unless
``SPACES_ZERO_GPU`` is set, so applying it whenever it imports is safe.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)

GPU_SECONDS = 120  # ZeroGPU's per-call budget: long CoT answers need more than the 60 s default


def gpu(fn: F) -> F:
    """``spaces.GPU(duration=GPU_SECONDS)(fn)`` when the ``spaces`` package imports, else ``fn``."""
    try:
        import spaces  # type: ignore[import-not-found]
    except ImportError:
        return fn
    log.info("spaces package found: wrapping %s with @spaces.GPU", getattr(fn, "__name__", fn))
    return spaces.GPU(duration=GPU_SECONDS)(fn)


def on_spaces() -> bool:
    """True inside a Hugging Face Space (where share links are not supported)."""
    return bool(os.environ.get("SPACE_ID"))
