"""The local engine in a process of its own, behind the :class:`~vlm_demo.backends.base.Backend` interface.

The web process keeps the page, the door and the HTTP server; the engine process
(:mod:`vlm_demo.engine.batching.process`) keeps the model. This module is the thin client and the supervisor:

- ``submit`` sends a :class:`~vlm_demo.request.ValidRequest` over a pipe and returns a handle whose
  text arrives with the engine's Step messages, applied by the same
  :class:`~vlm_demo.engine.ipc.handles.StreamTable` an in-process engine uses; ``cancel`` ends the handle
  at once and tells the engine, which drops the row at its next step.
- One thread reads the pipe and watches the process. If the engine process dies (out-of-memory kill,
  segfault), every request in flight fails at once with a clear error, ``health()`` turns not-ready,
  and a new engine process is started; the server keeps serving meanwhile.
- Stopping is this side's: the engine process ignores the SIGTERM and SIGINT a stop sends to the whole group
  (:mod:`vlm_demo.engine.batching.process`) and ends when :meth:`close` says so; a stop while it is still loading
  (``stopping`` set) ends the load.

Nothing here imports torch: the web process stays light and starts fast.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from vlm_demo.backends.base import Features, Health
from vlm_demo.config import Config
from vlm_demo.engine.ipc.handles import EngineStream, StreamTable
from vlm_demo.engine.ipc.messages import (
    ENGINE_FAILED,
    STOP_SIGNALS,
    Cancel,
    Fatal,
    Loading,
    Ready,
    Shutdown,
    Step,
    Submit,
)
from vlm_demo.errors import BackendUnavailableError, DemoError, EngineStoppedError, QueueFullError
from vlm_demo.request import ValidRequest
from vlm_demo.results import GenerationResult, LoadProgress
from vlm_demo.stream import Listener, run_all

log = logging.getLogger(__name__)

STABLE_S = 60.0  # an engine that lived this long before dying is restarted at once; sooner: back off
MAX_BACKOFF_S = 30.0


class EngineStartError(RuntimeError):
    """The engine process could not load the model (message written for the operator)."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code == ENGINE_FAILED:
        return "its engine stopped after an unrecoverable error; see the server log"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ", often the out-of-memory killer" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


OPEN: weakref.WeakSet[EngineProcessBackend] = weakref.WeakSet()  # backends whose engine process may still run


def close_open_backends() -> None:
    """At exit, stop every engine process nobody closed. It ignores SIGTERM (a stop of the group is the web
    process's to carry out), so multiprocessing's own exit hook, which sends SIGTERM and then waits for it, would
    wait for ever. Registered after that hook, so it runs first."""
    for backend in list(OPEN):
        backend.close()


atexit.register(close_open_backends)


