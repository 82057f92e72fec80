"""Dynamic (request-level) batching: waiting requests run together as one ``generate`` call.

When the worker is free the scheduler hands over up to ``--max-batch-size`` waiting requests (after
``--batch-window-ms`` for company), and the worker runs them as one left-padded batch with per-row
sampling, streaming and stopping. A batch costs as much as its longest row; continuous batching
(:mod:`~vlm_demo.engine.batching.continuous`) avoids that.

Failure isolation: if a batch raises (CUDA out of memory, a kernel error), it is split in halves and
each half retried, down to single requests; only a request that fails on its own gets an error, and
the engine thread carries on with the next batch. The retry runs only after the failed attempt's
memory is released (see :func:`~vlm_demo.engine.batching.base.release`). A sticky device error is not retried:
it ends the engine thread (see :class:`~vlm_demo.engine.batching.base.Engine`).
"""

from __future__ import annotations

import logging

from vlm_demo.config import Config
from vlm_demo.engine.batching.base import Engine, error_for, is_fatal_device_error, release
from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.ipc.messages import Step
from vlm_demo.errors import DemoError

log = logging.getLogger(__name__)


class DynamicEngine(Engine):
    batching = "dynamic"

    def __init__(self, worker: Worker, config: Config | None = None) -> None:
        super().__init__(worker, config)
        self.running: list[Request] = []  # the batch being generated
        self.sizes: list[int] = []  # batches started since the last Step

    def running_rows(self) -> int:
        return sum(1 for r in self.running if not r.done)

    def step(self) -> Step:
        """One batch (waiting a little for one): ``generate`` for all of it, each of its steps reported to
        ``sink`` as it happens (paced as the engine thread paces Steps); returns the last Step."""
        batch = self.scheduler.next_batch(timeout=0.5)
        if batch:
            self._execute(batch)
        return self._report()

    def _report(self) -> Step:
        step = self.collect(Step(batch_sizes=self.sizes))
        self.sizes = []
        return step

    def _on_token(self) -> bool:
        """After each of ``generate``'s steps: report it; True stops the batch (the engine is stopping)."""
        self._hand_over(self._report())
        return self._stop.is_set()

    def _execute(self, batch: list[Request]) -> None:
        live = [r for r in batch if not r.done]
        if not live:
            return
        self.running = live
        self.batches_run += 1
        self.sizes.append(len(live))
        failure: Exception | None = None
        try:
            self._failpoint("generate")
            self.worker.run(live, self.config.structured_stages, self._on_token)
        except Exception as exc:
            failure = exc  # handled below, outside the except block: see ``release``
        if failure is not None and is_fatal_device_error(failure):
            raise failure  # every retry would fail the same way; Engine._run fails the batch (still running)
        self.running = []
        if failure is not None:
            self._split_and_retry(live, failure)

    def _split_and_retry(self, batch: list[Request], exc: Exception) -> None:
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

    def _abandon_running(self, error: DemoError) -> None:
        for request in list(self.running):
            request.fail(error)
