"""The engine process: scheduler, worker and streamer in a process of their own, fed over a pipe.

The web layer (Gradio's event loop, page updates, HTTP) and the engine's step loop both need the
interpreter; in one process they share one GIL and the web layer's work directly delays every
decoding step (measured: 0.42× of the engine's own throughput through the page). Here the engine
gets its own interpreter. The web process (:mod:`vlm_demo.backends.engine_client`) sends requests that
already passed the door; this side preprocesses them, runs them, and publishes one
:class:`~vlm_demo.engine.ipc.messages.Step` per engine step with every row's new text.

Threads: the main thread receives (submit / cancel / shutdown), a preparing thread turns submitted
pictures into the model's inputs (so a Cancel never waits behind a picture being tiled), the engine
thread loops ``step()`` and hands each Step to the publisher, which merges them while the pipe is busy
and sends them. The engine thread never blocks on the pipe.

If the engine thread dies (a sticky CUDA error), the requests it held have already failed with a clear
error; this process sends that last step and exits with :data:`ENGINE_FAILED`, and the web process's
supervisor starts a fresh one (a broken CUDA context cannot be repaired inside its process).

Stopping belongs to the web process. A stop reaches the whole process group (Ctrl+C's SIGINT; the SIGTERM of
``timeout``, systemd or a container runtime), this process included: both are ignored here, the web process
stops its server and then tells this one (``Shutdown``). Died of the SIGTERM instead, this process would look like
a crash to the supervisor, which would start a new engine that outlives the server. If the web process itself
goes away (killed), this one follows it at once, even while it is still loading.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from vlm_demo import logs
from vlm_demo.config import Config
from vlm_demo.engine.ipc.messages import (
    ENGINE_FAILED,
    STOP_SIGNALS,
    Cancel,
    Ended,
    Fatal,
    Loading,
    Ready,
    Shutdown,
    Step,
    StepBuffer,
    Submit,
)
from vlm_demo.errors import DemoError, GenerationError
from vlm_demo.results import EngineStats, LoadProgress

if TYPE_CHECKING:  # the engine (and torch) load in ``run``, inside the engine process
    from vlm_demo.engine.batching.base import Engine

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # stats reach the web process at least this often (for /health and /metrics)
PARENT_CHECK_S = 1.0  # how often a process the web process started checks that it is still there


class EngineCore:
    """Bridges one :class:`~vlm_demo.engine.Engine` to the pipe."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.pending = StepBuffer()  # Steps not sent yet (guarded by ``lock``)
        self.cancelled: set[int] = set()  # rids cancelled while their picture was being prepared
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.wake = threading.Event()
        self.running = True
        self.preparing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-prepare")
        engine.sink = self.publish

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
                self.preparing.submit(self.submit, message)
            elif isinstance(message, Cancel):
                with self.lock:
                    self.cancelled.add(message.rid)
                self.engine.cancel(message.rid)
            elif isinstance(message, Shutdown):
                return

    def submit(self, message: Submit) -> None:
        """On the preparing thread: the picture into the model's inputs, then into the engine's queue."""
        with self.lock:
            if message.rid in self.cancelled:
                self.cancelled.discard(message.rid)
                return
        try:
            self.engine.add_request(message.request, message.rid)
        except DemoError as err:
            self.publish(Step(ended=[Ended(message.rid, None, err)]))
        except Exception as err:  # noqa: BLE001 - one bad request must not stop the engine process
            log.exception("submit failed")
            error = GenerationError(f"Could not start this request: {err}")
            self.publish(Step(ended=[Ended(message.rid, None, error)]))
        with self.lock:
            late = message.rid in self.cancelled
            self.cancelled.discard(message.rid)
        if late:  # cancelled while it was being added
            self.engine.cancel(message.rid)

    # ---- publishing ----
    def publish(self, step: Step) -> None:
        """The engine thread's sink: never blocks (merged into what waits to be sent)."""
        with self.lock:
            self.pending.add(step)
        self.wake.set()

    def publish_loop(self) -> None:
        while self.running:
            self.wake.wait(HEARTBEAT_S)
            self.wake.clear()
            if not self.flush():
                return

    def flush(self) -> bool:
        """Send what is pending; False once the pipe is gone."""
        with self.lock:
            step = self.pending.take()
        if step is None:
            return True
        try:
            with self.send_lock:
                self.conn.send(step)
        except (BrokenPipeError, EOFError, OSError):
            return False
        return True

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        self.running = False
        self.preparing.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()
        self.wake.set()
        self.flush()

    def exit_on_fatal(self, exc: BaseException) -> None:
        """The engine thread died: send what ended (every request it held failed with the reason), then
        exit, so the supervisor starts a fresh process instead of a server that looks alive and never answers."""
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - exiting matters more than the last message
            log.exception("could not send the last step")
        finally:
            logging.shutdown()
            os._exit(ENGINE_FAILED)


def follow_the_web_process(what: str = "engine") -> None:
    """End this process as soon as the web process that started it is gone (killed, or ended without stopping
    it): orphaned, it would hold its memory (and a GPU) for nobody. Also for ZeroGPU's GPU workers, forked by the
    web process, which otherwise wait for their next call for ever. The web process is this one's parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        log.warning("web process %d went away; stopping the %s (process %d)", parent, what, os.getpid())
        logging.shutdown()
        os._exit(0)

    threading.Thread(target=watch, name="vlm-follow-parent", daemon=True).start()


def run(config: Config, conn: Connection) -> None:
    """Entry point of the engine process (a ``spawn`` target): load, say ready, serve until told to stop."""
    for signum in STOP_SIGNALS:  # a stop of the whole group: the web process decides
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked since birth; one that came meanwhile is dropped
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    follow_the_web_process()
    import transformers  # noqa: F401 - loading needs it; importing it gives huggingface_hub's logger a handler, taken off now

    logs.quiet_hub_retries()
    logs.quiet_torchao_without_triton()
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
        say(conn, Fatal(str(err)))
        return
    except Exception as err:  # noqa: BLE001 - reported to the operator in one line by the web process
        log.exception("engine failed to start")
        say(conn, Fatal(f"The model could not be loaded: {type(err).__name__}: {err}"))
        return
    core = EngineCore(engine, conn)
    engine.on_fatal = core.exit_on_fatal
    if engine.fatal:  # it died before the hook was in place
        core.exit_on_fatal(RuntimeError(engine.fatal))
    if not say(conn, Ready(config.model, notice, core.stats())):
        engine.shutdown()
        return
    publisher = threading.Thread(target=core.publish_loop, name="vlm-engine-publish", daemon=True)
    publisher.start()
    try:
        core.receive_loop()
    finally:
        core.close()
        publisher.join(2.0)


def say(conn: Connection, message: Ready | Fatal) -> bool:
    """Send one start-up message; False (and nothing raised) when the web process has already gone."""
    try:
        conn.send(message)
    except (BrokenPipeError, OSError):
        log.info("web process went away before the engine was ready; stopping")
        return False
    return True
