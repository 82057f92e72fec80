"""Continuous (iteration-level) batching: rows join at the next step and leave the moment they end.

A static batch costs as much as its longest row and makes newcomers wait for all of it. Here the
engine thread runs its own step loop on the model's forward pass:

1. admit: at a step boundary, the scheduler hands over waiting requests while rows and the KV
   budget allow; each is prefilled alone (image through the vision tower into its cross-attention
   states, prompt into its self-attention cache) and merged into the running batch;
2. decode: one forward pass for every running row, per-row sampling, per-row streaming and stop;
3. evict: finished or cancelled rows leave at once and their cache columns are freed.

Who runs next is the scheduler's business (``Scheduler.admit``), the cache layout is
``RunningBatch``'s, and the model calls are the worker's (``prefill`` / ``decode``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vlm_demo.config import Config
from vlm_demo.engine.batch_state import Row, RunningBatch
from vlm_demo.engine.engine import Engine, error_for, is_out_of_memory
from vlm_demo.engine.request import Request
from vlm_demo.engine.sampler import make_generator, pick_tokens
from vlm_demo.engine.streamer import RowStreamer

log = logging.getLogger(__name__)

# After an out-of-memory step the row limit is halved; it grows back by one after this many good steps.
RECOVERY_STEPS = 256


class ContinuousEngine(Engine):
    def __init__(self, worker: Any, config: Config | None = None) -> None:
        config = config or Config(batching="continuous")
        self.kv_token_budget = config.kv_token_budget
        self.batch = RunningBatch(cross_layers=worker.cross_attention_layers)
        self.row_limit = config.max_batch_size
        self.good_steps = 0
        self.steps_run = 0
        super().__init__(worker, config)

    # ---- observation -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update(
            running=len(self.batch),
            cached_token_slots=self.batch.cached_slots,
            row_limit=self.row_limit,
            steps_run=self.steps_run,
        )
        return stats

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not len(self.batch) and not self.scheduler.wait_for_work(timeout=0.5):
                continue
            self._admit()
            self._evict_finished()
            if len(self.batch):
                self._step()
        for row in self.batch.rows:
            row.request.cancel()
        self.batch.keep([])

    def _fits(self) -> Any:
        """Budget check for the next admission: padded cache slots after it joins."""
        rows, length = len(self.batch), self.batch.length

        def fits(request: Request) -> bool:
            nonlocal rows, length
            if self.kv_token_budget <= 0:
                return True
            new_length = max(length, request.prompt_tokens)
            if rows and (rows + 1) * new_length > self.kv_token_budget:
                return False  # a lone request is always admitted, or it could never run
            rows, length = rows + 1, new_length
            return True

        return fits

    def _admit(self) -> None:
        free = min(self.max_batch_size, self.row_limit) - len(self.batch)
        if free <= 0:
            return
        for request in self.scheduler.admit(free, self._fits()):
            if request.done:
                continue
            try:
                self._prefill(request)
            except Exception as exc:
                if len(self.batch) and is_out_of_memory(exc):
                    # Memory is held by running rows: wait for some to leave, then retry it.
                    self.row_limit = max(1, len(self.batch))
                    self.scheduler.requeue_front([request])
                    return
                self._fail(request, exc)

    def _prefill(self, request: Request) -> None:
        request.reset_progress()
        request.started = request.started or time.monotonic()
        cache, logits = self.worker.prefill(request)
        row = Row(
            request,
            RowStreamer(self.worker.tokenizer, request, self.worker.eos_ids),
            make_generator(request.params, self.worker.device),
        )
        token = pick_tokens(logits, [request.params], [row.generator])[0]
        if row.streamer.feed(token):
            return  # finished on its first token; never joins
        request.batch_size = max(request.batch_size, len(self.batch) + 1)
        self.batch.join(
            row,
            cache,
            request.prompt_tokens,
            self.worker.cross_attention_masks(request.inputs["cross_attention_mask"]),
            token,
        )

    def _evict_finished(self) -> None:
        """Finished and cancelled rows leave before the next step: they cost nothing more."""
        keep = [i for i, row in enumerate(self.batch.rows) if not (row.streamer.done or row.request.done)]
        self.batch.keep(keep)

    def _step(self) -> None:
        rows = self.batch.rows
        size = len(rows)
        try:
            logits = self.worker.decode(self.batch.step_inputs())
        except Exception as exc:
            self._recover(exc)
            return
        self.steps_run += 1
        self._notify("on_batch", size)
        tokens = pick_tokens(logits, [r.request.params for r in rows], [r.generator for r in rows])
        for row, token in zip(rows, tokens, strict=False):
            row.request.batch_size = max(row.request.batch_size, size)
            row.streamer.feed(token)
        self.batch.advance(torch.tensor(tokens, device=self.batch.next_tokens.device))
        self._evict_finished()
        self.good_steps += 1
        if self.row_limit < self.max_batch_size and self.good_steps >= RECOVERY_STEPS:
            self.row_limit += 1
            self.good_steps = 0

    def _recover(self, exc: Exception) -> None:
        """A failed step may leave the cache half-updated: drop it and requeue the rows to start
        over (clients see no repeats; seeded sampled rows redraw the same tokens), with half the
        row limit. A row that fails on its own gets the error."""
        rows = [row.request for row in self.batch.rows]
        self.batch.keep([])
        if is_out_of_memory(exc) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(rows) > 1:
            log.warning("step with %d rows failed (%s); requeueing with a lower row limit", len(rows), exc)
            self.row_limit = max(1, len(rows) // 2)
            self.good_steps = 0
            self.scheduler.requeue_front(rows)
            return
        for request in rows:
            self._fail(request, exc)

    def _fail(self, request: Request, exc: Exception) -> None:
        log.warning("request %d failed on its own: %r", request.request_id, exc)
        request.fail(error_for(exc))
