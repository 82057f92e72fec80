"""The local engine in the web process itself (``--no-engine-process``, the benchmark, Triton's Python backend)."""

from __future__ import annotations

from typing import Any

from vlm_demo.config import Config
from vlm_demo.engine import Engine, GenerationResult, Request, ValidRequest
from vlm_demo.errors import DemoError


class LocalBackend:
    """Adapts :class:`Engine` to the :class:`~vlm_demo.backends.base.Backend` interface."""

    name = "local"

    def __init__(self, engine: Engine, model: str, notice: str | None = None) -> None:
        self.engine = engine
        self.model = model
        self.notice = notice  # the page's banner when this is not the real model

    @classmethod
    def from_config(cls, config: Config, notice: str | None = None) -> LocalBackend:
        return cls(Engine.from_config(config), config.model, notice)

    def submit(self, request: ValidRequest) -> Request:
        return self.engine.submit(request)

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        return self.engine.run_batch(items)

    def health(self) -> dict[str, Any]:
        return self.engine.stats()

    def add_listener(self, listener: Any) -> None:
        self.engine.add_listener(listener)

    def close(self) -> None:
        self.engine.shutdown()
