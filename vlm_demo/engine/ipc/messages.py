"""The messages between the web process and the engine process (torch-free; both sides import it).

Web → engine: ``Submit`` (a request that passed the door), ``Cancel``, ``Shutdown``.
Engine → web: ``Loading`` while the model loads, ``Ready`` once it is (or ``Fatal`` if it cannot be), then one ``Step`` per
engine step (merged when the pipe is slower than the engine: :class:`StepBuffer`) carrying every row's new text and
token ids, the requests that ended, the batch sizes run and the engine's stats. Text is sent per step,
not per token per row: with 32 rows that is 32× fewer messages for the web process to unpickle.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from vlm_demo.errors import DemoError
from vlm_demo.request import ValidRequest
from vlm_demo.results import BeamView, EngineStats, GenerationResult, LoadProgress

ENGINE_FAILED = 3  # the engine process's exit code after its engine thread died (the supervisor says so)
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # a stop of the whole group; the web process stops the engine


@dataclass
class Submit:
    rid: int
    request: ValidRequest


@dataclass
class Cancel:
    rid: int


@dataclass
class Shutdown:
    pass


@dataclass
class Loading:
    """While the engine process loads the model: where it stands (sent at each phase and step)."""

    progress: LoadProgress


@dataclass
class Ready:
    model: str  # what the page shows (the tiny model when the engine fell back to it)
    notice: str | None  # banner text when not the real model (no GPU, ``--model tiny``)
    stats: EngineStats


@dataclass
class Fatal:
    """The engine cannot start (bad model path, no CUDA for ``--device cuda`` …): one sentence for the operator."""

    message: str


@dataclass
class Ended:
    rid: int
    result: GenerationResult | None
    error: DemoError | None = None  # typed errors pickle as they are


@dataclass
class Step:
    """What one engine step (or several, merged) did, for the clients' :class:`~vlm_demo.engine.ipc.handles.StreamTable`."""

    text: list[tuple[int, str]] = field(default_factory=list)  # (rid, new text) in order
    tokens: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (rid, tokens so far, the new ids)
    beams: list[tuple[int, BeamView]] = field(default_factory=list)  # stage-beam searches that changed
    ended: list[Ended] = field(default_factory=list)  # after their last text
    batch_sizes: list[int] = field(default_factory=list)  # rows in each model batch/step
    stats: EngineStats | None = None  # queue depth, running rows …
    waiting: list[int] | None = None  # with ``stats``: the waiting requests' rids in queue order

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens or self.beams or self.ended or self.batch_sizes or self.stats)

    def merge(self, later: Step) -> Step:
        """This step followed by ``later``, as one message (each request's new text in one piece; the latest
        stats and queue win)."""
        text: dict[int, str] = {}
        for rid, piece in self.text + later.text:
            text[rid] = text.get(rid, "") + piece
        return Step(
            list(text.items()),
            self.tokens + later.tokens,
            self.beams + later.beams,
            self.ended + later.ended,
            self.batch_sizes + later.batch_sizes,
            later.stats if later.stats is not None else self.stats,
            later.waiting if later.stats is not None else self.waiting,
        )


class StepBuffer:
    """Steps not handed on yet, merged into one as they come (:meth:`Step.merge`, the one place Steps are
    merged): the engine thread holds Steps until ``--stream-every-ms`` passed (its hand-over to ``sink``), then
    the engine process's publisher holds them while the pipe is busy. Both are needed: the first paces the
    clients, the second only absorbs a slow pipe. (A ZeroGPU call holds its Steps between yields with
    :meth:`Step.merge` too.) Not thread-safe: its owner locks."""

    def __init__(self) -> None:
        self.step: Step | None = None

    def __bool__(self) -> bool:
        return self.step is not None  # held, even when empty (an idle engine's last Step is still handed on)

    def add(self, step: Step) -> None:
        self.step = step if self.step is None else self.step.merge(step)

    def take(self) -> Step | None:
        """What is held, merged (None when nothing is), and hold nothing."""
        step, self.step = self.step, None
        return step
