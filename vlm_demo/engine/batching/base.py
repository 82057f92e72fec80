"""What every engine shares: the door, the Step it reports, the failure helpers and the engine thread's life.

An engine owns one :class:`~vlm_demo.engine.executor.worker.Worker`. The two batching modes are siblings built on
this base (:mod:`~vlm_demo.engine.batching.dynamic`, :mod:`~vlm_demo.engine.batching.continuous`);
:func:`vlm_demo.engine.make_engine` picks one. ``add_request`` queues a request under the client's id
(its ``rid``); ``step()`` runs the engine one step and returns a :class:`~vlm_demo.engine.ipc.messages.Step`
with what every client's request did. Tests call ``step()`` directly; :meth:`Engine.start` starts a
thread that loops it and hands the Steps to ``sink`` — by default this process's
:class:`~vlm_demo.engine.ipc.handles.StreamTable`, whose handles ``submit`` returns; the engine process
sends them down its pipe instead. The thread hands them over merged, at most every ``--stream-every-ms``
(a request's first words, its end and an idle engine at once): each hand-over wakes every client with news,
and a client in the engine's process takes the interpreter from the engine to read it.

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
import time
import traceback
from collections.abc import Callable
from typing import ClassVar

import torch

from vlm_demo.config import Config
from vlm_demo.engine.batching.faults import from_env as failpoints_from_env
from vlm_demo.engine.batching.job import Request, make_request
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.ipc.handles import EngineStream, StreamTable
from vlm_demo.engine.ipc.messages import Ended, Step, StepBuffer
from vlm_demo.engine.kv.memory import MemoryPlan, plan_for
from vlm_demo.engine.scheduling.scheduler import Scheduler
from vlm_demo.engine.weights.quantize import weights_label
from vlm_demo.errors import (
    DemoError,
    EngineStoppedError,
    GenerationError,
    OutOfMemoryError,
    UnsupportedError,
)
from vlm_demo.request import STAGE_BEAM, ValidRequest
from vlm_demo.results import EngineStats, GenerationResult
from vlm_demo.stream import Listener, run_all

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.1  # a Step carries the engine's stats this often, or when the queue changed or a request ended


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
    """The base of both batching modes: thread-safe ``add_request``/``cancel``, ``step`` on one thread."""

    batching: ClassVar[str] = ""
    supports_stage_beam: ClassVar[bool] = False  # forking candidates out of a running batch needs continuous batching

    def __init__(self, worker: Worker, config: Config | None = None, working_per_row: int = 0) -> None:
        self.worker = worker
        self.config = config or Config(batching=self.batching)
        worker.vision_tiles = self.config.vision_tiles
        # in the engine process, after the weights load (``working_per_row``: the decode attention's, per row)
        self.memory: MemoryPlan = plan_for(worker, self.config, working_per_row)
        self.max_batch_size = self.memory.max_batch_size
        self.weights = weights_label(worker.model)  # "fp8", "int8", "int4" or the dtype: /health, /metrics, the page
        self.stream_every_s = self.config.stream_every_ms / 1000.0
        self.scheduler = Scheduler(self.max_batch_size, self.config.batch_window_ms / 1000.0, self.config.max_queue)
        if self.config.structured_stages:
            _ = worker.grammar  # every token's text, built now (~0.5 s at 128k tokens) rather than at the first answer
        self.table = StreamTable(self.cancel)  # this process's clients (``submit``)
        self.sink: Callable[[Step], None] = self.table.apply  # where the thread's Steps go
        self.live: dict[int, Request] = {}  # rid -> its request, from the door until its end is reported
        self.outbox: list[Request] = []  # requests with news since the last Step (appended from any thread)
        self._reported = (-1, 0.0)  # the queue's change count and the time of the last Step with stats
        self._held = StepBuffer()  # Steps not handed to ``sink`` yet
        self._handed = 0.0  # when ``sink`` was last handed Steps
        self._urgent = False  # the held Steps end a request or bring its first words
        self.batches_run = 0
        self.failpoint: Callable[[str], None] | None = failpoints_from_env()  # fault drills only; see faults.py
        self.on_fatal: Callable[[BaseException], None] | None = None  # called once the engine thread died
        self.fatal: str | None = None  # why the engine thread stopped, once it did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Engine:
        """Start the engine thread (once); returns the engine, so ``make_engine`` can build and start in one go."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"vlm-engine-{self.batching}", daemon=True)
            self._thread.start()
        return self

    def step(self) -> Step:
        """Run one step (waiting a little when there is nothing to do); what the clients' requests did."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                step = self.step()
                if step or self._held:
                    self._hand_over(step)
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
        self._end_everything(error, error)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _end_everything(self, queued: DemoError, running: DemoError) -> None:
        """Fail what is queued and running, and report it (the last Step)."""
        for request in self.scheduler.close():
            request.fail(queued)
        self._abandon_running(running)
        for request in list(self.live.values()):
            request.fail(running)
        self._hand_over(self.collect(Step()), now=True)

    def _hand_over(self, step: Step, now: bool = False) -> None:
        """Give ``sink`` this Step with the ones held back, merged: at once when they end a request or bring its
        first words, or nothing runs; else once ``--stream-every-ms`` passed since the last hand-over (clients
        then get a few tokens at a time, and wake up a few times less)."""
        self._held.add(step)
        clock = time.monotonic()
        if now or self._urgent or clock - self._handed >= self.stream_every_s or not self.running_rows():
            held = self._held.take()
            assert held is not None
            self._urgent, self._handed = False, clock
            self.sink(held)

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

    def add_request(self, valid: ValidRequest, rid: int) -> None:
        """Queue one request under the client's id ``rid`` (raises a ``DemoError`` when it is refused)."""
        if self._stop.is_set():
            if self.fatal:
                raise EngineStoppedError(f"The model engine stopped after {self.fatal}; please try again shortly.")
            raise EngineStoppedError("The server is shutting down; please try again shortly.")
        request = self.make_request(valid)
        request.rid, request.outbox = rid, self.outbox
        self.live[rid] = request
        try:
            self.scheduler.add(request)
        except DemoError:
            self.live.pop(rid, None)
            raise

    def cancel(self, rid: int) -> None:
        """The client gave up (any thread): the request ends now, its row leaves at the next step."""
        request = self.live.get(rid)
        if request is not None:
            request.cancel()
            self.scheduler.wake()

    def submit(self, valid: ValidRequest) -> EngineStream:
        """Queue one request and return its handle in this process (stream / result / cancel)."""
        stream = self.table.open()
        try:
            self.add_request(valid, stream.rid)
        except BaseException:
            self.table.forget(stream.rid)
            raise
        return stream

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        """Submit many at once (they batch together) and wait; errors come back in their slots."""
        return run_all(self.submit, items)

    def generate(self, valid: ValidRequest) -> GenerationResult:
        return self.submit(valid).result()

    # ---- the Step ----------------------------------------------------------------------------
    def collect(self, step: Step) -> Step:
        """Add what the clients' requests did since the last Step: new token ids and text, ends, queue, stats."""
        box = self.outbox[:]
        del self.outbox[: len(box)]
        for request in box:
            request.reported = False
            rid = request.rid
            if rid is None or rid not in self.live:
                continue
            ids = request.token_ids
            if len(ids) != request.sent_tokens:
                new = ids[request.sent_tokens :] if len(ids) > request.sent_tokens else list(ids)
                step.tokens.append((rid, len(ids), new))
                request.sent_tokens = len(ids)
            if len(request.text) > request.sent_chars:
                self._urgent |= request.sent_chars == 0  # its first words: time to first token is not held back
                step.text.append((rid, request.text[request.sent_chars :]))
                request.sent_chars = len(request.text)
            if request.done:
                self._urgent = True
                del self.live[rid]
                step.ended.append(Ended(rid, request.result, request.error))
        changes, now = self.scheduler.waiting.changes, time.monotonic()
        if step.ended or changes != self._reported[0] or now - self._reported[1] >= STATS_EVERY_S:
            self._reported = (changes, now)  # stats cost more than a step's text: not on every token
            step.stats = self.stats()
            step.waiting = [r.rid for r in self.scheduler.snapshot() if r.rid is not None]
        return step

    # ---- observation -------------------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        self.table.listeners.append(listener)

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
            kv_bytes_per_tile=plan.kv.bytes_per_tile,
            memory_plan=plan.source,
            weights=self.weights,
            vision_encodes=self.worker.vision_encodes,
            vision_tiles=self.worker.vision_tiles_run,
        )

    # ---- the end -------------------------------------------------------------------------------
    def _abandon_running(self, error: DemoError) -> None:
        """End what the engine thread holds with ``error`` (shutdown, a dead engine); each mode knows its own."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking work, fail what is queued, end the running batch."""
        self._stop.set()
        self.scheduler.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._end_everything(
            EngineStoppedError("The server shut down before this request ran."),
            EngineStoppedError("The server shut down before this request finished."),
        )
