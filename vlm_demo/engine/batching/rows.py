"""The running batch: the rows of the next decode step, their next input tokens and their sampling state.

Each row's cache is a :class:`~vlm_demo.engine.kv.page_table.Placement` the page table keeps
(:mod:`~vlm_demo.engine.kv.page_table`): rows join with pages already written (a newcomer's prefill, a
Think-harder candidate's fork), leave by giving theirs back, and nothing else's keys and values move. The
rows' order in the step is a list on the host.

The step's inputs are built on the host from the rows' page lists and lengths (no device reads) — what
the attention reads by the attention kernel itself (:mod:`~vlm_demo.engine.executor.attention`) — and sent in one
copy from a pinned staging buffer (:mod:`~vlm_demo.engine.executor.staging`); the input tokens stay on the device
from the previous step's sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import vlm_demo.engine.executor.prefill as prefill_pages
from vlm_demo.engine.batching.job import Request, Search
from vlm_demo.engine.decoding.detokenizer import RowStreamer
from vlm_demo.engine.decoding.sampler import RowSampling
from vlm_demo.engine.executor.attention import VERSIONS, Layout, PagedAttention, StepRows
from vlm_demo.engine.executor.prefill import Prefill
from vlm_demo.engine.executor.staging import Staging
from vlm_demo.engine.kv.page_table import PageTable, Placement, Snapshot
from vlm_demo.engine.kv.pages import PagePool
from vlm_demo.engine.scheduling.scheduler import Room, RowState


@dataclass(eq=False)
class Row:
    """One request while it is in the running batch."""

    request: Request
    streamer: RowStreamer
    beam: Search | None = None  # set for a stage-beam candidate
    place: Placement | None = None
    written: int = 0  # how many of its answer's tokens its pages hold (as of its last step)


@dataclass
class StepInputs:
    """One decode step's inputs, on the device."""

    input_ids: torch.Tensor  # [rows] long
    positions: torch.Tensor  # [rows] long
    write_pages: torch.Tensor  # [rows] long: where each row's new keys/values go
    write_offsets: torch.Tensor  # [rows] long
    row_mask: torch.Tensor  # [rows] model dtype: 0 for a row that sees no tile
    layout: Layout


