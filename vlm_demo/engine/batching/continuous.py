"""Continuous (iteration-level) batching: rows join at the next step and leave the moment they end.

A static batch costs as much as its longest row and makes newcomers wait for all of it. Here each
``step()`` is one boundary and one decode step:

1. plan: the scheduler decides (``Scheduler.plan``) which rows to hand back (pages for the next step, a
   waiting client's fair share), which Think-harder candidates to fork and which newcomers to admit;
2. execute: handed-back rows give their pages back; forks share their start's pages; newcomers are
   prefilled together (pictures of one tile count, up to ``--prefill-batch-size`` per forward pass) and
   written into fresh pages. While rows decode, this work is paced (:mod:`~vlm_demo.engine.scheduling.pacing`): the
   waiting pictures go through the vision tower a few layers a step (:mod:`~vlm_demo.engine.scheduling.lookahead`) and a
   newcomer joins once its picture is ready, so the running rows never stall for long;
3. decode: one forward pass for every running row over the page pool, sampling on the device, then
   the step's one read back to the host (the tokens), each row's committed token
   (:mod:`~vlm_demo.engine.decoding.choice`: the stage structure's), streaming and stop;
   rows that ended leave at once and give their pages back. Nobody else's cache moves.

Who runs next is the scheduler's business, where caches live is ``RunningRows``' (:mod:`~vlm_demo.engine.batching.rows`),
and the model calls are the worker's (``prefill``) and the decode step's (:mod:`~vlm_demo.engine.executor.decode_step`).

Failures: the whole step is guarded. A failure leaves the rows' pages possibly half-written, so the
running rows are requeued to start over with a lower row limit, or a row that fails on its own gets
the error (``_recover``). A sticky device error is not retried: it ends the engine thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from vlm_demo.config import Config
from vlm_demo.engine.batching.base import Engine, error_for, is_fatal_device_error, is_out_of_memory, release
from vlm_demo.engine.batching.job import Request, Resume
from vlm_demo.engine.batching.joining import Joiner
from vlm_demo.engine.batching.rows import Row, RunningRows
from vlm_demo.engine.decoding.choice import TokenChoice, replacements
from vlm_demo.engine.executor.attention import choose
from vlm_demo.engine.executor.decode_step import TextDecodeStep, attention_geometry
from vlm_demo.engine.executor.graphs import decode_graphs
from vlm_demo.engine.executor.picture_states import PictureStates
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.ipc.messages import Step
from vlm_demo.engine.kv.image_cache import ImageStates
from vlm_demo.engine.kv.memory import PROMPT_TOKENS
from vlm_demo.engine.kv.pages import kv_dtype_for
from vlm_demo.engine.scheduling.lookahead import Lookahead
from vlm_demo.engine.scheduling.pacing import Pacer
from vlm_demo.engine.search.beam import StageBeam
from vlm_demo.errors import DemoError, OutOfMemoryError
from vlm_demo.results import EngineStats

log = logging.getLogger(__name__)

RECOVERY_STEPS = 256  # after an out-of-memory step the row limit is halved; it grows back by one per this many


class ContinuousEngine(Engine):
    batching = "continuous"
    supports_stage_beam = True

    def __init__(self, worker: Worker, config: Config | None = None) -> None:
        config = config or Config(batching=self.batching)
        kv_dtype = kv_dtype_for(config.kv_cache_dtype, worker.dtype)
        shape, heads, device = attention_geometry(worker.model, worker.dtype, kv_dtype)
        kernel = choose(shape, heads, device, config.decode_attention)  # before the plan: it reserves its memory
        row = config.max_new_tokens + PROMPT_TOKENS
        super().__init__(worker, config, kernel.working_bytes(shape, heads, 1, shape.max_tiles, row))
        pages = self.memory.pool_pages(shape)
        self.decoder = TextDecodeStep.over_pool(worker.model, worker.dtype, pages, kernel, kv_dtype)
        self.rows = RunningRows(self.decoder.pool, self.decoder.attention, worker.device, worker.dtype)
        self.graphs = decode_graphs(self.decoder, self.max_batch_size, self.config, worker)
        self.joiner = Joiner(worker, self.rows, self.config.structured_stages)
        self.row_limit: int | None = None  # lowered after an out-of-memory step; None: max_batch_size
        self.good_steps = self.steps_run = self.prefills_run = self.recoveries = self.preemptions = 0
        self.beams: list[StageBeam] = []  # stage-beam searches in progress
        self.unrendered: list[Row] = []  # rows whose last token is taken but not yet text
        self.views: dict[int, object] = {}  # rid -> the search view last reported
        mb = self.config.image_cache_mb
        self.images = ImageStates(int(mb * 1024**2), self.decoder.pool) if mb > 0 else None
        self.pacer = Pacer(self.config.prefill_share, worker.synchronize)
        self.pictures = PictureStates(worker.encode_pictures, self.images)  # a newcomer's picture states
        self.lookahead = Lookahead(worker, self.pictures, self.pacer, self.config.prefill_batch_size)
        self.prefill_s = 0.0  # prefill work this step (seconds; a step with none measures the decode)

    # ---- observation -------------------------------------------------------------------------
    def running_rows(self) -> int:
        return len(self.rows)

    @property
    def rows_allowed(self) -> int:
        return self.max_batch_size if self.row_limit is None else min(self.row_limit, self.max_batch_size)

    def stats(self) -> EngineStats:
        images = self.images.stats() if self.images is not None else {}
        counts = {"steps_run": self.steps_run, "prefills_run": self.prefills_run, "preemptions": self.preemptions}
        searches = len(self.beams)
        graphs = {"decode_attention": self.decoder.attention.kernel, "cuda_graphs": len(self.graphs.graphs),
                  "graph_pool_bytes": self.graphs.pool_bytes, "kv_cache_dtype": self.config.kv_cache_dtype}  # fmt: skip
        changes: dict[str, Any] = {**self.rows.stats(), **images, **counts, **graphs}
        return dataclasses.replace(super().stats(), **changes, row_limit=self.rows_allowed, beam_searches=searches)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> Step:
        """Plan, execute, decode once; returns what the clients' requests did (waits a little when idle)."""
        sizes: list[int] = []
        if len(self.rows) or self.beams or self.scheduler.wait_for_work(timeout=0.5):
            started, self.prefill_s = time.perf_counter(), 0.0
            failure: Exception | None = None
            try:
                self._advance_beams()
                self._execute_plan()
                self._leave_ended()  # rows cancelled meanwhile (the others left as their last token came)
                if len(self.rows):
                    self._decode(sizes)
                else:
                    self._render()
                    if self.beams:  # searches waiting on nothing this engine runs (cannot last): do not spin
                        self.scheduler.wait_for_work(timeout=0.005)
            except Exception as exc:
                failure = exc  # handled outside the except block, so the failed attempt's memory can go
            if failure is not None:
                self._recover(failure)
            elif sizes and not self.prefill_s:
                self.pacer.decode_step(time.perf_counter() - started)
        step = self.collect(Step(batch_sizes=sizes))
        for beam in self.beams:  # the page's view of each search, when it changed
            rid, view = beam.request.rid, beam.request.beam_view()
            if rid is not None and view != self.views.get(rid):
                self.views[rid] = view
                step.beams.insert(0, (rid, view))  # type: ignore[arg-type]
        return step

    def _advance_beams(self) -> None:
        """Let each search move on (judged rounds, decided stages); its judge calls go first in line."""
        for beam in list(self.beams):
            judges = beam.advance()
            if judges:
                self.scheduler.requeue_front(judges)
            if beam.finished:
                beam.close()
                self.beams.remove(beam)
                self.views.pop(beam.request.rid, None)  # type: ignore[arg-type]

    def _execute_plan(self) -> None:
        cache = self.images.pages if self.images is not None else 0
        room = self.rows.room(self.rows_allowed, cache, self.config.kv_token_budget)
        allowance = self.pacer.allowance(len(self.rows))
        if allowance is not None:  # rows decode: newcomers join with their picture ready, a few prompts a step
            room.ready, room.prefill_tokens = self.pictures.ready, self.pacer.units("prompt", allowance, 0)
        plan = self.scheduler.plan(room, self.rows.states, self.beams)
        if plan.evict_pages and self.images is not None:
            self.images.evict(plan.evict_pages)
        if plan.suspend:
            self._suspend(plan.suspend)
        if plan.short:  # rows that outgrew the whole pool end here, honestly marked as out of room ("length")
            self._cut_short()
        for search, count in plan.forks:
            self.joiner.fork(search, count)
        groups = self._prefill_groups([r for r in plan.admit if not r.done])
        for index, group in enumerate(groups):
            back = self._admit(group)
            if back:  # memory ran short: the rest wait too
                self.scheduler.requeue_front(back + [r for later in groups[index + 1 :] for r in later])
                return
        if allowance is not None:  # what the step has left goes to the next pictures
            waiting = self.scheduler.snapshot()
            reserve = self.rows.table.cache_reserve(waiting[: self.config.prefill_batch_size], len(self.rows))
            must = not self.prefill_s  # nobody was prefilled: a layer at least, so pictures always move on
            self.prefill_s += self.lookahead.work(waiting, allowance - self.prefill_s, reserve, must)

    def _prefill_groups(self, admitted: list[Request]) -> list[list[Request]]:
        """Newcomers in prefill batches: pictures of one tile count together, at most ``--prefill-batch-size``."""
        by_tiles: dict[int, list[Request]] = {}
        for request in admitted:
            by_tiles.setdefault(self.worker.tiles_run(request.inputs), []).append(request)
        size = max(1, self.config.prefill_batch_size)
        return [group[i : i + size] for group in by_tiles.values() for i in range(0, len(group), size)]

    def _cut_short(self) -> None:
        """End the newest rows that need a page for their next token until the pool (with the image-state
        cache's pages) has one for each of the others: nothing else can make room."""
        for row in self.rows.beyond(self.rows.pool.free_pages + (self.images.pages if self.images is not None else 0)):
            log.warning("request %d filled the page pool: its answer ends here", row.request.request_id)
            row.streamer.cut()
        self._leave_ended()

    def _suspend(self, indices: list[int]) -> None:
        """Hand rows back to the queue: they give their pages back and resume later where they stopped."""
        requests = []
        for index in indices:
            row = self.rows.rows[index]
            row.request.resume = Resume(row.streamer, draws=len(row.streamer.ids))
            requests.append(row.request)
        self.rows.keep([i for i in range(len(self.rows)) if i not in set(indices)])
        self.preemptions += len(requests)
        self.scheduler.requeue_front(requests, first=False)  # their clients wait their turn

    def _admit(self, group: list[Request]) -> list[Request]:
        """Prefill ``group`` together and join it; if that fails, retry in halves. Returns the requests to
        put back in the queue (out of memory while other rows hold it); once one is, so are those after it."""
        now = time.monotonic()
        for request in group:
            if request.resume is None:
                request.reset_progress()
            request.started = request.started or now
        failure: Exception | None = None
        reserve = self.rows.table.cache_reserve(group, len(self.rows))  # not the image-state cache's pages
        text_only = all(self.pictures.ready(r) for r in group)  # else the tower runs inline: not a prompt's cost
        try:
            self._failpoint("prefill")
            with self.pacer.timed("prompt" if text_only else "", sum(r.input_tokens for r in group)) as took:
                prefill = self.worker.prefill(group, self.pictures, reserve)
                places = self.rows.place(prefill, list(range(len(group))))
            self.prefill_s += took[0]
            self.prefills_run += 1
        except Exception as exc:
            failure = exc  # handled outside the except block, so the failed attempt's memory can go
        if failure is not None:
            if is_fatal_device_error(failure):
                raise failure
            release(failure)
            if len(group) > 1:
                middle = len(group) // 2
                back = self._admit(group[:middle])
                return back + group[middle:] if back else self._admit(group[middle:])
            if len(self.rows) and is_out_of_memory(failure):
                self.row_limit = max(1, len(self.rows))  # memory is held by running rows: wait for some to leave
                return group
            self._fail(group[0], failure)
            return []
        if places is None:  # the pool cannot hold them next to the running rows
            if len(self.rows) or len(group) > 1:
                return group
            need = prefill.pages(self.rows.table, 0)
            self._fail(group[0], OutOfMemoryError(f"This request needs {need} pages of cache; the server has "
                                                  f"{self.rows.pool.pages}. Try a shorter conversation."))  # fmt: skip
            return []
        for request in group:
            request.vision = None  # in its pages now
        self.beams += self.joiner.join(group, prefill, places)
        return []

    def _decode(self, sizes: list[int]) -> None:
        """One decode step for every row: forward and sampling launched on the device, then the previous
        step's tokens rendered as text while it runs, then the one host read, the stage structure and each
        row's new token taken (a row that ended at its stop text was in this step too; it leaves now)."""
        rows = list(self.rows.rows)
        inputs = self.rows.step_inputs(self.graphs.pad_to(len(rows)))
        self._failpoint("forward")
        logits = self.worker.decode(self.graphs, inputs)[: len(rows)]
        choice = TokenChoice(self.rows.sampling, logits)  # type: ignore[type-var]  # rows are running: not None
        tokens = choice.draw()
        self._failpoint("advance")
        self.rows.advance(tokens)
        self._render()
        self._failpoint("host_read")
        ids = tokens.tolist()  # the step's one read back to the host
        self.rows.staging.recycle()
        committed = choice.commit([row.streamer for row in rows], ids)
        changed = replacements(ids, committed)
        if changed:  # not in the cache yet: the replacement is the row's next input
            self.rows.replace_next(changed)
        self.steps_run += 1
        sizes.append(len(rows))
        for row, token in zip(rows, committed, strict=True):
            row.request.batch_size = max(row.request.batch_size, len(rows))
            row.streamer.accept(token)
        self.unrendered = rows
        self._leave_ended()
        self.good_steps += 1
        if self.row_limit is not None and self.good_steps >= RECOVERY_STEPS:
            self.row_limit = None if self.row_limit + 1 >= self.max_batch_size else self.row_limit + 1
            self.good_steps = 0

    def _render(self) -> None:
        """The last step's tokens into text (what the clients are sent, and where rows meet their stop text)."""
        for row in self.unrendered:
            row.streamer.render()
        self.unrendered = []

    def _leave_ended(self) -> None:
        """Finished and cancelled rows leave (their pages go back); a search's candidate that reached its
        closing tag leaves its cache behind as a snapshot, in case it wins."""
        self._failpoint("evict")
        keep = []
        for i, row in enumerate(self.rows.rows):
            beam = row.beam
            if not (row.streamer.done or row.request.done or (beam is not None and beam.request.done)):
                keep.append(i)
            elif beam is not None and row.streamer.done and not beam.request.done and not row.request.cancelled:
                beam.candidate_done(row, self.rows.snapshot(i) if row.streamer.reached_stop_text else None)
        self.rows.keep(keep)

    # ---- failures ------------------------------------------------------------------------------
    def _recover(self, exc: Exception, newcomers: list[Request] | None = None) -> None:
        """A failed step may leave pages half-written: the rows leave and are requeued to start over (clients
        see no repeats; seeded rows draw the same tokens), with half the row limit. A row that fails on its
        own gets the error. A sticky device error is raised on: it ends the engine thread."""
        if is_fatal_device_error(exc):
            raise exc
        self.unrendered = []
        requests = [row.request for row in self.rows.rows if row.beam is None]
        requests += [r for r in newcomers or [] if r not in requests and not r.done]
        searches = list({id(row.beam): row.beam for row in self.rows.rows if row.beam is not None}.values())
        self.rows.keep([])
        self.recoveries += 1
        release(exc)
        for request in requests:
            request.resume = None
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
        request.fail(exc if isinstance(exc, DemoError) else error_for(exc))

    def _abandon_running(self, error: DemoError) -> None:
        for row in self.rows.rows:
            row.request.fail(error)
        for beam in list(self.beams):
            beam.fail(error)
            beam.close()
        self.beams = []
        self.rows.keep([])
