"""The engine process: scheduler, worker and streamer in a process of their own, fed over a pipe.

The web layer (Gradio's event loop, page updates, HTTP) and the engine's step loop both need the
interpreter; in one process they share one GIL and the web layer's work directly delays every
decoding step (measured: 0.42× of the engine's own throughput through the page). Here the engine
gets its own interpreter. The web process (:mod:`vlm_demo.backends.engine_client`) sends requests that
already passed the door; this side preprocesses them, runs them, and publishes one
:class:`~vlm_demo.engine.ipc.Step` per engine step with every row's new text.

Threads: the main thread receives (submit / cancel / shutdown), the engine thread steps the model,
and a publisher thread wakes at each step boundary (the engine's ``on_batch`` listener call) to send
what the rows produced. The engine thread never blocks on the pipe.

If the engine thread dies (a sticky CUDA error), the requests it held have already failed with a clear
error; this process sends that last step and exits with :data:`ENGINE_FAILED`, and the web process's
supervisor starts a fresh one (a broken CUDA context cannot be repaired inside its process).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from vlm_demo.config import Config
from vlm_demo.engine.ipc import ENGINE_FAILED, Cancel, Ended, Fatal, Loading, Ready, Shutdown, Step, Submit
from vlm_demo.errors import DemoError, GenerationError
from vlm_demo.results import BeamView, EngineStats, LoadProgress
from vlm_demo.stream import Stream

if TYPE_CHECKING:  # the engine (and torch) load in ``run``, inside the engine process
    from vlm_demo.engine.base import Engine
    from vlm_demo.engine.request import Request

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # stats reach the web process at least this often (for /health and /metrics)


class EngineCore:
    """Bridges one :class:`~vlm_demo.engine.Engine` to the pipe."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.live: dict[int, Request] = {}  # rid -> engine Request
        self.rid_of: dict[int, int] = {}  # engine request_id -> rid (for queue positions)
        self.pending: list[Ended] = []  # refused at submit: reported with the next step
        self.views: dict[int, BeamView | None] = {}  # rid -> the stage-beam view last sent
        self.batch_sizes: list[int] = []
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.wake = threading.Event()
        self.running = True
        engine.add_listener(self)

    # ---- engine listener (called on the engine thread: must not block) ----
    def on_batch(self, size: int) -> None:
        with self.lock:
            self.batch_sizes.append(size)
        self.wake.set()

    def on_request_done(self, request: Stream) -> None:
        self.wake.set()

    # ---- receiving ----
    def receive_loop(self) -> None:
        """Serve the web process's messages until it says stop or goes away."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                log.warning("web process went away; stopping the engine")
                return
            if isinstance(message, Submit):
                self.submit(message)
            elif isinstance(message, Cancel):
                with self.lock:
                    request = self.live.get(message.rid)
                if request is not None:
                    request.cancel()
            elif isinstance(message, Shutdown):
                return

    def submit(self, message: Submit) -> None:
        try:
            request = self.engine.submit(message.request)
        except DemoError as err:
            ended = Ended(message.rid, None, err)
        except Exception as err:  # noqa: BLE001 - one bad request must not stop the engine process
            log.exception("submit failed")
            ended = Ended(message.rid, None, GenerationError(f"Could not start this request: {err}"))
        else:
            with self.lock:
                self.live[message.rid] = request
                self.rid_of[request.request_id] = message.rid
            return
        with self.lock:
            self.pending.append(ended)
        self.wake.set()

    # ---- publishing ----
    def publish_loop(self) -> None:
        while self.running:
            self.wake.wait(HEARTBEAT_S)
            self.wake.clear()
            step = self.collect()
            try:
                with self.send_lock:
                    self.conn.send(step)
            except (BrokenPipeError, EOFError, OSError):
                return

    def collect(self) -> Step:
        """Every live row's text since the last message, then the rows that ended, then stats."""
        with self.lock:
            step = Step(ended=self.pending, batch_sizes=self.batch_sizes)
            self.pending, self.batch_sizes = [], []
            live = list(self.live.items())
        finished = []
        for rid, request in live:
            text, ended, error = "", False, None
            try:
                text, ended = request.drain()
                if not ended and request.done:  # ended with an error after this text
                    more, ended = request.drain()
                    text += more
            except DemoError as err:
                error = err
            if request.beam is not None:
                view = request.beam_view()
                if view != self.views.get(rid):
                    self.views[rid] = view
                    step.beams.append((rid, view))
            if text:
                step.text.append((rid, text))
                step.tokens.append((rid, len(request.token_ids)))
            if ended or error is not None:
                step.ended.append(Ended(rid, None if error else request.result(0), error))
                finished.append((rid, request.request_id))
        with self.lock:
            for rid, request_id in finished:
                self.live.pop(rid, None)
                self.rid_of.pop(request_id, None)
                self.views.pop(rid, None)
        step.stats, step.waiting = self.stats(), self.waiting()
        return step

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def waiting(self) -> list[int]:
        """The waiting requests' rids, in queue order (for each visitor's "N ahead of you")."""
        queue = list(self.engine.scheduler.waiting)  # a C-level copy: safe against the engine thread
        with self.lock:
            return [self.rid_of[r.request_id] for r in queue if r.request_id in self.rid_of]

    def close(self) -> None:
        self.running = False
        self.engine.shutdown()
        self.wake.set()

    def exit_on_fatal(self, exc: BaseException) -> None:
        """The engine thread died: send what ended (every request it held failed with the reason), then
        exit, so the supervisor starts a fresh process instead of a server that looks alive and never answers."""
        try:
            step = self.collect()
            with self.send_lock:
                self.conn.send(step)
        except Exception:  # noqa: BLE001 - exiting matters more than the last message
            log.exception("could not send the last step")
        finally:
            logging.shutdown()
            os._exit(ENGINE_FAILED)


def run(config: Config, conn: Connection) -> None:
    """Entry point of the engine process (a ``spawn`` target): load, say ready, serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole group: the web process decides
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        from vlm_demo.engine import make_engine
        from vlm_demo.models.choice import choose_model

        def progress(update: LoadProgress) -> None:
            try:
                conn.send(Loading(update))
            except (BrokenPipeError, OSError):  # the web process went away: the load ends with it
                pass

        config, notice = choose_model(config)
        engine = make_engine(config, progress=progress)
    except DemoError as err:
        conn.send(Fatal(str(err)))
        return
    except Exception as err:  # noqa: BLE001 - reported to the operator in one line by the web process
        log.exception("engine failed to start")
        conn.send(Fatal(f"The model could not be loaded: {type(err).__name__}: {err}"))
        return
    core = EngineCore(engine, conn)
    engine.on_fatal = core.exit_on_fatal
    if engine.fatal:  # it died before the hook was in place
        core.exit_on_fatal(RuntimeError(engine.fatal))
    conn.send(Ready(config.model, notice, core.stats()))
    publisher = threading.Thread(target=core.publish_loop, name="vlm-engine-publish", daemon=True)
    publisher.start()
    try:
        core.receive_loop()
    finally:
        core.close()
        publisher.join(2.0)
