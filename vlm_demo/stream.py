"""The handle every backend returns: text deltas from a producer thread, then one result or one error.

:class:`Stream` is the contract the web layer, the metrics and the benchmark read: iterate ``stream()``
(or poll ``drain()``), then ``result()``, and ``cancel()`` from any thread at any time. The engine's
``EngineStream`` (in this process or the engine process's, :mod:`vlm_demo.engine.ipc.handles`), the Triton
backend's ``TritonStream`` and the response cache's ``Replay`` all build on :class:`OutputStream`, which
implements it once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from vlm_demo.errors import BackendTimeoutError, DemoError, RequestCancelledError
from vlm_demo.request import ValidRequest
from vlm_demo.results import BeamView, GenerationResult

log = logging.getLogger(__name__)

_END = object()


class Stream(Protocol):
    """A running request: text deltas, then a final result or a typed error; cancellable from any thread."""

    @property
    def done(self) -> bool: ...

    @property
    def error(self) -> DemoError | None:
        """The typed error it ended with (``None`` while running or when it succeeded)."""
        ...

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length" or "cancelled" once finished, the error's code once failed, else ``None``."""
        ...

    def stream(self, timeout: float | None = None) -> Iterator[str]: ...

    def drain(self) -> tuple[str, bool]:
        """Text that arrived so far without waiting, and whether the stream ended (raises its error)."""
        ...

    def add_done_callback(self, fn: Callable[[Stream], None]) -> None: ...

    def add_text_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` from the producer's thread each time new text arrives (it must not block): a reader
        that wants each piece as soon as it exists is woken instead of polling."""
        ...

    def result(self, timeout: float | None = None) -> GenerationResult: ...

    def cancel(self) -> None: ...

    def beam_view(self) -> BeamView | None:
        """Where its stage-beam search stands; ``None`` in the normal mode."""
        ...

    def ahead(self) -> int | None:
        """Requests ahead of it in the queue; ``None`` once it runs or where nobody knows (a remote)."""
        ...

    def tokens(self) -> int | None:
        """Tokens of the answer written so far (the page's live counter); ``None`` where nobody knows."""
        ...


class Listener(Protocol):
    """Observes a backend or an engine (metrics, the engine process); called from their threads, must not block."""

    def on_batch(self, size: int) -> None: ...

    def on_request_done(self, request: Stream) -> None: ...


class OutputStream:
    """A thread-safe queue of deltas with exactly one ending (``_end``), however producers race."""

    def __init__(self) -> None:
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._result: GenerationResult | None = None
        self._error: DemoError | None = None
        self._callbacks: list[Callable[[Stream], None]] = []
        self._text_callbacks: list[Callable[[], None]] = []
        self._finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> DemoError | None:
        return self._error

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    def beam_view(self) -> BeamView | None:
        """Where a stage-beam search stands (candidates, judged winners); ``None`` when not searching."""
        return None

    def ahead(self) -> int | None:
        """Requests ahead of this one in the queue (``None``: running, or not known here)."""
        return None

    def tokens(self) -> int | None:
        """Tokens of the answer written so far (``None``: not known here)."""
        return None

    def cancel(self) -> None:
        """Stop it now (producers that can stop remote work override this)."""
        self.fail(RequestCancelledError("Request cancelled."))

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Yield text deltas as they come; raise the request's typed error if it failed.

        ``timeout`` bounds the wait for each next event, so a caller never hangs forever.
        """
        while True:
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"No output within {timeout} s.") from None
            if item is _END:
                self._events.put(_END)  # later readers end too
                if self._error is not None:
                    raise self._error
                return
            yield item

    def drain(self) -> tuple[str, bool]:
        """Everything that arrived so far, without waiting: ``(text, ended)``.

        For readers that poll on their own schedule (the page's async handlers coalesce a visitor's
        updates this way, with no thread per stream). Raises the request's typed error once ended.
        """
        pieces: list[str] = []
        while True:
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                return "".join(pieces), False
            if item is _END:
                self._events.put(_END)
                if self._error is not None and not pieces:
                    raise self._error
                return "".join(pieces), self._error is None
            pieces.append(item)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until finished; return the result or raise the request's typed error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"Request did not finish within {timeout} s.")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def add_done_callback(self, fn: Callable[[Stream], None]) -> None:
        """Call ``fn(self)`` once when the stream ends, whichever way (now, if it already has)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def add_text_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` each time a delta arrives (from the producer's thread; exceptions are logged)."""
        self._text_callbacks.append(fn)

    def fail(self, error: DemoError) -> bool:
        """End with an error (no-op if already ended); True if this call ended it."""
        return self._end(None, error)

    def _send(self, delta: str) -> None:
        if delta and not self._done.is_set():
            self._events.put(delta)
            for fn in self._text_callbacks:
                try:
                    fn()
                except Exception:  # a reader's wake-up must never break the producer
                    log.exception("text-callback %r failed", fn)

    def _end(self, result: GenerationResult | None, error: DemoError | None) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._result, self._error = result, error
            self._finish_reason = result.finish_reason if result is not None else error.code  # type: ignore[union-attr]
            self._done.set()
        self._events.put(_END)
        for fn in self._callbacks:
            try:
                fn(self)
            except Exception:  # a metrics listener must never break a request
                log.exception("done-callback %r failed", fn)
        return True


class Listeners:
    """The observers of one backend or engine, called in turn; one that fails is logged and the rest still
    hear (a broken metric must never break serving). Itself a :class:`Listener`."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def add(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def on_batch(self, size: int) -> None:
        for listener in self._listeners:
            try:
                listener.on_batch(size)
            except Exception:
                log.exception("listener %r failed in on_batch", listener)

    def on_request_done(self, request: Stream) -> None:
        for listener in self._listeners:
            try:
                listener.on_request_done(request)
            except Exception:
                log.exception("listener %r failed in on_request_done", listener)


def run_all(
    submit: Callable[[ValidRequest], Stream], items: list[ValidRequest], timeout: float | None = None
) -> list[GenerationResult | DemoError]:
    """Submit every item before waiting on any (so they can share batches); each failure stays in its slot."""
    handles: list[Stream | DemoError] = []
    for item in items:
        try:
            handles.append(submit(item))
        except DemoError as exc:
            handles.append(exc)
    results: list[GenerationResult | DemoError] = []
    for handle in handles:
        if isinstance(handle, DemoError):
            results.append(handle)
            continue
        try:
            results.append(handle.result(timeout))
        except DemoError as exc:
            results.append(exc)
        except TimeoutError:
            handle.cancel()
            results.append(BackendTimeoutError(f"No answer within {timeout:g} s."))
    return results
