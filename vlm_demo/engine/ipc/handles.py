"""The clients' side of an engine: one handle per request, fed by the engine's Step messages.

An engine reports what its requests did as :class:`~vlm_demo.engine.ipc.messages.Step` messages — one per
engine step — and :class:`StreamTable` applies them to the handles: new text, token ids, stage-beam
views, ends, queue positions and stats. The same table serves an engine in this process (its thread
applies each Step as it returns) and an engine in its own process (the pipe's reader applies them), so
``ahead``, ``tokens`` and ``beam_view`` mean the same thing everywhere. Torch-free: the web process
imports it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

from vlm_demo.engine.ipc.messages import Step
from vlm_demo.errors import DemoError, RequestCancelledError
from vlm_demo.results import BeamView, EngineStats
from vlm_demo.stream import Listener, OutputStream, Stream

log = logging.getLogger(__name__)


class EngineStream(OutputStream):
    """A request running in an engine: text, token ids and views as the engine's Steps bring them."""

    def __init__(self, rid: int, table: StreamTable) -> None:
        super().__init__()
        self.rid = rid
        self.token_ids: list[int] = []  # the answer's tokens so far
        self._table = table
        self._beam: BeamView | None = None

    def beam_view(self) -> BeamView | None:
        return self._beam

    def tokens(self) -> int | None:
        return len(self.token_ids)

    def ahead(self) -> int | None:
        """Requests ahead of this one in the engine's queue (``None`` once it runs)."""
        return self._table.position(self.rid)

    def cancel(self) -> None:
        """End the stream now; the engine frees the row at its next step."""
        if self.fail(RequestCancelledError("Request cancelled.")):
            self._table.forget(self.rid, cancel=True)


class StreamTable:
    """rid -> handle, and the Steps applied to them; thread-safe (opened and cancelled from callers' threads,
    applied from the engine's or the pipe reader's)."""

    def __init__(self, cancel: Callable[[int], None]) -> None:
        self._cancel = cancel  # tells the engine a client gave up
        self._streams: dict[int, EngineStream] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._positions: dict[int, int] = {}
        self.stats: EngineStats | None = None  # the engine's latest report
        self.listeners: list[Listener] = []
        self.steps_applied = 0

    def __len__(self) -> int:
        return len(self._streams)

    def open(self) -> EngineStream:
        stream = EngineStream(next(self._ids), self)
        stream.add_done_callback(self._on_done)
        with self._lock:
            self._streams[stream.rid] = stream
        return stream

    def forget(self, rid: int, cancel: bool = False) -> None:
        """Stop routing to ``rid`` (refused at the door, or cancelled: then the engine is told)."""
        with self._lock:
            self._streams.pop(rid, None)
        if cancel:
            try:
                self._cancel(rid)
            except Exception:  # noqa: BLE001 - the engine may be gone; its rows went with it
                log.debug("could not pass on a cancel", exc_info=True)

    def position(self, rid: int) -> int | None:
        return self._positions.get(rid)

    def apply(self, step: Step) -> None:
        """One engine step's news, in order: views and token ids before the text they go with, then ends."""
        with self._lock:
            streams = self._streams
            for rid, view in step.beams:
                stream = streams.get(rid)
                if stream is not None:
                    stream._beam = view
            for rid, total, new in step.tokens:
                stream = streams.get(rid)
                if stream is not None:  # ``total`` counts from the start: a retried row starts over
                    del stream.token_ids[max(0, total - len(new)) :]
                    stream.token_ids.extend(new)
            for rid, text in step.text:
                stream = streams.get(rid)
                if stream is not None:
                    stream._send(text)
            ended = [(streams.pop(e.rid, None), e) for e in step.ended]
            if step.stats is not None:
                self._positions = {rid: i for i, rid in enumerate(step.waiting or [])}
                self.stats = step.stats
            self.steps_applied += 1
        for stream, end in ended:
            if stream is not None:
                stream._end(end.result, end.error)
        for size in step.batch_sizes:
            for listener in self.listeners:
                try:
                    listener.on_batch(size)
                except Exception:  # a broken metric must not break serving
                    log.exception("listener %r failed in on_batch", listener)

    def fail_all(self, error: DemoError) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.fail(error)

    def _on_done(self, stream: Stream) -> None:
        for listener in self.listeners:
            try:
                listener.on_request_done(stream)
            except Exception:  # a broken metric must not break serving
                log.exception("listener %r failed in on_request_done", listener)
