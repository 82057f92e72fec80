"""The local backend: our batching engine on this machine's GPU (or CPU)."""

from __future__ import annotations

from typing import Any

from vlm_demo.config import Config
from vlm_demo.engine import Engine, GenerationResult, Request, ValidRequest
from vlm_demo.errors import DemoError


class LocalBackend:
    """Adapts :class:`Engine` to the :class:`~vlm_demo.backends.base.Backend` interface."""

    name = "local"

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine = engine
        self.model = model

    @classmethod
    def from_config(cls, config: Config) -> LocalBackend:
        return cls(Engine.from_config(config), config.model)

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
