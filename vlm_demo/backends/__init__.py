"""Where answers come from: the local engine or a remote Triton server, behind one interface."""

from __future__ import annotations

import threading
from collections.abc import Callable

from vlm_demo.backends.base import Backend
from vlm_demo.config import Config
from vlm_demo.results import LoadProgress


def make_backend(
    config: Config,
    progress: Callable[[LoadProgress], None] | None = None,
    stopping: threading.Event | None = None,
) -> Backend:
    """The Triton backend when ``--triton-url`` is set; else on a ZeroGPU Space (``SPACES_ZERO_GPU``) the
    weights here and the engine in ZeroGPU's GPU calls; else the local batching engine: in its own process
    (the default), or in this one with ``--no-engine-process``; with the response cache in front
    (``--response-cache-mb``).

    Raises ``SystemExit`` with one sentence when the model cannot be loaded at all (or ``stopping`` was set while
    the engine process loaded it).
    """
    backend = _make_backend(config, progress, stopping)
    if config.response_cache_mb > 0:
        from vlm_demo.backends.cache import CachingBackend

        return CachingBackend(backend, int(config.response_cache_mb * 1024**2))
    return backend


def _make_backend(
    config: Config, progress: Callable[[LoadProgress], None] | None, stopping: threading.Event | None
) -> Backend:
    if config.triton_url:
        from vlm_demo.backends.triton.backend import TritonBackend

        if progress is not None:
            progress(LoadProgress(f"connecting to Triton at {config.triton_url}"))
        return TritonBackend.from_config(config, progress)
    from vlm_demo.backends import zerogpu
    from vlm_demo.errors import DemoError

    if zerogpu.enabled():
        from vlm_demo.backends.zerogpu.backend import ZeroGPUBackend

        try:
            return ZeroGPUBackend.from_config(config, progress)
        except DemoError as err:
            raise SystemExit(f"Cannot start the model: {err}") from None
    if config.engine_process:
        from vlm_demo.backends.engine_client import EngineProcessBackend, EngineStartError

        try:
            return EngineProcessBackend.from_config(config, progress, stopping)
        except EngineStartError as err:
            raise SystemExit(f"Cannot start the model: {err}") from None
    from vlm_demo.backends.local import LocalBackend
    from vlm_demo.models.choice import choose_model

    config, notice = choose_model(config)
    try:
        return LocalBackend.from_config(config, notice, progress)
    except DemoError as err:
        raise SystemExit(f"Cannot start the model: {err}") from None
