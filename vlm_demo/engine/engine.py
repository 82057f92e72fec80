"""The engine: validates requests at the door, queues them, and runs batches on one worker thread.

Failure isolation lives here. If a batch raises (CUDA out of memory, a kernel error), it is split in
halves and each half retried, down to single requests; only a request that fails on its own gets an
error, and the worker thread carries on with the next batch. The retry runs only after the failed
attempt's memory is released (see :func:`release`): one out-of-memory batch must not make every
retry fail too.
"""

from __future__ import annotations

import gc
import logging
import threading
import traceback
from typing import Any, Protocol

import torch

from vlm_demo.config import Config
from vlm_demo.engine.memory import plan_for
from vlm_demo.engine.request import GenerationResult, Request, ValidRequest
from vlm_demo.engine.scheduler import Scheduler
from vlm_demo.engine.worker import Worker
from vlm_demo.errors import (
    DemoError,
    EngineStoppedError,
    GenerationError,
    InvalidRequestError,
    OutOfMemoryError,
)
from vlm_demo.schema import STAGE_BEAM
from vlm_demo.stream import run_all

log = logging.getLogger(__name__)


class Listener(Protocol):
    """Observes the engine (metrics); called from the engine thread, must not block."""

    def on_batch(self, size: int) -> None: ...

    def on_request_done(self, request: Request) -> None: ...


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def release(exc: BaseException) -> None:
    """Free what a failed attempt still holds before anything is retried.

    An exception's traceback keeps every frame it passed through alive, and with them their locals:
    for a failed ``generate`` that is the whole KV cache and the activations. Retrying inside the
    ``except`` block (or while the exception is kept) runs the retry next to all of it, so one
    out-of-memory batch cascades. Here the frames are cleared (chained exceptions too), the garbage
    collected and the allocator's cached blocks returned; the message stays for the error.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        current = current.__cause__ or current.__context__
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def error_for(exc: Exception) -> DemoError:
    """The user-facing error for a request that failed on its own."""
    if is_out_of_memory(exc):
        return OutOfMemoryError(
            "The GPU ran out of memory for this request, even on its own. "
            "Try a smaller max_new_tokens or a smaller image."
        )
    return GenerationError(f"Generation failed: {type(exc).__name__}: {exc}")


class Engine:
    """Dynamic batching over one :class:`Worker`. Thread-safe ``submit``; one engine thread."""

    supports_stage_beam = False  # forking candidates out of a running batch needs continuous batching

    def __init__(self, worker: Worker, config: Config | None = None) -> None:
        self.worker = worker
        self.config = config or Config()
        self.memory = plan_for(worker, self.config)  # in the engine process, after the weights are loaded
        self.max_batch_size = self.memory.max_batch_size
        self.scheduler = Scheduler(self.max_batch_size, self.config.batch_window_ms / 1000.0, self.config.max_queue)
        self.listeners: list[Listener] = []
        self.running: list[Request] = []
        self.batches_run = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vlm-engine", daemon=True)
        self._thread.start()

    @staticmethod
    def create(worker: Worker, config: Config | None = None) -> Engine:
        """An engine of the configured batching kind (``config.batching``) over ``worker``."""
        config = config or Config()
        if config.batching == "continuous":
            from vlm_demo.engine.continuous import ContinuousEngine

            return ContinuousEngine(worker, config)
        if config.batching != "dynamic":
            raise ValueError(f"unknown batching mode {config.batching!r}")
        return Engine(worker, config)

    @classmethod
    def from_config(cls, config: Config) -> Engine:
        return cls.create(Worker.from_config(config), config)

    # ---- the door ----------------------------------------------------------------------------
    def make_request(self, valid: ValidRequest) -> Request:
        """Preprocess on the caller's thread; only requests that passed the door get here."""
        if not isinstance(valid, ValidRequest):
            raise TypeError(f"the engine takes a ValidRequest (vlm_demo.schema.validate_request), not {type(valid)}")
        if valid.params.reasoning == STAGE_BEAM and not self.supports_stage_beam:
            raise InvalidRequestError(
                "Stage-level beam search needs continuous batching (--batching continuous, the default)."
            )
        request = Request(image=valid.image, question=valid.question, params=valid.params)
        request.inputs = self.worker.prepare(valid.image, valid.question)
        return request

    def submit(self, valid: ValidRequest) -> Request:
        """Queue one request and return its handle (stream / result / cancel)."""
        if self._stop.is_set():
            raise EngineStoppedError("The server is shutting down; please try again shortly.")
        request = self.make_request(valid)
        request.add_done_callback(self._on_done)
        self.scheduler.add(request)
        return request

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        """Submit many at once (they batch together) and wait; errors come back in their slots."""
        return run_all(self.submit, items)

    def generate(self, valid: ValidRequest) -> GenerationResult:
        return self.submit(valid).result()

    # ---- observation -------------------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def _notify(self, method: str, *args: Any) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, method)(*args)
            except Exception:  # a broken metric must not break serving
                log.exception("listener %r failed in %s", listener, method)

    def _on_done(self, request: Request) -> None:
        self._notify("on_request_done", request)
        if request.cancelled:
            self.scheduler.wake()

    def stats(self) -> dict[str, Any]:
        return {
            "ready": self._thread.is_alive() and not self._stop.is_set(),
            "queue_depth": self.scheduler.depth,
            "running": sum(1 for r in self.running if not r.done),
            "batches_run": self.batches_run,
            "device": str(self.worker.device),
            **self.memory.stats(),
        }

    # ---- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            batch = self.scheduler.next_batch(timeout=0.5)
            if batch:
                self._execute(batch)

    def _execute(self, batch: list[Request]) -> None:
        live = [r for r in batch if not r.done]
        if not live:
            return
        self.running = live
        self.batches_run += 1
        self._notify("on_batch", len(live))
        failure: Exception | None = None
        try:
            self.worker.run(live)
        except Exception as exc:
            failure = exc  # handled below, outside the except block: see ``release``
        finally:
            self.running = []
        if failure is not None:
            self._recover(live, failure)

    def _recover(self, batch: list[Request], exc: Exception) -> None:
        """Split a failed batch and retry the halves; fail only requests that fail alone."""
        release(exc)
        unfinished = [r for r in batch if not r.done]
        if len(unfinished) > 1:
            log.warning("batch of %d failed (%s); retrying in halves", len(unfinished), exc)
            middle = len(unfinished) // 2
            self._execute(unfinished[:middle])
            self._execute(unfinished[middle:])
            return
        for request in unfinished:
            log.warning("request %d failed on its own: %r", request.request_id, exc)
            request.fail(error_for(exc))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking work, fail what is queued, let the running batch end."""
        self._stop.set()
        for request in self.scheduler.close():
            request.fail(EngineStoppedError("The server shut down before this request ran."))
        for request in list(self.running):
            request.cancel()
        self._thread.join(timeout)
