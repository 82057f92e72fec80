"""Our batching engine for Mllama: request -> scheduler -> worker (+ per-row streamer/sampler).

Importing this package is cheap and torch-free (the web process imports :mod:`~vlm_demo.engine.ipc.messages`
from it); :func:`make_engine` imports the engine itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from vlm_demo.config import Config
from vlm_demo.results import LoadProgress

if TYPE_CHECKING:  # for the annotations only: the modules themselves load torch
    from vlm_demo.engine.batching.base import Engine
    from vlm_demo.engine.executor.worker import Worker


def make_engine(
    config: Config,
    worker: Worker | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
    start: bool = True,
) -> Engine:
    """A started engine of the configured batching kind (``config.batching``), over ``worker`` or over
    the model ``config`` names (loaded here, reporting to ``progress``; raises
    :class:`~vlm_demo.errors.ModelLoadError`). With ``start`` false its thread is not started: the caller
    steps it (a ZeroGPU call, which may use the GPU only while it runs)."""
    from vlm_demo.engine.batching.continuous import ContinuousEngine
    from vlm_demo.engine.batching.dynamic import DynamicEngine
    from vlm_demo.engine.executor.decode_step import pageable
    from vlm_demo.engine.weights.loader import load_worker

    kinds = {"continuous": ContinuousEngine, "dynamic": DynamicEngine}
    if config.batching not in kinds:
        raise ValueError(f"unknown batching mode {config.batching!r}")
    worker = worker or load_worker(config, progress)
    if config.batching == "continuous" and not pageable(worker.model):
        logging.getLogger(__name__).warning(
            "the text model's weights are offloaded: continuous batching needs them on a device; running dynamic"
        )
        config = dataclasses.replace(config, batching="dynamic")
    engine = kinds[config.batching](worker, config)
    if not start:
        return engine
    if progress is not None:
        progress(LoadProgress("warming up the engine"))
    return engine.start()
