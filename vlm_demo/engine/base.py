"""What every engine shares: the door, the listeners, the failure helpers and the engine thread's life.

An engine owns one :class:`~vlm_demo.engine.worker.Worker` and one engine thread. The two batching
modes are siblings built on this base (:mod:`~vlm_demo.engine.dynamic`,
:mod:`~vlm_demo.engine.continuous`); :func:`vlm_demo.engine.make_engine` picks one. Construction
only builds; :meth:`Engine.start` starts the thread, so a subclass sets its fields before anything runs.

Failure helpers live here because both modes retry the same way: a failed attempt's memory is released
(:func:`release`) before anything is retried, and a request that fails on its own gets one specific
error (:func:`error_for`). The engine thread never dies silently: whatever escapes a mode's loop (a
sticky device error, :func:`is_fatal_device_error`, or a bug) fails every queued and running request at
once with a clear error, marks the engine not ready, and calls ``on_fatal`` (the engine process exits
there, so its supervisor starts a fresh one: a CUDA context cannot be repaired in place).
"""

from __future__ import annotations

import gc
import logging
import threading
import traceback
from collections.abc import Callable
from typing import ClassVar

import torch

from vlm_demo.config import Config
from vlm_demo.engine.faults import from_env as failpoints_from_env
from vlm_demo.engine.memory import MemoryPlan, plan_for
from vlm_demo.engine.request import Request, make_request
from vlm_demo.engine.scheduler import Scheduler
from vlm_demo.engine.worker import Worker
from vlm_demo.errors import (
    DemoError,
    EngineStoppedError,
    GenerationError,
    OutOfMemoryError,
    UnsupportedError,
)
from vlm_demo.request import STAGE_BEAM, ClientSlots, ValidRequest
from vlm_demo.results import EngineStats, GenerationResult
from vlm_demo.stream import Listener, Stream, run_all

log = logging.getLogger(__name__)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


# What CUDA's own errors say; after one of these every later CUDA call in the process fails too.
STICKY_MARKERS = ("CUDA error", "CUBLAS_STATUS_", "CUDNN_STATUS_", "device-side assert", "cudaError")


def is_fatal_device_error(exc: BaseException) -> bool:
    """A device error the process cannot recover from (an illegal memory access, a device-side assert):
    retrying or splitting the batch only repeats it, so the engine stops and its process restarts."""
    if is_out_of_memory(exc):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in STICKY_MARKERS)


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
        try:
            torch.cuda.empty_cache()
        except Exception as err:  # after a sticky CUDA error every CUDA call raises; the caller decides
            log.warning("could not return cached GPU memory: %r", err)


def error_for(exc: Exception) -> DemoError:
    """The user-facing error for a request that failed on its own."""
    if is_out_of_memory(exc):
        return OutOfMemoryError(
            "The GPU ran out of memory for this request, even on its own. "
            "Try a smaller max_new_tokens or a smaller image."
        )
    return GenerationError(f"Generation failed: {type(exc).__name__}: {exc}")


