"""The running rows: who takes part in the next decode step, where each one's cache lives, and the step's inputs.

Every row owns pages of the pool (:mod:`~vlm_demo.engine.pages`): text pages for its tokens, image pages
for the states of the tiles it sees. A newcomer's prefill (left-padded among the newcomers only) is
written into fresh pages; a leaver gives its pages back; a Think-harder candidate shares its start's
pages and copies at most one partly filled page. The rows' order in the step is a list on the host;
their keys and values never move.

The step's inputs are built on the host from the rows' page lists and lengths (no device reads) — what
the attention reads by the attention kernel itself (:mod:`~vlm_demo.engine.attention`) — and sent in one
copy from a pinned staging buffer (:mod:`~vlm_demo.engine.staging`); the input tokens stay on the device
from the previous step's sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vlm_demo.engine.attention import VERSIONS, Layout, PagedAttention, StepRows
from vlm_demo.engine.pages import PagePool
from vlm_demo.engine.request import Request
from vlm_demo.engine.sampler import RowSampling
from vlm_demo.engine.scheduler import Room, RowState
from vlm_demo.engine.staging import Staging
from vlm_demo.engine.streamer import RowStreamer
from vlm_demo.errors import DemoError


class CandidateOwner(Protocol):
    """The stage-beam search a row is a candidate of (:class:`~vlm_demo.engine.beam.StageBeam`)."""

    request: Request  # the visitor's request

    def candidate_done(self, row: Row, snapshot: Snapshot | None) -> None: ...

    def restart_stage(self, error: DemoError) -> None: ...


@dataclass(eq=False)
class Placement:
    """Where one row's cache is: its pages (the last one may be partly filled) and its image pages."""

    pages: list[int]
    length: int  # tokens in its text pages (= the position of its next input)
    image_pages: list[int]
    tiles: int  # tiles whose image states it holds
    sees_image: bool  # False: no tile is visible (the model then attends evenly to all, and skips the MLP)


@dataclass(eq=False)
class Row:
    """One request while it is in the running batch."""

    request: Request
    streamer: RowStreamer
    beam: CandidateOwner | None = None  # set for a stage-beam candidate
    place: Placement | None = None
    written: int = 0  # how many of its answer's tokens its pages hold (as of its last step)


@dataclass
class Prefill:
    """Newcomers prefilled together (``Worker.prefill``): left-padded among themselves, as a dynamic batch."""

    cache: Any  # transformers DynamicCache: [n, kv heads, L, dim] per self layer, every tile's states per cross layer
    logits: torch.Tensor  # [n, vocab] float32 at each row's last prompt position
    attention_mask: torch.Tensor  # [n, L] bool, False for left padding
    lengths: list[int]  # each row's real prompt tokens
    tiles: torch.Tensor  # [n, max tiles] bool (host): the tiles each row's next token sees


