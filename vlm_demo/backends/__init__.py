"""Where answers come from: the local engine or a remote Triton server, behind one interface."""

from __future__ import annotations

from vlm_demo.backends.base import Backend, Stream
from vlm_demo.config import Config

__all__ = ["Backend", "Stream", "make_backend"]


def make_backend(config: Config) -> Backend:
    """The Triton backend when ``--triton-url`` is set, else the local batching engine."""
    if config.triton_url:
        from vlm_demo.backends.triton import TritonBackend

        return TritonBackend.from_config(config)
    from vlm_demo.backends.local import LocalBackend

    return LocalBackend.from_config(config)