class EngineProcessBackend:
    """Starts, feeds and supervises the engine process."""

    name = "engine-process"
    remote = False

    def __init__(
        self,
        config: Config,
        progress: Callable[[LoadProgress], None] | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        self.config = config
        self.progress = progress  # told where the engine process's model load stands
        self.model = config.model
        self.notice: str | None = None
        self.features = Features(stage_beam=config.batching == "continuous")
        self.restarts = 0
        self.messages_received = 0  # engine steps reported (one message each)
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self.table = StreamTable(self._cancel)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = stopping or threading.Event()  # the server stops: no restart, a load in progress ends
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._started_at = 0.0
        OPEN.add(self)
        self._start()  # raises EngineStartError when the model cannot be loaded at all
        self._supervisor = threading.Thread(target=self._supervise, name="vlm-engine-supervisor", daemon=True)
        self._supervisor.start()

    @classmethod
    def from_config(
        cls,
        config: Config,
        progress: Callable[[LoadProgress], None] | None = None,
        stopping: threading.Event | None = None,
    ) -> EngineProcessBackend:
        return cls(config, progress, stopping)

    @property
    def _closing(self) -> bool:
        return self._stopping.is_set()

    # ---- Backend interface ----
    def submit(self, request: ValidRequest) -> EngineStream:
        if not isinstance(request, ValidRequest):
            raise TypeError(f"the engine takes a ValidRequest (vlm_demo.request.validate_request), not {type(request)}")
        if self._closing:
            raise EngineStoppedError("The server is shutting down; please try again shortly.")
        if not self._ready.is_set():
            raise BackendUnavailableError("The model is restarting after a failure; please try again in a minute.")
        with self._lock:
            if len(self.table) >= self.capacity:
                raise QueueFullError(
                    f"Server busy: {len(self.table)} requests are already in the engine. Please try again shortly."
                )
            stream = self.table.open()
        try:
            self._send(Submit(stream.rid, request))
        except (OSError, ValueError):
            stream.fail(EngineStoppedError("The model process is not reachable; please try again in a minute."))
        return stream

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        return run_all(self.submit, items)

    def health(self) -> Health:
        stats = self.table.stats
        alive = self._proc is not None and self._proc.is_alive()
        return Health(
            ready=self._ready.is_set() and alive and not self._closing and (stats is None or stats.ready),
            queue_depth=stats.queue_depth if stats is not None else 0,
            max_batch_size=stats.max_batch_size if stats is not None else self.config.max_batch_size,
            in_flight=len(self.table),
            engine=stats,
            engine_pid=self.pid,
            engine_restarts=self.restarts,
        )

    def add_listener(self, listener: Listener) -> None:
        self.table.listeners.append(listener)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process: it fails what is queued and ends the running rows."""
        OPEN.discard(self)
        self._stopping.set()
        self._ready.clear()
        try:
            self._send(Shutdown())
        except (OSError, ValueError):
            pass
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            log.info("engine process %d stopped (%s)", self._proc.pid, _describe_exit(self._proc.exitcode))
        self._fail_all(EngineStoppedError("The server shut down before this request finished."))

    @property
    def capacity(self) -> int:
        """Requests the engine may hold (running rows plus its queue) before new ones are refused."""
        stats = self.table.stats
        rows = stats.max_batch_size if stats is not None else self.config.max_batch_size
        return self.config.max_queue + rows

    def pids(self) -> dict[str, int]:
        """The engine process (benchmarks account its CPU time)."""
        return {"engine": self._proc.pid} if self._proc is not None and self._proc.pid is not None else {}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- the engine process ----
    def _start(self) -> None:
        """Spawn the engine process and wait until it has loaded the model (or says why it cannot)."""
        parent, child = self._ctx.Pipe()
        import vlm_demo.engine.batching.process as engine_process  # the spawn target; torch is imported only in the child

        proc = self._ctx.Process(target=engine_process.run, args=(self.config, child), name="vlm-engine", daemon=True)
        if self.progress is not None:
            self.progress(LoadProgress("starting the engine process (importing torch and transformers)"))
        # Born with the stop signals blocked (a mask is inherited), until the engine process ignores them: a stop of
        # the group in its first second, before it could, would otherwise kill it as a crash would. The resource
        # tracker first: starting it unblocks them.
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        child.close()  # the child holds its end: EOF here means it is gone
        log.info("engine process %d started; it says which model it loads", proc.pid)
        while True:
            if self._closing:  # the server stops while the model loads: the load ends here
                proc.kill()
                proc.join(10)
                log.info("the server stopped while the model loaded: engine process %d stopped", proc.pid)
                raise EngineStartError("The server stopped before the model was loaded.")
            if parent.poll(0.5):
                try:
                    message = parent.recv()
                except (EOFError, OSError):
                    message = None
                if isinstance(message, Ready):
                    break
                if isinstance(message, Loading):
                    if self.progress is not None:
                        self.progress(message.progress)
                    continue
                if isinstance(message, Fatal):
                    proc.join(10)
                    raise EngineStartError(message.message)
                if message is None:
                    proc.join(10)
                    raise EngineStartError(
                        f"The engine process stopped while loading ({_describe_exit(proc.exitcode)})."
                    )
            elif not proc.is_alive():
                raise EngineStartError(f"The engine process stopped while loading ({_describe_exit(proc.exitcode)}).")
        self.model, self.notice = message.model, message.notice
        self.table.stats = message.stats
        self._proc, self._conn, self._started_at = proc, parent, time.monotonic()
        self._ready.set()
        log.info("engine process %d ready (%s)", proc.pid, self.model)

    def _supervise(self) -> None:
        """Read the engine's messages; when it dies, fail what was in flight and start a new one."""
        while not self._closing:
            conn, proc = self._conn, self._proc
            assert conn is not None and proc is not None
            ready = wait([conn, proc.sentinel], timeout=1.0)
            if conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = None
                if message is not None:
                    self._dispatch(message)
                    continue
            if proc.is_alive() and conn not in ready:
                continue
            proc.join(5)
            if self._closing:
                return
            self._on_death(proc.exitcode)
            self._restart()

    def _on_death(self, exitcode: int | None) -> None:
        self._ready.clear()
        how = _describe_exit(exitcode)
        log.error("engine process died (%s); failing %d request(s) in flight and restarting", how, len(self.table))
        self._fail_all(
            EngineStoppedError(
                f"The model process stopped unexpectedly ({how}); this answer was lost. "
                "The server is restarting it: please try again in a minute."
            )
        )

    def _restart(self) -> None:
        attempt = 0
        while not self._closing:
            crashed_early = time.monotonic() - self._started_at < STABLE_S
            delay = min(MAX_BACKOFF_S, 2.0**attempt) if (attempt or crashed_early) and self.restarts else 0.0
            if delay:
                log.warning("restarting the engine process in %.0f s", delay)
                time.sleep(delay)
            self.restarts += 1
            try:
                self._start()
                return
            except EngineStartError as err:
                log.error("engine restart failed: %s", err)
                attempt += 1

    def _dispatch(self, message: object) -> None:
        if isinstance(message, Step):
            self.messages_received += 1
            self.table.apply(message)

    def _send(self, message: object) -> None:
        conn = self._conn
        if conn is None:
            raise OSError("no engine process")
        with self._send_lock:
            conn.send(message)

    def _cancel(self, rid: int) -> None:
        try:
            self._send(Cancel(rid))
        except (OSError, ValueError):
            pass  # the engine is gone; its rows went with it

    def _fail_all(self, error: DemoError) -> None:
        self.table.fail_all(error)