class Engine:
    """The base of both batching modes: thread-safe ``submit``, one engine thread running ``_loop``."""

    batching: ClassVar[str] = ""
    supports_stage_beam: ClassVar[bool] = False  # forking candidates out of a running batch needs continuous batching

    def __init__(self, worker: Worker, config: Config | None = None) -> None:
        self.worker = worker
        self.config = config or Config(batching=self.batching)
        self.memory: MemoryPlan = plan_for(worker, self.config)  # in the engine process, after the weights load
        self.max_batch_size = self.memory.max_batch_size
        self.scheduler = Scheduler(self.max_batch_size, self.config.batch_window_ms / 1000.0, self.config.max_queue)
        if self.config.structured_stages:
            _ = worker.grammar  # every token's text, built now (~0.5 s at 128k tokens) rather than at the first answer
        self.listeners: list[Listener] = []
        self.batches_run = 0
        self.failpoint: Callable[[str], None] | None = failpoints_from_env()  # fault drills only; see faults.py
        self.on_fatal: Callable[[BaseException], None] | None = None  # called once the engine thread died
        self.fatal: str | None = None  # why the engine thread stopped, once it did
        self.clients = ClientSlots(self.config.max_per_client)  # answers waiting or running per client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Engine:
        """Start the engine thread (once); returns the engine, so ``make_engine`` can build and start in one go."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"vlm-engine-{self.batching}", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the engine thread must never end without saying so
            log.critical("the engine thread stopped: %r", exc, exc_info=exc)
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Fail everything at once with one clear error (nobody waits for a token timeout), then ``on_fatal``."""
        kind = "a GPU error the process cannot recover from" if is_fatal_device_error(exc) else "an internal error"
        self.fatal = f"{kind} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        self._stop.set()
        error = EngineStoppedError(
            f"The model engine stopped after {self.fatal}; this answer was lost. Please try again in a minute."
        )
        for request in self.scheduler.close():
            request.fail(error)
        self._abandon_running(error)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _failpoint(self, point: str) -> None:
        if self.failpoint is not None:
            self.failpoint(point)

    # ---- the door ----------------------------------------------------------------------------
    def make_request(self, valid: ValidRequest) -> Request:
        """Preprocess on the caller's thread; only requests that passed the door get here."""
        if isinstance(valid, ValidRequest) and valid.params.reasoning == STAGE_BEAM and not self.supports_stage_beam:
            raise UnsupportedError(
                "Think harder (stage-level beam search) needs continuous batching; this server runs --batching dynamic."
            )
        return make_request(valid, self.worker)

    def submit(self, valid: ValidRequest) -> Request:
        """Queue one request and return its handle (stream / result / cancel)."""
        if self._stop.is_set():
            if self.fatal:
                raise EngineStoppedError(f"The model engine stopped after {self.fatal}; please try again shortly.")
            raise EngineStoppedError("The server is shutting down; please try again shortly.")
        request = self.make_request(valid)
        self.clients.take(request.client)  # past --max-per-client: refused here, at once
        request.add_done_callback(self._on_done)
        try:
            self.scheduler.add(request)
        except DemoError:
            self.clients.give_back(request.client)
            raise
        return request

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        """Submit many at once (they batch together) and wait; errors come back in their slots."""
        return run_all(self.submit, items)

    def generate(self, valid: ValidRequest) -> GenerationResult:
        return self.submit(valid).result()

    # ---- observation -------------------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def _notify_batch(self, size: int) -> None:
        for listener in self.listeners:
            try:
                listener.on_batch(size)
            except Exception:  # a broken metric must not break serving
                log.exception("listener %r failed in on_batch", listener)

    def _on_done(self, request: Stream) -> None:
        if isinstance(request, Request):
            self.clients.give_back(request.client)
        for listener in self.listeners:
            try:
                listener.on_request_done(request)
            except Exception:
                log.exception("listener %r failed in on_request_done", listener)
        if isinstance(request, Request) and request.cancelled:
            self.scheduler.wake()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def running_rows(self) -> int:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        plan = self.memory
        return EngineStats(
            ready=self.alive,
            batching=self.batching,
            queue_depth=self.scheduler.depth,
            running=self.running_rows(),
            batches_run=self.batches_run,
            device=str(self.worker.device),
            max_batch_size=plan.max_batch_size,
            kv_budget_bytes=plan.kv_budget_bytes,
            kv_bytes_per_token=plan.kv.bytes_per_token,
            kv_bytes_per_row=plan.kv.bytes_per_row,
            memory_plan=plan.source,
            vision_encodes=self.worker.vision_encodes,
        )

    # ---- the end -------------------------------------------------------------------------------
    def _abandon_running(self, error: DemoError) -> None:
        """End what the engine thread holds with ``error`` (shutdown, a dead engine); each mode knows its own."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking work, fail what is queued, end the running batch."""
        self._stop.set()
        for request in self.scheduler.close():
            request.fail(EngineStoppedError("The server shut down before this request ran."))
        self._abandon_running(EngineStoppedError("The server shut down before this request finished."))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
