"""The running rows: who takes part in the next decode step, where each one's cache lives, and the step's inputs.

Every row owns pages of the pool (:mod:`~vlm_demo.engine.pages`): text pages for its tokens, image pages
for the states of the tiles it sees. A newcomer's prefill (left-padded among the newcomers only) is
written into fresh pages; a leaver gives its pages back; a Think-harder candidate shares its start's
pages and copies at most one partly filled page. The rows' order in the step is a list on the host;
their keys and values never move.

The step's inputs are built on the host from the rows' page lists and lengths (no device reads) and
sent in one copy from a pinned staging buffer (``Staging``); the input tokens stay on the device from
the previous step's sampling. Image parts of the layout change only when rows join or leave, so they
are rebuilt only then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vlm_demo.engine.attention import (
    DENSE_BANDS,
    DENSE_PADDING,
    DENSE_ROWS,
    Band,
    Layout,
    PagedAttention,
    fewest_bands,
    live_mask,
)
from vlm_demo.engine.pages import PagePool
from vlm_demo.engine.request import Request
from vlm_demo.engine.sampler import RowSampling
from vlm_demo.engine.scheduler import Room, RowState
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


class Staging:
    """Host numbers to the device without waiting for it: each ``send`` packs its arrays into one pinned
    buffer (on CUDA) and makes one asynchronous copy. Sends go to fresh parts of the buffer until
    ``recycle``, which the engine calls right after a step's host read (every earlier copy is done then).
    ``persist`` returns device copies of their own, for tensors that outlive the step."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.long) -> None:
        self.device = device
        self.dtype = dtype
        self.cursor = 0
        self._host = torch.empty(0, dtype=dtype)
        self._device = self._host

    def send(self, parts: list[np.ndarray], persist: bool = False) -> list[torch.Tensor]:
        if self.device.type == "cpu":  # the host's memory is the device's: the arrays themselves, no copy
            kind, own = self._host.numpy().dtype, np.array if persist else np.ascontiguousarray
            return [torch.from_numpy(own(p, dtype=kind)) for p in parts]
        sizes = [int(p.size) for p in parts]
        total = sum(sizes)
        if self.cursor + total > self._host.numel():
            room = max(self.cursor + total, 2 * self._host.numel(), 4096)
            self._host = torch.empty(room, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            self._device = (
                self._host if self.device.type == "cpu" else torch.empty(room, dtype=self.dtype, device=self.device)
            )
            self.cursor = 0
        start = self.cursor
        host = self._host.numpy()
        for part, size in zip(parts, sizes, strict=True):
            host[start : start + size] = np.asarray(part).reshape(-1)
            start += size
        if self._device is not self._host:
            self._device[self.cursor : start].copy_(self._host[self.cursor : start], non_blocking=True)
        out, at = [], self.cursor
        for part, size in zip(parts, sizes, strict=True):
            view = self._device[at : at + size].view(np.asarray(part).shape)
            out.append(view.clone() if persist else view)
            at += size
        self.cursor = start
        return out

    def recycle(self) -> None:
        self.cursor = 0


@dataclass
class ImageLayout:
    """The image part of a step's layout, kept while the rows stay the same (pictures do not grow)."""

    rows: int
    width: int  # image pages in the widest row
    table: torch.Tensor  # [rows, width] int32 (the fast kernel's)
    lengths: torch.Tensor  # [rows] int32
    tile_pages: torch.Tensor  # [tiles, patches] long (the reference's)
    tile_offsets: torch.Tensor
    tile_rows: torch.Tensor
    row_mask: torch.Tensor  # [rows] model dtype: 0 for a row that sees no tile
    slots: torch.Tensor | None  # [tiles] long: the dense reference's scratch slot of each tile
    mask: torch.Tensor | None  # [rows, 1, 1, widest tiles × patches]: the dense reference's mask (0 or -inf)
    most: int  # tiles of the widest row (the dense reference's line)


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
        self._images: ImageLayout | None = None  # the layout's image part, until rows change
        self._order: tuple[tuple[int, int], list[int] | None, torch.Tensor | None, torch.Tensor | None] | None = None
        self._banding: _Banding | None = None  # the bands the last step ran
        self.version = 0  # counts the changes of who the rows are (the attention's kept lines follow it)
        self._page_columns = torch.arange(pool.shape.page_tokens, device=device)
        self._range = self._page_columns  # ``_columns``
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
        self._images = None
        self.version += 1

    def keep(self, keep: list[int]) -> None:
        """Drop every row not listed: their pages go back to the pool; nobody else's cache moves."""
        if len(keep) == len(self.rows):
            return
        kept = set(keep)
        for i, row in enumerate(self.rows):
            if i not in kept and row.place is not None:
                self.pool.release(row.place.pages + row.place.image_pages)
                row.place = None
        self._images = None
        self.version += 1
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
        pages and read only those. Where the reference's dense lines may run, the step takes its rows longest
        first (their order only changes when rows join or leave: all grow a token a step), and the layout
        says where each row went."""
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
        dense = self.attention.kernel != "flash" and n <= DENSE_ROWS
        rank, order, restore = self._step_order(places, n) if dense else (None, None, None)
        if rank is not None:
            places = [places[i] for i in rank]
        if n > real:
            null = self.pool.null_pages()
            places += [Placement(null[:1], 0, null[1:], 1, False) for _ in range(n - real)]
        lengths = np.fromiter((p.length for p in places), dtype=np.int64, count=n)
        write_pages = np.fromiter((p.pages[-1] for p in places), dtype=np.int64, count=n)  # the new token's page
        seen = lengths + 1
        used = -(-seen // page)  # each row's pages (its last one takes the new token)
        width = int(used.max())
        images = self._image_layout(places)
        tiles = [p.tiles * s.patches for p in places[:real]]
        read_text, read_image = self.attention.read_tokens(seen[:real].tolist(), tiles)
        bands = None  # the dense reference's bands of rows, where they pay: then they read their lines whole
        if images.mask is not None:
            per_token = (s.text_bytes_per_token, s.image_bytes_per_token)
            image_lines = real * images.mask.shape[-1]
            exact = np.dot((read_text, read_image), per_token)
            bands = self._bands(
                used, real, (DENSE_PADDING * exact - image_lines * per_token[1]) / (per_token[0] * page)
            )
            if bands is not None:
                read_text = page * sum((min(b.stop, real) - b.start) * b.width for b in bands)
                read_image = image_lines
        self.read_bytes += read_text * s.text_bytes_per_token + read_image * s.image_bytes_per_token
        self.live_bytes += int(seen[:real].sum()) * s.text_bytes_per_token + sum(tiles) * s.image_bytes_per_token
        self.written_bytes += real * s.text_bytes_per_token
        offsets = lengths % page
        if self.attention.kernel == "flash":  # the kernel reads the tables: one row of page numbers per row
            starts = np.arange(n + 1, dtype=np.int64)
            positions, w_pages, w_offsets, text_table, text_lengths, starts = self.staging.send(
                [lengths, write_pages, offsets, _table([p.pages for p in places], width), seen, starts]
            )
            layout = Layout(n, max_text=width * page, max_image=images.width * s.image_page_tokens,
                            text_table=text_table.int(), text_lengths=text_lengths.int(), query_starts=starts.int(),
                            image_table=images.table, image_lengths=images.lengths)  # fmt: skip
        else:  # the reference gathers pages: the blocks each row reads, and how much of each is its own
            layout = Layout(n, max_text=width * page, max_image=images.width * s.image_page_tokens,
                            tile_pages=images.tile_pages, tile_offsets=images.tile_offsets, tile_rows=images.tile_rows,
                            image_epoch=(self.version, n), restore=restore)  # fmt: skip
            if bands is not None:
                # one product per band over lines of blocks: each row's line, its new token's slot, its live tokens
                line = np.empty(n, dtype=np.int64)  # where each row's line starts
                for band in bands:
                    line[band.start : band.stop] = band.base + band.room * np.arange(band.stop - band.start)
                layout.text_epoch = (self.version, n, *(b.room for b in bands), *(b.stop for b in bands))
                sent = [lengths, write_pages, offsets, seen, line + lengths // page]
                if not self.attention.lines_kept(layout.text_epoch):  # the lines are gathered: where blocks go
                    blocks, owners, columns = _blocks(places, used, width)
                    sent += [blocks, line[owners] + columns]
                positions, w_pages, w_offsets, seen_t, layout.write_slots, *gather = self.staging.send(sent)
                if gather:
                    layout.text_pages, layout.text_slots = gather
                mask = live_mask(self._columns(bands[0].width * page), seen_t, self.dtype)
                layout.text_masks = tuple(
                    mask[b.start : b.stop, ..., : b.width * page] if len(bands) > 1 else mask for b in bands
                )
                layout.text_bands = bands
                layout.tile_slots, layout.image_masks = images.slots, (images.mask,)
                layout.image_bands = (Band(0, n, images.most, images.most, 0),)
            else:  # per block: its row, and which of its tokens are the row's
                blocks, owners, columns = _blocks(places, used, width)
                valid = np.minimum(page, seen[owners] - page * columns)
                positions, w_pages, w_offsets, layout.text_pages, layout.text_rows, valid_counts = self.staging.send(
                    [lengths, write_pages, offsets, blocks, owners, valid]
                )
                layout.text_valid = self._page_columns[None, :] < valid_counts[:, None]
        assert self.next_tokens is not None
        tokens = self.next_tokens if order is None else self.next_tokens.index_select(0, order)
        if n > real:
            tokens = torch.cat([tokens, tokens.new_zeros(n - real)])
        return StepInputs(tokens, positions, w_pages, w_offsets, images.row_mask, layout)

    def _columns(self, count: int) -> torch.Tensor:
        """``arange(count)`` on the device (kept, and grown as lines grow)."""
        if self._range.numel() < count:
            self._range = torch.arange(max(count, 2 * self._range.numel()), device=self.device)
        return self._range[:count]

    def _step_order(
        self, places: list[Any], n: int
    ) -> tuple[list[int] | None, torch.Tensor | None, torch.Tensor | None]:
        """The rows longest first (``None`` when they are in that order already): the engine's row of each step
        row (on the host and on the device), and the step row of each of the ``n`` rows (inert ones last); kept
        while the rows stay."""
        key = (self.version, n)
        if self._order is None or self._order[0] != key:
            order = sorted(range(len(places)), key=lambda i: -places[i].length)
            if order == sorted(order):
                self._order = (key, None, None, None)
            else:
                restore = np.concatenate([np.argsort(order), np.arange(len(places), n)])
                sent = self.staging.send([np.asarray(order, dtype=np.int64), restore], persist=True)
                self._order = (key, order, *sent)
        return self._order[1:]

    def _bands(self, used: np.ndarray, real: int, budget: float) -> tuple[Band, ...] | None:
        """The dense reference's bands over the step's rows (longest first; ``used``: each one's blocks), whose real
        rows' lines take at most ``budget`` blocks (``None``: none do). The last step's bands stay while they
        fit (their lines are kept); a band whose first row outgrew its room is given more (gathered again)."""
        key, kept = (self.version, len(used)), self._banding
        if kept is not None and kept.key == key:
            widths = used[kept.starts]
            if int(np.dot(kept.real_rows, widths)) <= budget:
                if not np.array_equal(widths, kept.widths):  # a band's first row opened a page
                    kept.widths = widths
                    kept.rooms = np.where(widths > kept.rooms, widths + np.maximum(2, widths // 4), kept.rooms)
                    kept.bands = _lay_out(kept.starts, kept.sizes, widths, kept.rooms)
                return kept.bands
        chosen = fewest_bands(used[:real].tolist(), budget, DENSE_BANDS)
        if chosen is None:
            self._banding = None
            return None
        sizes = np.asarray(chosen, dtype=np.int64)
        sizes[-1] += len(used) - real  # the inert rows ride in the last band
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        widths = used[starts]
        rooms = widths + np.maximum(2, widths // 4)  # room to grow a few pages without a new gather
        real_rows = np.minimum(starts + sizes, real) - starts
        self._banding = _Banding(key, starts, sizes, real_rows, widths, rooms, _lay_out(starts, sizes, widths, rooms))
        return self._banding.bands

    def _image_layout(self, places: list[Any]) -> ImageLayout:
        """The image part of the layout and the rows' MLP masks (rebuilt when rows join or leave)."""
        if self._images is not None and self._images.rows == len(places):
            return self._images
        s = self.shape
        n = len(places)
        width = max(1, max(len(p.image_pages) for p in places))
        table = _table([p.image_pages for p in places], width)
        tile_pages, tile_offsets, tile_rows, tile_slots = [], [], [], []
        tokens = np.arange(s.patches)
        most = max(1, max(p.tiles for p in places))
        for r, place in enumerate(places):
            pages = np.asarray(place.image_pages, dtype=np.int64)
            for t in range(place.tiles):
                at = t * s.patches + tokens
                tile_pages.append(pages[at // s.image_page_tokens])
                tile_offsets.append(at % s.image_page_tokens)
                tile_rows.append(r)
                tile_slots.append(r * most + t)
        lengths = np.asarray([p.tiles * s.patches for p in places], dtype=np.int64)
        empty = np.zeros((0, s.patches), dtype=np.int64)
        parts = [
            table,
            lengths,
            np.stack(tile_pages) if tile_pages else empty,
            np.stack(tile_offsets) if tile_offsets else empty,
            np.asarray(tile_rows, dtype=np.int64),
            np.asarray([p.sees_image for p in places], dtype=np.int64),
            np.asarray(tile_slots, dtype=np.int64),
        ]
        table_t, lengths_t, pages_t, offsets_t, rows_t, mask_t, slots_t = self.staging.send(
            parts, persist=True
        )  # outlive the step
        dense = self.attention.kernel != "flash" and n <= DENSE_ROWS
        self._images = ImageLayout(n, width, table_t.int(), lengths_t.int(), pages_t, offsets_t, rows_t,
                                   mask_t.to(self.dtype), slots_t if dense else None,
                                   live_mask(self._columns(most * s.patches), lengths_t, self.dtype) if dense else None, most)  # fmt: skip
        return self._images

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


@dataclass
class _Banding:
    """The bands the last step ran (kept while the rows stay and they fit the padding allowed)."""

    key: tuple[int, int]  # the rows' version, and the step's rows
    starts: np.ndarray
    sizes: np.ndarray
    real_rows: np.ndarray  # the rows of each band that are not inert
    widths: np.ndarray  # each band's first row's blocks
    rooms: np.ndarray
    bands: tuple[Band, ...]


def _lay_out(starts: np.ndarray, sizes: np.ndarray, widths: np.ndarray, rooms: np.ndarray) -> tuple[Band, ...]:
    """The bands, one after the other in the lines (each row of a band ``room`` blocks)."""
    bases = np.concatenate([[0], np.cumsum(sizes * rooms)[:-1]])
    return tuple(
        Band(int(a), int(a + n), int(w), int(r), int(b)) for a, n, w, r, b in zip(starts, sizes, widths, rooms, bases)
    )


def _table(pages: list[list[int]], width: int) -> np.ndarray:
    """``[rows, width]``: each row's pages, left-aligned (unused entries 0)."""
    table = np.zeros((len(pages), width), dtype=np.int64)
    for r, own in enumerate(pages):
        table[r, : len(own)] = own
    return table


def _blocks(places: list[Any], used: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The text blocks the step's rows read (each row's first ``used`` pages, row by row): their pages, rows and
    columns."""
    owners, columns = np.nonzero(np.arange(width)[None, :] < used[:, None])
    return _table([p.pages for p in places], width)[owners, columns], owners, columns


def _addresses(pages: list[int], tokens: int, per_page: int) -> np.ndarray:
    """``[2, tokens]``: the page and offset of each of a row's first ``tokens`` tokens."""
    at = np.arange(tokens)
    return np.stack([np.asarray(pages, dtype=np.int64)[at // per_page], at % per_page])