class RunningRows:
    """The rows of the next decode step and their sampling state; the engine thread's alone."""

    def __init__(self, pool: PagePool, attention: PagedAttention, device: torch.device, dtype: torch.dtype) -> None:
        self.pool = pool
        self.shape = pool.shape
        self.table = PageTable(pool)
        self.attention = attention
        self.device = device
        self.dtype = dtype
        self.rows: list[Row] = []
        self.next_tokens: torch.Tensor | None = None  # [rows] long: each row's next input
        self.sampling: RowSampling | None = None
        self.staging = Staging(device)
        self._mask: tuple[tuple[int, int], torch.Tensor] | None = None  # the rows' MLP mask, until rows change
        # who the rows are: a new number whenever rows join or leave (the attention's kept inputs follow it)
        self.version = next(VERSIONS)
        # Byte counters (the metrics of the same names).
        self.written_bytes = 0  # keys/values written for generated tokens
        self.read_bytes = 0  # keys/values and image states the decode steps' attention read
        self.live_bytes = 0  # the rows' own tokens and tiles among those

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cached_tokens(self) -> int:
        """Text tokens the rows hold (what their pages are spent on)."""
        return sum(row.place.length for row in self.rows if row.place is not None)

    def stats(self) -> dict[str, int]:
        """The pool's figures for ``EngineStats`` (the byte totals are the ``vlm_*_bytes_total`` counters)."""
        pool = self.pool
        return {
            "cached_token_slots": self.cached_tokens,
            "cached_bytes": pool.used_pages * self.shape.page_bytes,
            "kv_pages": pool.pages,
            "kv_pages_free": pool.free_pages,
            "kv_page_bytes": self.shape.page_bytes,
            "picture_states_bytes": self.table.picture_bytes,
            "pictures_shared": self.table.pictures_shared,
            "kv_copied_bytes": self.table.copied_bytes,  # rows joining, leaving or handed back copy nothing
            "kv_written_bytes": self.written_bytes,
            "attention_read_bytes": self.read_bytes,
            "attention_live_bytes": self.live_bytes,
        }

    # ---- what the plan sees ----------------------------------------------------------------------
    def room(self, rows_allowed: int, cache_pages: int, token_budget: int) -> Room:
        """The batch's room at this boundary (``cache_pages``: what the image-state cache can give back)."""
        free, needed = self.pool.free_pages, self.pages_needed()
        return Room(len(self.rows), rows_allowed, free, cache_pages, needed, self.table.newcomer_pages,
                    self.cached_tokens, token_budget)  # fmt: skip

    def states(self) -> list[RowState]:
        """Each row as the plan weighs it: whose it is, what it wrote, whether it may be handed back, and
        the pages it would give back (counted if the plan asks: that walks its page list)."""

        def own(place: Placement | None) -> Callable[[], int]:
            return lambda: self.table.owned(place)

        return [
            RowState(
                row.beam.request.client if row.beam is not None else row.request.client,
                len(row.streamer.ids),
                row.beam is None and row.request.visible and not row.streamer.done,
                own(row.place),
            )
            for row in self.rows
        ]

    def beyond(self, pages: int) -> list[Row]:
        """The newest rows that need a page for their next token, past the first ``pages`` of them."""
        return [r for r in self.rows if r.place is not None and self.table.opens_page(r.place)][pages:]

    def pages_needed(self) -> int:
        """Pages the next step takes: one for each row whose new token opens a page."""
        return self.table.growth([row.place for row in self.rows])

    # ---- placing caches ------------------------------------------------------------------------
    def place(self, prefill: Prefill, index: list[int]) -> list[Placement] | None:
        """Write rows ``index`` of a prefill into fresh pages (``None``, nothing taken, when too few are free)."""
        return prefill_pages.place(self.table, self.staging, self.dtype, prefill, index)

    def snapshot(self, index: int) -> Snapshot:
        """Row ``index``'s cache kept aside (its pages shared) up to its answer's last token, which is the
        snapshot's next input — whether or not a step already wrote it (the engine runs a step ahead of
        rendering text, so a row that ends at its stop text was often in one more step)."""
        row = self.rows[index]
        assert row.place is not None and row.streamer.ids
        ids = row.streamer.ids
        (last,) = self.staging.send([np.asarray([ids[-1]], dtype=np.int64)], persist=True)
        return self.table.snapshot(row.place, row.place.length - row.written + len(ids) - 1, last)

    # ---- joining and leaving -------------------------------------------------------------------
    def join(self, rows: list[Row], places: list[Placement], first_tokens: torch.Tensor, sampling: RowSampling) -> None:
        """Newcomers (their caches already placed) join after the running rows."""
        for row, place in zip(rows, places, strict=True):
            row.place = place
            row.written = max(0, len(row.streamer.ids) - 1) if row.streamer is not None else 0
        tokens = first_tokens.to(self.device)
        if not self.rows:
            self.next_tokens, self.sampling = tokens, sampling
        else:
            assert self.next_tokens is not None and self.sampling is not None
            self.next_tokens = torch.cat([self.next_tokens, tokens])
            self.sampling = self.sampling.cat(sampling)
        self.rows.extend(rows)
        self.version = next(VERSIONS)

    def keep(self, keep: list[int]) -> None:
        """Drop every row not listed: their pages go back to the pool; nobody else's cache moves."""
        if len(keep) == len(self.rows):
            return
        kept = set(keep)
        for i, row in enumerate(self.rows):
            if i not in kept and row.place is not None:
                self.table.release(row.place)
                row.place = None
        self.version = next(VERSIONS)
        if not keep:
            self.rows, self.next_tokens, self.sampling = [], None, None
            return
        assert self.next_tokens is not None and self.sampling is not None
        (index,) = self.staging.send([np.asarray(keep, dtype=np.int64)])
        self.next_tokens = self.next_tokens.index_select(0, index)
        self.sampling = self.sampling.select(keep, index)
        self.rows = [self.rows[i] for i in keep]

    # ---- the step ------------------------------------------------------------------------------
    def step_inputs(self, pad_to: int | None = None) -> StepInputs:
        """The next step's inputs: every row writes its next token at position ``length`` (taking a page
        when it opens one; the plan made sure enough are free) and attends to ``length + 1`` tokens. With
        ``pad_to``, inert rows follow up to that many (a CUDA graph's size): they write into the pool's null
        pages and read only those. The attention kernel builds what it reads from the rows' pages (and may run
        the rows in another order: its layout then says where each one went)."""
        s, page = self.shape, self.shape.page_tokens
        places: list[Placement] = [row.place for row in self.rows]  # type: ignore[misc]
        for row in self.rows:
            if row.streamer is not None:
                row.written = len(row.streamer.ids)  # the step writes its next input: its newest token
        self.table.grow(places)
        real = len(places)
        n = max(real, pad_to or 0)
        order = self.attention.order(places, n, self.version, self.staging)
        if order is not None:
            places = [places[i] for i in order.rank]
        if n > real:
            places += self.table.inert(n - real)
        lengths = np.fromiter((p.length for p in places), dtype=np.int64, count=n)
        write_pages = np.fromiter((p.pages[-1] for p in places), dtype=np.int64, count=n)  # the new token's page
        step = StepRows(places, real, lengths, self.version, self.staging, order.restore if order else None)
        (positions, w_pages, w_offsets), layout = self.attention.prepare(step, [lengths, write_pages, lengths % page])
        read_text, read_image = layout.read
        self.read_bytes += read_text * s.text_bytes_per_token + read_image * s.image_bytes_per_token
        seen = int(lengths[:real].sum()) + real
        self.live_bytes += seen * s.text_bytes_per_token + sum(step.image_tokens(s.patches)) * s.image_bytes_per_token
        self.written_bytes += real * s.text_bytes_per_token
        assert self.next_tokens is not None
        tokens = self.next_tokens if order is None else self.next_tokens.index_select(0, order.order)
        if n > real:
            tokens = torch.cat([tokens, tokens.new_zeros(n - real)])
        return StepInputs(tokens, positions, w_pages, w_offsets, self._row_mask(places), layout)

    def _row_mask(self, places: list[Placement]) -> torch.Tensor:
        """``[rows]`` of the model's dtype: 0 for a row that sees no tile (kept while the rows stay)."""
        key = (self.version, len(places))
        if self._mask is None or self._mask[0] != key:
            (sees,) = self.staging.send([np.asarray([p.sees_image for p in places], dtype=np.int64)], persist=True)
            self._mask = (key, sees.to(self.dtype))
        return self._mask[1]

    def advance(self, tokens: torch.Tensor) -> None:
        """After a step: each row holds one more token, and its next input is the one it just got (still on
        the device)."""
        for row in self.rows:
            assert row.place is not None
            row.place.length += 1
        self.next_tokens = tokens.to(self.device)

    def replace_next(self, tokens: dict[int, int]) -> None:
        """Give rows another next input than the token they sampled (row index -> token id): the stage
        structure's replacements, made before the token enters the cache."""
        assert self.next_tokens is not None
        index, values = self.staging.send(
            [np.asarray(list(tokens), np.int64), np.asarray(list(tokens.values()), np.int64)]
        )
        self.next_tokens = self.next_tokens.index_copy(0, index, values.to(self.next_tokens.dtype))
