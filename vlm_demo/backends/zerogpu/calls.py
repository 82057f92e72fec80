"""What runs inside a ZeroGPU call, in the GPU worker the ``spaces`` package forked from the web process.

The worker inherits the weights the web process loaded (ZeroGPU moves them onto the worker's GPU before the
first call). On its first call it builds the engine over them; the engine lives on in the worker and serves its
next calls while the worker stays warm (one call at a time: ZeroGPU gives a concurrent call another worker).
No engine thread: the call steps the engine on its own thread, so the GPU is used only while a call runs.

A call is a generator: it yields what the engine's steps did (:class:`~vlm_demo.engine.ipc.messages.Step`: new text, ends,
stats), merged over ``--stream-every-ms``, which ``spaces`` pickles across to the web process. When the web
process ends a call early (Stop, a closed tab), ``spaces`` closes the generator at its next yield: the call's
answers are cancelled and stepped out of the batch, so the worker's next call finds the engine empty. A step
that raises ends the engine (a CUDA error repeats in every later step): the call's answers end with the reason
and the call fails, so ``spaces`` gives the next call a fresh worker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vlm_demo.config import Config
from vlm_demo.engine.ipc.messages import Ended, Step, Submit
from vlm_demo.errors import DemoError, EngineStoppedError, GenerationError

if TYPE_CHECKING:  # the engine (and torch) load in the GPU worker, on its first call
    from vlm_demo.engine.batching.base import Engine
    from vlm_demo.engine.executor.worker import Worker

log = logging.getLogger(__name__)

SETTLE_STEPS = 1000  # a call ended early steps its cancelled rows out; an engine still busy after this many is dropped


class GpuSide:
    """The weights (loaded by the web process at start-up) and the engine a GPU worker builds over them."""

    def __init__(self, config: Config, worker: Worker) -> None:
        self.config = config
        self.worker = worker
        self.engine: Engine | None = None  # built in a GPU worker, on its first call; never in the web process
        self.every = config.stream_every_ms / 1000.0
        self.following = False  # whether this (forked) worker watches that the web process is still there

    def answer(self, batch: list[Submit]) -> Iterator[Step]:
        """Answer ``batch`` together (one request, or a Gradio batch with each answer's candidates) and yield
        what the engine's steps did, until every answer has ended."""
        engine = self._engine()
        held, running = self._admit(engine, batch)
        sent = time.monotonic()
        try:
            while running:
                try:
                    step = engine.step()
                except Exception as exc:  # the engine cannot go on: the call's answers end with the reason
                    self.engine = None
                    error = EngineStoppedError(
                        f"The GPU call failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                        "this answer was lost. Please try again."
                    )
                    yield held.merge(Step(ended=[Ended(rid, None, error) for rid in sorted(running)]))
                    raise  # a failed call: spaces gives the next call a fresh worker
                running -= {end.rid for end in step.ended}
                held = held.merge(step)
                now = time.monotonic()
                if held and (held.ended or not running or now - sent >= self.every):
                    yield held
                    held, sent = Step(), now
            if held:
                yield held  # every answer was refused at the door
        finally:
            if self.engine is engine:
                self._settle(engine, running)

    def _engine(self) -> Engine:
        if self.engine is None:
            from vlm_demo.engine import make_engine
            from vlm_demo.engine.batching.process import follow_the_web_process

            close_server_sockets(self.config.port)
            if not self.following:  # once per worker: a worker whose engine failed builds another
                follow_the_web_process("GPU worker")  # killed, the web process leaves no worker behind
                self.following = True

            started = time.monotonic()
            self.engine = make_engine(self.config, self.worker, start=False)
            log.info(
                "GPU worker %d built its engine in %.1f s (its later calls reuse it while it stays warm)",
                os.getpid(),
                time.monotonic() - started,
            )
        return self.engine

    @staticmethod
    def _admit(engine: Engine, batch: list[Submit]) -> tuple[Step, set[int]]:
        """Queue the call's requests; those the engine refuses end at once. Returns those ends and who runs."""
        refused = Step()
        running: set[int] = set()
        for item in batch:
            try:
                engine.add_request(item.request, item.rid)
            except DemoError as err:
                refused.ended.append(Ended(item.rid, None, err))
            except Exception as err:  # noqa: BLE001 - one bad request must not end the call's others
                log.exception("could not start a request in the GPU call")
                refused.ended.append(Ended(item.rid, None, GenerationError(f"Could not start this request: {err}")))
            else:
                running.add(item.rid)
        return refused, running

    def _settle(self, engine: Engine, running: set[int]) -> None:
        """The call ended before its answers did (Stop, a closed tab): they are cancelled and stepped out of the
        batch, their pages given back, so the worker's next call finds the engine empty."""
        try:
            for rid in running:
                engine.cancel(rid)
            for _ in range(SETTLE_STEPS):
                if not engine.live and not engine.running_rows():
                    return
                engine.step()
            log.warning("the engine still held answers %d steps after its call ended: dropped", SETTLE_STEPS)
        except Exception:
            log.exception("the engine failed while its call's answers were stopped: dropped")
        self.engine = None  # the next call on this worker builds a fresh one


def close_server_sockets(port: int) -> int:
    """Close the web server's sockets this GPU worker inherited (listening, or a visitor's connection), found by the
    server's ``port``; returns how many. ``spaces`` closes those it listed before forking, but a connection the
    server accepts between its list and the fork slips through, and a worker holding it would keep that
    visitor's connection open after the server closed it."""
    from spaces.zero.utils import get_process_connections  # spaces' own /proc scan, the one its fork uses

    fds = [conn.fd for conn in get_process_connections() if port and conn.port == port]
    for fd in fds:
        try:
            os.close(fd)
        except OSError:  # closed meanwhile
            pass
    if fds:
        log.info("GPU worker %d closed %d server socket(s) it inherited", os.getpid(), len(fds))
    return len(fds)
