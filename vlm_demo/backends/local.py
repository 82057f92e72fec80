"""The local engine in the web process itself (``--no-engine-process``, the benchmark, Triton's Python backend)."""

from __future__ import annotations

from collections.abc import Callable

from vlm_demo.backends.base import Features, Health
from vlm_demo.config import Config
from vlm_demo.engine import make_engine
from vlm_demo.engine.batching.base import Engine
from vlm_demo.engine.ipc.handles import EngineStream
from vlm_demo.errors import DemoError
from vlm_demo.request import ValidRequest
from vlm_demo.results import GenerationResult, LoadProgress
from vlm_demo.stream import Listener


class LocalBackend:
    """Adapts an :class:`~vlm_demo.engine.batching.base.Engine` to the :class:`~vlm_demo.backends.base.Backend` interface."""

    name = "in-process"
    remote = False

    def __init__(self, engine: Engine, model: str, notice: str | None = None) -> None:
        self.engine = engine
        self.model = model
        self.notice = notice  # the page's banner when this is not the real model
        self.features = Features(stage_beam=engine.supports_stage_beam)

    @classmethod
    def from_config(
        cls, config: Config, notice: str | None = None, progress: Callable[[LoadProgress], None] | None = None
    ) -> LocalBackend:
        return cls(make_engine(config, progress=progress), config.model, notice)

    def submit(self, request: ValidRequest) -> EngineStream:
        return self.engine.submit(request)

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        return self.engine.run_batch(items)

    def health(self) -> Health:
        stats = self.engine.stats()
        return Health(stats.ready, stats.queue_depth, stats.max_batch_size, stats.running, engine=stats)

    def add_listener(self, listener: Listener) -> None:
        self.engine.add_listener(listener)

    def pids(self) -> dict[str, int]:
        return {}  # the engine runs in the caller's process

    def close(self) -> None:
        self.engine.shutdown()
