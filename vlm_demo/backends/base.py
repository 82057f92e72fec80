"""The one interface the UI, server and benchmark talk to, whatever generates the answer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from vlm_demo.errors import DemoError
from vlm_demo.schema import GenerationResult, ValidRequest


class Stream(Protocol):
    """A running request: text deltas, then a final result; cancellable from any thread."""

    @property
    def done(self) -> bool: ...

    def stream(self, timeout: float | None = None) -> Iterator[str]: ...

    def drain(self) -> tuple[str, bool]:
        """Text that arrived so far without waiting, and whether the stream ended (raises its error)."""
        ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...

    def result(self, timeout: float | None = None) -> GenerationResult: ...

    def cancel(self) -> None: ...


class Backend(Protocol):
    name: str  # "local" or "triton"
    model: str  # what the page and /health show

    def submit(self, request: ValidRequest) -> Stream:
        """Enqueue a request that passed the door; raise a :class:`DemoError` at once when it cannot be taken."""
        ...

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        """Run many requests together; one item's failure is returned in its slot, never raised."""
        ...

    def health(self) -> dict[str, Any]:
        """At least ``ready`` (bool) and ``queue_depth`` (int)."""
        ...

    def add_listener(self, listener: Any) -> None:
        """Register an object with ``on_batch(size)`` and ``on_request_done(request)`` (metrics)."""
        ...

    def close(self) -> None: ...