@dataclass(eq=False)
class Snapshot:
    """A row's cache kept aside (a Think-harder search's start or a stage's winner): shared pages, no copy.

    The holder must ``release`` it. ``logits`` (after a prefill) or ``next_token`` (after a step) is what
    its forks continue from."""

    place: Placement
    pool: PagePool
    logits: torch.Tensor | None = None  # [1, vocab]
    next_token: torch.Tensor | None = None  # [1]
    released: bool = False

    @property
    def length(self) -> int:
        return self.place.length

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.release(self.place.pages + self.place.image_pages)


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
        self.copied_bytes = 0  # keys/values moved because rows joined, left or were preempted
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
            "kv_copied_bytes": self.copied_bytes,
            "kv_written_bytes": self.written_bytes,
            "attention_read_bytes": self.read_bytes,
            "attention_live_bytes": self.live_bytes,
        }

    # ---- what the plan sees ----------------------------------------------------------------------
    def room(self, rows_allowed: int, cache_pages: int, token_budget: int) -> Room:
        """The batch's room at this boundary (``cache_pages``: what the image-state cache can give back)."""
        shape = self.shape

        def pages_for(request: Request) -> int:
            return shape.row_pages(request.input_tokens + 1, request.tiles)

        free, needed = self.pool.free_pages, self.pages_needed()
        return Room(
            len(self.rows), rows_allowed, free, cache_pages, needed, pages_for, self.cached_tokens, token_budget
        )

    def states(self) -> list[RowState]:
        """Each row as the plan weighs it: whose it is, what it wrote, whether it may be handed back, and
        the pages it would give back (counted if the plan asks: that walks its page list)."""
        owners = self.pool.owners

        def own(place: Placement | None) -> Callable[[], int]:
            return lambda: sum(owners(p) == 1 for p in place.pages + place.image_pages) if place else 0

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
        page = self.shape.page_tokens
        needing = [r for r in self.rows if r.place is not None and r.place.length == page * len(r.place.pages)]
        return needing[pages:]

    # ---- placing caches ------------------------------------------------------------------------
    def pages_for(self, prefill: Prefill, index: int) -> int:
        tiles = int(prefill.tiles[index].sum()) or prefill.tiles.shape[1]
        return self.shape.row_pages(prefill.lengths[index], tiles)

    def place(self, prefill: Prefill, index: list[int]) -> list[Placement] | None:
        """Write rows ``index`` of a prefill into fresh pages (``None``, nothing taken, when too few are free)."""
        if sum(self.pages_for(prefill, i) for i in index) > self.pool.free_pages:
            return None
        s = self.shape
        places, text, image = [], [], []
        width, tiles_max = prefill.attention_mask.shape[1], prefill.tiles.shape[1]
        text_source, tile_source = [], []
        for j, i in enumerate(index):
            length, seen = prefill.lengths[i], prefill.tiles[i]
            shown = np.nonzero(seen.numpy())[0] if bool(seen.any()) else np.arange(tiles_max)
            place = Placement(self.pool.take(s.text_pages(length)) or [], length, [], len(shown), bool(seen.any()))
            place.image_pages = self.pool.take(s.image_pages(place.tiles * s.patches)) or []
            text.append(_addresses(place.pages, length, s.page_tokens))
            image.append(_addresses(place.image_pages, place.tiles * s.patches, s.image_page_tokens))
            text_source.append(j * width + np.arange(width - length, width))  # its real (right-aligned) tokens
            tile_source.append(j * tiles_max + shown)
            places.append(place)
        where = [np.concatenate(text, axis=1), np.concatenate(image, axis=1), np.concatenate(text_source),
                 np.concatenate(tile_source)]  # fmt: skip
        self._write_prefill(prefill, index, where)
        return places

    def _write_prefill(self, prefill: Prefill, index: list[int], where: list[np.ndarray]) -> None:
        """Every layer's keys/values of those rows into their pages: real tokens only, seen tiles only."""
        sent: dict[str, list[torch.Tensor]] = {}
        rows = np.asarray(index, dtype=np.int64)
        for layer, cached in enumerate(prefill.cache.layers):
            device = cached.keys.device
            if str(device) not in sent:
                staging = self.staging if device == self.device else Staging(device)
                sent[str(device)] = staging.send([rows, *where])
            picked, text, image, text_source, tile_source = sent[str(device)]
            cross = layer in self.shape.cross_layers
            target = image if cross else text
            pool_device = self.pool.keys[layer].device
            keys, values = (
                _tokens(
                    t.index_select(0, picked), tile_source if cross else text_source, self.shape.patches if cross else 0
                ).to(pool_device, self.dtype)
                for t in (cached.keys, cached.values)
            )
            self.pool.write(layer, (target[0].to(pool_device), target[1].to(pool_device)), keys, values)

    def fork(self, snapshot: Snapshot, count: int) -> list[Placement] | None:
        """``count`` rows continuing from a snapshot: its full pages and image pages shared, its partly filled
        last page copied into a page of each row's own (``None`` when the pool lacks those pages)."""
        base = snapshot.place
        partial = base.length % self.shape.page_tokens
        if partial and count > self.pool.free_pages:
            return None
        places = []
        for _ in range(count):
            full = base.pages[:-1] if partial else list(base.pages)
            self.pool.share(full + base.image_pages)
            pages = full
            if partial:
                own = self.pool.take(1)
                assert own is not None
                self.pool.copy_page(base.pages[-1], own[0], partial, text=True)
                self.copied_bytes += partial * self.shape.text_bytes_per_token
                pages = full + own
            places.append(Placement(pages, base.length, list(base.image_pages), base.tiles, base.sees_image))
        return places

    def snapshot(self, index: int) -> Snapshot:
        """Row ``index``'s cache kept aside (its pages shared) up to its answer's last token, which is the
        snapshot's next input — whether or not a step already wrote it (the engine runs a step ahead of
        rendering text, so a row that ends at its stop text was often in one more step)."""
        row = self.rows[index]
        place = row.place
        assert place is not None and row.streamer.ids
        ids = row.streamer.ids
        length = place.length - row.written + len(ids) - 1
        pages = place.pages[: -(-length // self.shape.page_tokens)]
        kept = Placement(list(pages), length, list(place.image_pages), place.tiles, place.sees_image)
        self.pool.share(kept.pages + kept.image_pages)
        (last,) = self.staging.send([np.asarray([ids[-1]], dtype=np.int64)], persist=True)
        return Snapshot(kept, self.pool, next_token=last)

    def keep_aside(self, place: Placement, logits: torch.Tensor | None) -> Snapshot:
        """A placement nobody runs yet (a search's prompt) as a snapshot: the pages are handed over, not shared."""
        return Snapshot(place, self.pool, logits=logits)

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
                self.pool.release(row.place.pages + row.place.image_pages)
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
    def pages_needed(self) -> int:
        """Pages the next step takes: one for each row whose new token opens a page."""
        page = self.shape.page_tokens
        return sum(1 for row in self.rows if row.place is not None and row.place.length == page * len(row.place.pages))

    def step_inputs(self, pad_to: int | None = None) -> StepInputs:
        """The next step's inputs: every row writes its next token at position ``length`` (taking a page
        when it opens one; the plan made sure enough are free) and attends to ``length + 1`` tokens. With
        ``pad_to``, inert rows follow up to that many (a CUDA graph's size): they write into the pool's null
        pages and read only those. The attention kernel builds what it reads from the rows' pages (and may run
        the rows in another order: its layout then says where each one went)."""
        s, page = self.shape, self.shape.page_tokens
        places: list[Any] = [row.place for row in self.rows]
        for row in self.rows:
            if row.streamer is not None:
                row.written = len(row.streamer.ids)  # the step writes its next input: its newest token
        for place in places:
            assert place is not None
            if place.length == page * len(place.pages):
                taken = self.pool.take(1)
                if taken is None:
                    raise RuntimeError("no free page for the next token (the plan should have made room)")
                place.pages += taken
        real = len(places)
        n = max(real, pad_to or 0)
        order = self.attention.order(places, n, self.version, self.staging)
        if order is not None:
            places = [places[i] for i in order.rank]
        if n > real:
            null = self.pool.null_pages()
            places += [Placement(null[:1], 0, null[1:], 1, False) for _ in range(n - real)]
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

    def _row_mask(self, places: list[Any]) -> torch.Tensor:
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


def _tokens(cached: torch.Tensor, source: torch.Tensor, patches: int) -> torch.Tensor:
    """``[rows, heads, L, dim]`` cached keys or values -> ``[tokens, heads, dim]``: the ``source`` tokens (flat
    row-major indices), or with ``patches`` the ``source`` tiles' tokens (image states: ``L`` = tiles × patches)."""
    rows, heads, _, dim = cached.shape
    if patches:
        tiles = cached.view(rows, heads, -1, patches, dim).permute(0, 2, 3, 1, 4).reshape(-1, patches, heads, dim)
        return tiles.index_select(0, source).reshape(-1, heads, dim)
    return cached.transpose(1, 2).reshape(-1, heads, dim).index_select(0, source)


def _addresses(pages: list[int], tokens: int, per_page: int) -> np.ndarray:
    """``[2, tokens]``: the page and offset of each of a row's first ``tokens`` tokens."""
    at = np.arange(tokens)
    return np.stack([np.asarray(pages, dtype=np.int64)[at // per_page], at % per_page])
