"""The one interface the web layer, the server and the benchmark talk to, whatever generates the answer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from vlm_demo.errors import DemoError
from vlm_demo.request import ValidRequest
from vlm_demo.results import EngineStats, GenerationResult
from vlm_demo.stream import Listener, Stream


@dataclass(frozen=True)
class RemoteStatus:
    """A remote (Triton) model as the backend last saw it."""

    url: str
    model: str
    protocol: str  # "infer" or "generate"
    server_ready: bool = False
    model_ready: bool = False


@dataclass(frozen=True)
class Health:
    """What a backend says about itself: ``ready`` and ``queue_depth`` for everyone, the rest for operators."""

    ready: bool
    queue_depth: int = 0
    max_batch_size: int = 0  # rows the engine batches; 0 where the remote side decides (Triton)
    in_flight: int = 0  # requests handed to the backend and not finished
    engine: EngineStats | None = None  # a local engine's own report
    engine_pid: int | None = None  # the engine process, when the engine runs in one
    engine_restarts: int = 0
    remote: RemoteStatus | None = None
    error: str | None = None  # why it is not ready
    response_cache_hits: int = 0  # the web process's response cache (backends/cache.py), when it is on
    response_cache_misses: int = 0
    response_cache_entries: int = 0  # answers it holds

    @property
    def weights(self) -> str:
        """How the served model's weights are stored ("fp8", "int8", "bf16"…), "" where it is not known (Triton)."""
        return self.engine.weights if self.engine is not None else ""

    @property
    def decode_attention(self) -> str:
        """The continuous engine's decode-attention kernel ("flash", "triton", "reference"), else ""."""
        return self.engine.decode_attention if self.engine is not None else ""

    def details(self) -> dict[str, Any]:
        """Everything but ``ready`` and ``queue_depth``, flat (``/health``'s ``details``)."""
        out: dict[str, Any] = dataclasses.asdict(self.engine) if self.engine is not None else {}
        for name in ("ready", "queue_depth"):
            out.pop(name, None)
        if self.engine is not None or self.engine_pid is not None:
            out.update(engine_pid=self.engine_pid, engine_restarts=self.engine_restarts, in_flight=self.in_flight)
        if self.remote is not None:
            out.update(
                url=self.remote.url,
                triton_model=self.remote.model,
                protocol=self.remote.protocol,
                server_ready=self.remote.server_ready,
                model_ready=self.remote.model_ready,
            )
        if self.error:
            out["error"] = self.error
        if self.response_cache_hits or self.response_cache_misses:
            out.update(
                response_cache_hits=self.response_cache_hits,
                response_cache_misses=self.response_cache_misses,
                response_cache_entries=self.response_cache_entries,
            )
        return out


@dataclass(frozen=True)
class Features:
    """What a backend can do beyond a plain answer; the page offers only these (a control it cannot honour
    would end in an error the visitor did not cause)."""

    stage_beam: bool = True  # "Think harder": needs the engine's continuous batching
    history: bool = True  # follow-up questions (earlier turns in the prompt)
    # Each call borrows a GPU of its own for its duration (ZeroGPU): requests batch only within one call, so the page
    # runs one /ask_batch batch at a time and lets the requests that arrive meanwhile gather into the next.
    gpu_per_call: bool = False


class Backend(Protocol):
    name: str  # "engine-process", "in-process" (the engine in this process), "triton", "zerogpu": /health, the page
    remote: bool  # health() asks another server over the network (it may take seconds): never on an event loop
    model: str  # what the page and /health show

    @property
    def notice(self) -> str | None:
        """The page's banner when the model is not the real one (the tiny test model)."""
        ...

    @property
    def features(self) -> Features: ...

    def submit(self, request: ValidRequest) -> Stream:
        """Enqueue a request that passed the door; raise a :class:`DemoError` at once when it cannot be taken."""
        ...

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        """Run many requests together; one item's failure is returned in its slot, never raised."""
        ...

    def health(self) -> Health: ...

    def add_listener(self, listener: Listener) -> None:
        """Register an observer of batches and finished requests (metrics)."""
        ...

    def pids(self) -> dict[str, int]:
        """The local processes doing this backend's work besides the caller's (benchmarks count their CPU)."""
        ...

    def close(self) -> None: ...
