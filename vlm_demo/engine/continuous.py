"""Continuous (iteration-level) batching: rows join at the next step and leave the moment they end.

A static batch costs as much as its longest row and makes newcomers wait for all of it. Here the
engine thread runs its own step loop on the model's forward pass:

1. admit: at a step boundary, the scheduler hands over waiting requests while rows and the KV
   budget (bytes: text keys/values per token plus each row's image states, see ``memory.py``)
   allow; newcomers are prefilled together, up to ``--prefill-batch-size`` per forward pass
   (images through the vision tower into their cross-attention states, prompts into their
   self-attention cache: running rows stall for one vision pass, not one per newcomer) and merged
   into the running batch;
2. decode: one forward pass for every running row, sampling for all rows on the device, then the
   step's one read back to the host (the tokens), per-row streaming and stop;
3. evict: finished or cancelled rows leave at once and their cache columns are freed.

Who runs next is the scheduler's business (``Scheduler.admit``), the cache layout is
``RunningBatch``'s, and the model calls are the worker's (``prefill`` / ``decode``).

Failures: the whole iteration (searches, admission, the step, eviction) is guarded. A failure leaves the
cache possibly half-updated, so the running rows are requeued to start over with a lower row limit, or
a row that fails on its own gets the error (:meth:`ContinuousEngine._recover`). A sticky device error
is not retried: it ends the engine thread, which fails everything at once (``Engine._run``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from vlm_demo.config import Config
from vlm_demo.engine.base import Engine, error_for, is_fatal_device_error, is_out_of_memory, release
from vlm_demo.engine.batch_state import Prefill, Row, RunningBatch
from vlm_demo.engine.beam import StageBeam
from vlm_demo.engine.image_cache import ImageStates
from vlm_demo.engine.request import Request, Resume
from vlm_demo.engine.sampler import RowSampling
from vlm_demo.engine.streamer import RowStreamer, commit_tokens
from vlm_demo.engine.worker import Worker
from vlm_demo.errors import DemoError
from vlm_demo.request import STAGE_BEAM
from vlm_demo.results import EngineStats

log = logging.getLogger(__name__)

# After an out-of-memory step the row limit is halved; it grows back by one after this many good steps.
RECOVERY_STEPS = 256
PREEMPT_AFTER = 8  # a row that joined less than this many tokens ago is not handed back (no thrashing)


class ContinuousEngine(Engine):
    batching = "continuous"
    supports_stage_beam = True

    def __init__(self, worker: Worker, config: Config | None = None) -> None:
        super().__init__(worker, config)
        self.kv_token_budget = self.config.kv_token_budget
        self.prefill_batch_size = max(1, self.config.prefill_batch_size)
        self.batch = RunningBatch(cross_layers=worker.cross_attention_layers)
        self.row_limit: int | None = None  # lowered after an out-of-memory step; None: max_batch_size
        self.good_steps = 0
        self.steps_run = 0
        self.prefills_run = 0
        self.recoveries = 0  # failed steps (or joins) whose rows were requeued
        self.beams: list[StageBeam] = []  # stage-beam searches in progress (engine thread only)
        self.admitting: list[Request] = []  # taken from the queue by the admission under way
        self.preemptions = 0
        mb = self.config.image_cache_mb
        self.images = ImageStates(int(mb * 1024**2)) if mb > 0 else None

    # ---- observation -------------------------------------------------------------------------
    def running_rows(self) -> int:
        return len(self.batch)

    def stats(self) -> EngineStats:
        return dataclasses.replace(
            super().stats(),
            cached_token_slots=self.batch.cached_slots,
            cached_bytes=self.memory.kv.batch_bytes(len(self.batch), self.batch.length),
            row_limit=self.rows_allowed,
            steps_run=self.steps_run,
            prefills_run=self.prefills_run,
            beam_searches=len(self.beams),
            preemptions=self.preemptions,
            image_cache_hits=self.images.hits if self.images is not None else 0,
            image_cache_misses=self.images.misses if self.images is not None else 0,
            image_cache_bytes=self.images.bytes if self.images is not None else 0,
            image_cache_entries=len(self.images) if self.images is not None else 0,
        )

    @property
    def rows_allowed(self) -> int:
        return self.max_batch_size if self.row_limit is None else min(self.row_limit, self.max_batch_size)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not len(self.batch) and not self.beams and not self.scheduler.wait_for_work(timeout=0.5):
                continue
            failure: Exception | None = None
            try:
                self._iteration()
            except Exception as exc:
                failure = exc  # handled outside the except block, so the failed attempt's memory can go
            if failure is not None:
                self._recover(failure)
        self.batch.keep([])

    def _iteration(self) -> None:
        self._advance_beams()
        self._admit()
        self._evict_finished()
        if len(self.batch):
            self._step()
        elif self.beams:  # searches waiting on nothing this engine runs (cannot last): do not spin
            self.scheduler.wait_for_work(timeout=0.005)

    def _abandon_running(self, error: DemoError) -> None:
        for request in [row.request for row in self.batch.rows] + self.admitting:
            request.fail(error)
        for beam in list(self.beams):
            beam.fail(error)

    # ---- stage-beam searches -------------------------------------------------------------------
    def _advance_beams(self) -> None:
        """Let each search move on (judged rounds, decided stages); its judge calls go first in line."""
        for beam in list(self.beams):
            judges = beam.advance()
            if judges:
                self.scheduler.requeue_front(judges)
            if beam.finished:
                beam.cancel_children()
                self.beams.remove(beam)

    def _join_forks(self, free: int) -> int | None:
        """Fork the candidate rows searches want, before any newcomer: they are answers in progress.
        Never past the row limit: a search with more candidates than free rows forks them in waves.
        Returns the rows still free, or ``None`` when a search waits for rows (newcomers wait too)."""
        spare = not self.scheduler.depth  # nobody waits: a search may write its next stage ahead
        for beam in self.beams:
            wanted = beam.rows_wanted(spare)
            if not wanted:
                continue
            take = min(wanted, free)  # more candidates than free rows: they run in waves
            if take <= 0 and beam.speculating:
                continue  # a guess takes only rows nobody wants, and never blocks other forks
            if take <= 0:
                return None
            failure: Exception | None = None
            try:
                prefill, rows, sampling, tokens, own_first = beam.fork(take)
                size = len(self.batch) + len(rows)
                for row in rows:
                    row.request.batch_size = size
                if own_first:  # drawn from the prompt's logits: the candidates' first tokens
                    tokens = self._commit_first(rows, tokens, prefill.logits, sampling)
                self.batch.join(rows, prefill, tokens, sampling)
            except Exception as exc:
                failure = exc
            if failure is not None:
                if is_fatal_device_error(failure):
                    raise failure
                beam.restart_stage(error_for(failure))  # its new rows never joined: write the stage again
                self._recover(failure)
                return None
            free -= take
            if take < wanted and not beam.speculating:
                return None
        return free

    def _fits(self) -> Callable[[Request], bool]:
        """Budget check for the next admission: the cache after it joins (padding and slack
        included), in bytes and, if ``--kv-token-budget`` is set, in token slots."""
        rows, length = len(self.batch), self.batch.length
        budget, kv = self.memory.kv_budget_bytes, self.memory.kv

        def fits(request: Request) -> bool:
            nonlocal rows, length
            new_length = max(length, request.input_tokens)
            need = request.rows_needed
            over_tokens = 0 < self.kv_token_budget < (rows + need) * new_length
            cache_bytes = kv.batch_bytes(rows + need, new_length)
            if self.images is not None and 0 < budget < cache_bytes + self.images.bytes:
                self.images.evict(cache_bytes + self.images.bytes - budget)  # rows before remembered images
            over_bytes = 0 < budget < cache_bytes + (self.images.bytes if self.images is not None else 0)
            if rows and (over_tokens or over_bytes):
                return False  # a lone request is always admitted, or it could never run
            rows, length = rows + need, new_length
            return True

        return fits

    def _preempt(self) -> None:
        """Give each waiting client its share of the rows when they are all taken: a client holding more
        than ``rows ÷ clients`` gives back the rows that wrote least (cheapest to resume), which wait their
        turn and continue where they stopped (``Request.resume``: the prompt and what they wrote are
        prefilled again, the image from the image-state cache). A stage-beam search's rows stay."""
        if len(self.batch) < self.rows_allowed:
            return  # a row is free: the next client in turn gets it
        waiting = self.scheduler.clients_waiting()
        if not waiting:
            return
        held: dict[str, int] = {}
        movable: dict[str, list[int]] = {}
        for index, row in enumerate(self.batch.rows):
            owner = row.beam.request.client if row.beam is not None else row.request.client
            held[owner] = held.get(owner, 0) + 1
            plain = row.beam is None and type(row.request) is Request and not row.streamer.done
            if plain and len(row.streamer.ids) >= PREEMPT_AFTER:
                movable.setdefault(owner, []).append(index)
        share = max(1, self.rows_allowed // len(set(held) | set(waiting)))
        victims = []
        for client in waiting:
            if held.get(client, 0) >= share:
                continue
            over = [c for c, n in held.items() if n > share and movable.get(c)]
            if not over:
                break
            donor = max(over, key=lambda c: held[c])
            victims.append(min(movable[donor], key=lambda i: len(self.batch.rows[i].streamer.ids)))
            movable[donor].remove(victims[-1])
            held[donor] -= 1
            held[client] = held.get(client, 0) + 1
        if victims:
            self._suspend(victims)

    def _suspend(self, indices: list[int]) -> None:
        requests = []
        for index in indices:
            row = self.batch.rows[index]
            row.request.resume = Resume(row.streamer, draws=len(row.streamer.ids))
            requests.append(row.request)
        self.batch.keep([i for i in range(len(self.batch)) if i not in set(indices)])
        self.preemptions += len(requests)
        self.scheduler.requeue_front(requests, first=False)  # their clients wait their turn

    def _admit(self) -> None:
        self._preempt()
        free = self._join_forks(self.rows_allowed - len(self.batch))
        if free is None or free <= 0:
            return
        newcomers = [r for r in self.scheduler.admit(free, self._fits(), alone=not len(self.batch)) if not r.done]
        self.admitting = newcomers  # out of the queue, not yet in the batch: a failure must not lose them
        recoveries = self.recoveries
        for start in range(0, len(newcomers), self.prefill_batch_size):
            back = self._admit_group(newcomers[start : start + self.prefill_batch_size])
            if self.recoveries != recoveries:  # a join failed: _recover requeued every newcomer still waiting
                return
            if back:  # memory ran short: the rest wait too
                self.scheduler.requeue_front(back + newcomers[start + self.prefill_batch_size :])
                self.admitting = []
                return
        self.admitting = []
        if newcomers and self.beams:  # new searches fork at once, and judged ones may write ahead
            self._join_forks(self.rows_allowed - len(self.batch))

    def _admit_group(self, group: list[Request]) -> list[Request]:
        """Prefill ``group`` together and join it; if that fails, retry in halves. Returns the
        requests to put back in the queue (out of memory while other rows hold the cache); once
        one is put back, so are the ones after it."""
        now = time.monotonic()
        for request in group:
            if request.resume is None:
                request.reset_progress()
            request.started = request.started or now
        failure: Exception | None = None
        try:
            prefill, sampling, tokens, first = self._prefill(group)
        except Exception as exc:
            failure = exc  # handled outside the except block, so the failed attempt's memory can go
        if failure is not None:
            if is_fatal_device_error(failure):
                raise failure  # every retry would fail the same way (the engine thread stops)
            release(failure)
            if len(group) > 1:
                middle = len(group) // 2
                back = self._admit_group(group[:middle])
                return back + group[middle:] if back else self._admit_group(group[middle:])
            if len(self.batch) and is_out_of_memory(failure):
                # Memory is held by running rows: wait for some to leave, then retry it.
                self.row_limit = max(1, len(self.batch))
                return group
            self._fail(group[0], failure)
            return []
        structured = self.config.structured_stages
        searches = [i for i, r in enumerate(group) if r.params.reasoning == STAGE_BEAM]
        if searches:  # a search keeps its prompt's cache aside and forks candidates from it
            for i in searches:
                beam = StageBeam(group[i], prefill.snapshot(i, self.batch.cross_layers), self.worker, structured)
                group[i].beam = beam
                self.beams.append(beam)
            plain = [i for i in range(len(group)) if i not in searches]
            if not plain:
                return []
            prefill = prefill.select(plain, self.batch.cross_layers)
            sampling = sampling.select(plain)
            tokens = tokens.index_select(0, torch.tensor(plain, device=tokens.device))
            first = [first[i] for i in plain]
            group = [group[i] for i in plain]
        rows = [Row(r, r.resume.streamer if r.resume is not None else self._streamer(r, structured)) for r in group]
        size = len(self.batch) + len(rows)
        for row in rows:
            row.request.batch_size = max(row.request.batch_size, size)
        try:  # a row that ends on its first token leaves at the next eviction
            tokens = self._first_tokens(rows, tokens, prefill.logits, sampling, first)
            self.batch.join(rows, prefill, tokens, sampling)
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._recover(failure, newcomers=group)
            return []
        for request in group:
            request.resume = None
        return []

    def _streamer(self, request: Request, structured: bool) -> RowStreamer:
        tracker = self.worker.tracker(request.params, structured and request.staged)
        return RowStreamer(self.worker.tokenizer, request, self.worker.eos_ids, request.stop_text, tracker)

    def _first_tokens(
        self, rows: list[Row], tokens: torch.Tensor, logits: torch.Tensor, sampling: RowSampling, first: list[int]
    ) -> torch.Tensor:
        """Newcomers' first tokens (committed and fed); a resumed row's is the last token it wrote, its
        draw counter where it was. Returns the rows' next inputs."""
        resumed = [i for i, row in enumerate(rows) if row.request.resume is not None]
        if not resumed:
            return self._commit_first(rows, tokens, logits, sampling, first)
        fresh = [i for i in range(len(rows)) if i not in resumed]
        values = list(first)
        if fresh:
            chosen = commit_tokens(
                [rows[i].streamer for i in fresh],
                [first[i] for i in fresh],
                lambda which: self.worker.redraw(sampling, logits, [fresh[j] for j in which]).tolist(),
            )
            for i, token in zip(fresh, chosen, strict=True):
                values[i] = token
                rows[i].streamer.feed(token)
        draws = sampling.draws.clone()
        for i in resumed:
            request = rows[i].request
            values[i] = request.token_ids[-1]
            draws[i] = request.resume.draws  # type: ignore[union-attr]
        sampling.draws = draws
        return torch.tensor(values, dtype=tokens.dtype, device=tokens.device)

    def _prefill(self, group: list[Request]) -> tuple[Prefill, RowSampling, torch.Tensor, list[int]]:
        """The model call for newcomers and their first tokens (kept in its own frame: when it
        fails, nothing of the attempt stays referenced from the caller's)."""
        self._failpoint("prefill")
        prefill = self.worker.prefill(group, self.images)
        self.prefills_run += 1
        sampling = RowSampling([r.params for r in group], prefill.logits.device)
        tokens = sampling.sample(prefill.logits)
        return prefill, sampling, tokens, tokens.tolist()

    def _evict_finished(self) -> None:
        """Finished and cancelled rows leave before the next step: they cost nothing more. A search's
        candidate that reached its closing tag leaves a copy of its cache behind, in case it wins."""
        self._failpoint("evict")
        keep = []
        for i, row in enumerate(self.batch.rows):
            beam = row.beam
            if not (row.streamer.done or row.request.done or (beam is not None and beam.request.done)):
                keep.append(i)
            elif beam is not None and row.streamer.done and not beam.request.done and not row.request.cancelled:
                beam.candidate_done(row, self.batch.snapshot(i) if row.streamer.reached_stop_text else None)
        self.batch.keep(keep)

    def _next_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: the logits and every row's next token, still on the device."""
        self._failpoint("forward")
        logits = self.worker.decode(self.batch.step_inputs())
        return logits, self.batch.sampling.sample(logits)

    def _commit(self, rows: list[Row], sampled: list[int], logits: torch.Tensor, sampling: RowSampling) -> list[int]:
        """The tokens the rows commit (the stage structure may replace a sampled one, or draw it again)."""
        return commit_tokens(
            [row.streamer for row in rows], sampled, lambda which: self.worker.redraw(sampling, logits, which).tolist()
        )

    def _commit_first(
        self,
        rows: list[Row],
        tokens: torch.Tensor,
        logits: torch.Tensor,
        sampling: RowSampling,
        sampled: list[int] | None = None,
    ) -> torch.Tensor:
        """Feed newcomers their first tokens (drawn from the prefill's logits) as committed; returns the
        tokens to join the batch with (the next inputs)."""
        sampled = tokens.tolist() if sampled is None else sampled
        committed = self._commit(rows, sampled, logits, sampling)
        for row, token in zip(rows, committed, strict=True):
            row.streamer.feed(token)
        return tokens if committed == sampled else torch.tensor(committed, dtype=tokens.dtype, device=tokens.device)

    def _host_tokens(self, tokens: torch.Tensor) -> list[int]:
        """The step's one read back to the host (where an asynchronous CUDA error from the step surfaces)."""
        self._failpoint("host_read")
        return tokens.tolist()

    def _step(self) -> None:
        """One decode step for every row: forward and sampling on the device, then stream and stop per row.
        A failure anywhere in it reaches ``_loop``, which recovers (or stops the engine)."""
        rows = self.batch.rows
        size = len(rows)
        logits, tokens = self._next_tokens()
        self._failpoint("advance")
        self.batch.advance(tokens)
        ids = self._host_tokens(tokens)
        committed = self._commit(rows, ids, logits, self.batch.sampling)
        del logits
        if committed != ids:  # not in the cache yet: the replacement is the row's next input
            self.batch.replace_next(
                {i: token for i, (token, was) in enumerate(zip(committed, ids, strict=True)) if token != was}
            )
        self.steps_run += 1
        self._notify_batch(size)
        for row, token in zip(rows, committed, strict=True):
            row.request.batch_size = max(row.request.batch_size, size)
            row.streamer.feed(token)
        self._evict_finished()
        self.good_steps += 1
        if self.row_limit is not None and self.good_steps >= RECOVERY_STEPS:
            self.row_limit = None if self.row_limit + 1 >= self.max_batch_size else self.row_limit + 1
            self.good_steps = 0

    def _recover(self, exc: Exception, newcomers: list[Request] | None = None) -> None:
        """A failed step may leave the cache half-updated: drop it and requeue the rows to start
        over (clients see no repeats; seeded sampled rows redraw the same tokens), with half the
        row limit. A row that fails on its own gets the error. The cache and the failed attempt's
        memory are released before anything runs again. A sticky device error cannot be recovered
        from: it is raised on, and ends the engine thread."""
        if is_fatal_device_error(exc):
            raise exc
        requests = [row.request for row in self.batch.rows if row.beam is None]
        requests += [r for r in [*(newcomers or []), *self.admitting] if r not in requests and not r.done]
        self.admitting = []
        searches = list({id(row.beam): row.beam for row in self.batch.rows if row.beam is not None}.values())
        self.batch.keep([])
        self.recoveries += 1
        release(exc)
        for beam in searches:  # a search writes its running stage again
            beam.restart_stage(error_for(exc))
        if len(requests) + len(searches) > 1:
            log.warning("step with %d rows failed (%s); requeueing with a lower row limit", len(requests), exc)
            self.row_limit = max(1, len(requests) // 2)
            self.good_steps = 0
            self.scheduler.requeue_front(requests)
            return
        for request in requests:
            self._fail(request, exc)

    def _fail(self, request: Request, exc: Exception) -> None:
        log.warning("request %d failed on its own: %r", request.request_id, exc)
        request.fail(error_for(exc))
