"""The reference decode attention: torch operations any device runs (the CPU's kernel, and the GPU's last resort).

Keys and values are gathered block by block — a text page, or an image tile — so it reads whole text pages (at
most ``page_tokens - 1`` tokens of slack per row) and exactly the tiles' tokens. Up to ``DENSE_ROWS`` rows the
step runs its rows longest first, cut into at most ``DENSE_BANDS`` *bands* of neighbouring rows (the fewest
whose padding costs little: all the bands' lines read at most ``DENSE_PADDING`` times the rows' own blocks). A
band's rows' blocks are placed in a dense batch of lines (row ``r``'s blocks in its own line, the rest of the
line masked), and one fused product runs per band and layer: its work and its reads are the band's rows × its
longest row. Each layer keeps its lines between steps while the layout's ``epoch`` holds (the same rows, the
same bands, each band within the room it was given to grow): the step's new keys/values are written into them
as into the pool, so a step gathers from the pool only after rows joined or left or a band outgrew its room
(kept up to ``HELD_BYTES``; past that one scratch batch is gathered again every layer). Otherwise the softmax
runs per block and combines per row by its maximum (split-KV, as flash-decoding does): many more operations, no
padding; its text blocks are gathered every step (head-major, for the products), its tiles only when rows change
(kept within the same ``HELD_BYTES``).

What each step reads is counted from the layout on the host (the dense lines whole, padding included), and its
gathers are the working memory the memory plan reserves for it (``working_bytes``).

An fp8 pool (``--kv-cache-dtype fp8``) is gathered as stored, with its scales, and only the gathered blocks are
widened to the model's dtype (values × their token's and head's scale); the lines kept between steps hold widened
values, and the step's new token is written into them as the pool now holds it (dequantised), so kept lines stay
what a fresh gather would give.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vlm_demo.engine.executor.attention.base import PagedAttention, StepOrder, StepRows, table
from vlm_demo.engine.executor.staging import Staging
from vlm_demo.engine.kv.pages import PageShape, dequantize

DENSE_ROWS = 16  # up to this many rows the reference attention takes masked products over lines (few operations)
# ... when the lines (each as long as its band's longest row) read at most this much more than the rows' blocks
DENSE_PADDING = 1.15
DENSE_BANDS = 4  # ... in at most this many bands of rows (each band one product per layer)
HELD_BYTES = 256 * 2**20  # the dense reference's lines kept between steps, at most (all layers together)


@dataclass(frozen=True)
class Band:
    """The step's rows ``start:stop`` in dense lines ``width`` blocks long, each line given ``room`` blocks (so it
    can grow without being gathered again), from block ``base`` of the layer's lines."""

    start: int
    stop: int
    width: int
    room: int
    base: int

    @property
    def blocks(self) -> int:
        return (self.stop - self.start) * self.room


@dataclass
class _Lines:
    """One layer's gathered keys and values, and the placement they hold (``None``: scratch): the dense batch of
    lines, or the block-by-block softmax's tiles (``[tiles, kv heads, patches, dim]``)."""

    keys: torch.Tensor  # [rows × width, block tokens, kv heads, dim]
    values: torch.Tensor
    epoch: tuple[int, ...] | None
    # (base, rows, room) -> a band's keys and values as the product takes them, [rows, kv heads, room tokens, dim]
    views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def live_mask(columns: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, 1, 1, columns]``: 0 on each row's first ``lengths[r]`` tokens, minus infinity past them (the dense
    reference's mask, added to the scores; ``columns``: ``arange`` of the line's tokens). Built once a step: a
    boolean mask is turned into this by every product."""
    live = columns[None, :] < lengths[:, None]
    return torch.where(live, 0.0, float("-inf")).to(dtype)[:, None, None]


def split_softmax(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                  valid: torch.Tensor | None, count: int, scale: float) -> torch.Tensor:  # fmt: skip
    """Attention of ``count`` rows' queries ``[count, kv heads, group, dim]`` over ragged blocks of keys.

    ``keys``/``values`` are ``[blocks, kv heads, tokens, dim]``; ``rows[b]`` is block ``b``'s row and
    ``valid`` masks tokens that are not the row's (``None``: all are). Each block's scores are
    normalised by the row's maximum, then summed per row: the exact softmax, computed block-wise. Each
    block's products are its own (a batched product per block), and a row's blocks are summed in their
    order, so a row's result does not depend on the other rows'."""
    q = query.index_select(0, rows)  # [blocks, kv heads, group, dim]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [blocks, kv heads, group, tokens]
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    block_max = scores.amax(dim=-1)  # [blocks, kv heads, group]
    row_max = torch.full((count, *block_max.shape[1:]), float("-inf"), dtype=scores.dtype, device=scores.device)
    row_max = row_max.scatter_reduce(0, rows[:, None, None].expand_as(block_max), block_max, "amax")
    weights = torch.exp(scores - row_max.index_select(0, rows)[..., None])
    total = torch.zeros_like(row_max).index_add_(0, rows, weights.sum(dim=-1))
    mixed = torch.matmul(weights, values)  # [blocks, kv heads, group, dim]
    out = torch.zeros((count, *mixed.shape[1:]), dtype=mixed.dtype, device=mixed.device).index_add_(0, rows, mixed)
    return out / total[..., None]


@dataclass
class ReferenceLayout:
    """The reference's gather plan for one step: text blocks are pages, image blocks are tiles."""

    rows: int
    read: tuple[int, int]
    restore: torch.Tensor | None  # [rows] long: where each engine row ran in the step (None: in order)
    tile_pages: torch.Tensor  # [tiles, patches] long: the page of every image-state token of a tile
    tile_offsets: torch.Tensor  # [tiles, patches] long
    tile_rows: torch.Tensor  # [tiles] long
    image_epoch: tuple[int, ...]  # which rows' tiles these are (the gathered tiles are kept while it holds)
    # Per block (no bands): its page, its row, and which of its tokens are the row's.
    text_pages: torch.Tensor | None = None  # [blocks] long
    text_rows: torch.Tensor | None = None  # [blocks] long
    text_valid: torch.Tensor | None = None  # [blocks, page tokens] bool
    # Up to DENSE_ROWS rows: the bands, where each block goes in the lines, and which of its tokens are live.
    text_bands: tuple[Band, ...] | None = None  # None: the block-by-block softmax
    # [blocks] long: the block's line block (its band's base + row × room + column); with ``text_pages``, only
    # on a step whose lines are gathered (not kept from the last step)
    text_slots: torch.Tensor | None = None
    # Each band's mask, [band rows, 1, 1, width × page tokens]: 0 on the row's own tokens, else -inf.
    text_masks: tuple[torch.Tensor, ...] | None = None
    image_bands: tuple[Band, ...] | None = None
    tile_slots: torch.Tensor | None = None  # [tiles] long: row × the widest row's tiles + the tile
    image_masks: tuple[torch.Tensor, ...] | None = None  # [rows, 1, 1, tiles × patches] (one band), as ``text_masks``
    # Which blocks sit where in the dense lines: equal epochs, equal placement (the lines can be kept).
    text_epoch: tuple[int, ...] | None = None
    write_slots: torch.Tensor | None = None  # [rows] long: the line block that takes each row's new token


@dataclass
class _Images:
    """The image part of the gather plan, kept while the rows stay the same (pictures do not grow)."""

    key: tuple[int, int]
    tile_pages: torch.Tensor
    tile_offsets: torch.Tensor
    tile_rows: torch.Tensor
    slots: torch.Tensor | None  # [tiles] long: each tile's slot in the dense lines (up to DENSE_ROWS rows)
    mask: torch.Tensor | None  # [rows, 1, 1, widest tiles × patches]: the dense lines' mask (0 or -inf)
    most: int  # tiles of the widest row (the dense line)


class ReferenceAttention(PagedAttention):
    """The reference kernel: gathers, and products over them."""

    name = "reference"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        device = next(iter(self.pool.keys.values())).device
        self._held: dict[int, _Lines] = {}  # layer -> the dense lines it keeps between steps
        self._tiles: dict[int, _Lines] = {}  # cross layer -> its rows' tiles gathered head-major, one block per tile
        self._scratch: dict[tuple[int, ...], _Lines] = {}  # one batch of lines for layers that keep none
        self._order: tuple[tuple[int, int], StepOrder | None] | None = None
        self._banding: _Banding | None = None  # the bands the last step ran
        self._images: _Images | None = None
        self._page_columns = torch.arange(self.shape.page_tokens, device=device)
        self._range = self._page_columns  # ``_columns``

    # ---- the step's inputs ----------------------------------------------------------------------
    def order(self, places: list[Any], rows: int, version: int, staging: Staging) -> StepOrder | None:
        """Up to ``DENSE_ROWS`` rows, longest first (``None`` when they are in that order already); kept while the
        rows stay (their order only changes when rows join or leave: all grow a token a step)."""
        if rows > DENSE_ROWS:
            return None
        key = (version, rows)
        if self._order is None or self._order[0] != key:
            rank = sorted(range(len(places)), key=lambda i: -places[i].length)
            if rank == sorted(rank):
                self._order = (key, None)
            else:
                restore = np.concatenate([np.argsort(rank), np.arange(len(places), rows)])
                order, back = staging.send([np.asarray(rank, dtype=np.int64), restore], persist=True)
                self._order = (key, StepOrder(rank, order, back))
        return self._order[1]

    def prepare(self, step: StepRows, common: list[np.ndarray]) -> tuple[list[torch.Tensor], ReferenceLayout]:
        s, page = self.shape, self.shape.page_tokens
        places, n, real = step.places, len(step.places), step.real
        seen, used = step.seen, step.used(page)
        width = int(used.max())
        images = self._image_part(step)
        tiles = step.image_tokens(s.patches)
        read_text, read_image = int(used[:real].sum()) * page, sum(tiles)
        bands = None  # the bands of rows, where they pay: then they read their lines whole
        if images.mask is not None:
            per_token = (s.text_bytes_per_token, s.image_bytes_per_token)
            image_lines = real * images.mask.shape[-1]
            exact = np.dot((read_text, read_image), per_token)
            bands = self._bands(
                used, real, step.version, (DENSE_PADDING * exact - image_lines * per_token[1]) / (per_token[0] * page)
            )
            if bands is not None:
                read_text = page * sum((min(b.stop, real) - b.start) * b.width for b in bands)
                read_image = image_lines
        layout = ReferenceLayout(n, (read_text, read_image), step.restore, images.tile_pages, images.tile_offsets,
                                 images.tile_rows, (step.version, n))  # fmt: skip
        lengths = step.lengths
        if bands is not None:
            # one product per band over lines of blocks: each row's line, its new token's slot, its live tokens
            line = np.empty(n, dtype=np.int64)  # where each row's line starts
            for band in bands:
                line[band.start : band.stop] = band.base + band.room * np.arange(band.stop - band.start)
            layout.text_epoch = (step.version, n, *(b.room for b in bands), *(b.stop for b in bands))
            sent = [*common, seen, line + lengths // page]
            if not self.lines_kept(layout.text_epoch):  # the lines are gathered: where blocks go
                blocks, owners, columns = _blocks(places, used, width)
                sent += [blocks, line[owners] + columns]
            got, k = step.staging.send(sent), len(common)
            front, (seen_t, layout.write_slots), gather = got[:k], got[k : k + 2], got[k + 2 :]
            if gather:
                layout.text_pages, layout.text_slots = gather
            mask = live_mask(self._columns(bands[0].width * page), seen_t, self.shape.dtype)
            layout.text_masks = tuple(
                mask[b.start : b.stop, ..., : b.width * page] if len(bands) > 1 else mask for b in bands
            )
            layout.text_bands = bands
            layout.tile_slots, layout.image_masks = images.slots, (images.mask,)  # type: ignore[assignment]
            layout.image_bands = (Band(0, n, images.most, images.most, 0),)
        else:  # per block: its row, and which of its tokens are the row's
            blocks, owners, columns = _blocks(places, used, width)
            valid = np.minimum(page, seen[owners] - page * columns)
            *front, layout.text_pages, layout.text_rows, valid_counts = step.staging.send(
                [*common, blocks, owners, valid]
            )
            layout.text_valid = self._page_columns[None, :] < valid_counts[:, None]
        return front, layout

    def _columns(self, count: int) -> torch.Tensor:
        """``arange(count)`` on the device (kept, and grown as lines grow)."""
        if self._range.numel() < count:
            self._range = torch.arange(max(count, 2 * self._range.numel()), device=self._range.device)
        return self._range[:count]

    def _bands(self, used: np.ndarray, real: int, version: int, budget: float) -> tuple[Band, ...] | None:
        """The bands over the step's rows (longest first; ``used``: each one's blocks), whose real rows' lines take
        at most ``budget`` blocks (``None``: none do). The last step's bands stay while they fit (their lines are
        kept); a band whose first row outgrew its room is given more (gathered again)."""
        key, kept = (version, len(used)), self._banding
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

    def _image_part(self, step: StepRows) -> _Images:
        """The image part of the gather plan (rebuilt when rows join or leave)."""
        key = (step.version, len(step.places))
        if self._images is not None and self._images.key == key:
            return self._images
        s, places = self.shape, step.places
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
            lengths,
            np.stack(tile_pages) if tile_pages else empty,
            np.stack(tile_offsets) if tile_offsets else empty,
            np.asarray(tile_rows, dtype=np.int64),
            np.asarray(tile_slots, dtype=np.int64),
        ]
        lengths_t, pages_t, offsets_t, rows_t, slots_t = step.staging.send(parts, persist=True)  # outlive the step
        dense = len(places) <= DENSE_ROWS
        mask = live_mask(self._columns(most * s.patches), lengths_t, s.dtype) if dense else None
        self._images = _Images(key, pages_t, offsets_t, rows_t, slots_t if dense else None, mask, most)
        return self._images

    @classmethod
    def working_bytes(cls, shape: PageShape, heads: int, rows: int, tiles: int, tokens: int) -> int:
        """The largest layer's gathers at ``rows`` rows: a cross layer's tiles (keys and values, gathered then made
        head-major: three copies at the peak) and its scores and weights; or a self layer's pages, likewise."""
        keys = max(tiles * shape.patches, shape.text_pages(tokens) * shape.page_tokens)
        return rows * keys * (3 * shape.token_elements + 3 * heads) * shape.dtype.itemsize

    # ---- the step's two attentions ----------------------------------------------------------------
    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, layout: ReferenceLayout) -> None:  # fmt: skip
        """A self-attention layer's new keys/values ``[rows, kv heads, dim]`` into the pool, and into the dense
        lines this layer keeps for the layout (so they stay what a gather would give: fp8's dequantised values)."""
        keys, values = self.pool.write(layer, (pages, offsets), keys, values)
        held = self._held.get(layer)
        if held is None:
            return
        if held.epoch is not None and held.epoch == layout.text_epoch:
            held.keys.index_put_((layout.write_slots, offsets), keys)
            held.values.index_put_((layout.write_slots, offsets), values)
        else:  # a step that does not use them: they miss this token from now on
            held.epoch = None

    def self_attention(self, layer: int, query: torch.Tensor, layout: ReferenceLayout) -> torch.Tensor:
        """``[rows, heads, dim]`` queries over each row's text tokens -> ``[rows, heads × dim]``."""
        pages: torch.Tensor = layout.text_pages  # type: ignore[assignment]  # set for every step with text rows
        if layout.text_bands is not None:
            lines = self._lines(layer, layout.text_epoch, layout.text_slots, layout.text_bands, self.shape.page_tokens,  # type: ignore[arg-type]
                                lambda: self._gather(layer, lambda t: t.index_select(0, pages)))  # fmt: skip
            return self._dense(query, lines, layout.text_masks, layout.text_bands)  # type: ignore[arg-type]
        gathered_k, gathered_v = self._gather(layer, lambda t: t.transpose(1, 2).index_select(0, pages))
        return self._reference(query, gathered_k, gathered_v, layout.text_rows, layout.text_valid, layout.rows)  # type: ignore[arg-type]

    def _gather(self, layer: int, pick: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``pick`` of the layer's keys and values (a gather; it takes ``[pages, tokens, kv heads, …]``), widened to the
        model's dtype with the same gather of their scales where the pool is fp8."""
        keys, values = pick(self.pool.keys[layer]), pick(self.pool.values[layer])
        if not self.shape.scaled:
            return keys, values
        dtype = self.shape.dtype
        key_scales, value_scales = pick(self.pool.key_scales[layer]), pick(self.pool.value_scales[layer])
        return dequantize(keys, key_scales, dtype), dequantize(values, value_scales, dtype)

    def cross_attention(self, layer: int, query: torch.Tensor, layout: ReferenceLayout) -> torch.Tensor:
        """``[rows, heads, dim]`` queries over each row's image-state tokens -> ``[rows, heads × dim]``."""
        where = (layout.tile_pages, layout.tile_offsets)
        if layout.image_bands is not None:
            lines = self._lines(layer, layout.image_epoch, layout.tile_slots, layout.image_bands, self.shape.patches,  # type: ignore[arg-type]
                                lambda: self._gather(layer, lambda t: t[where]))  # fmt: skip
            return self._dense(query, lines, layout.image_masks, layout.image_bands)  # type: ignore[arg-type]
        tiles = self._tiles.get(layer)
        if tiles is None or layout.image_epoch is None or tiles.epoch != layout.image_epoch:  # kept while rows stay
            keys, values = (t.transpose(1, 2).contiguous() for t in self._gather(layer, lambda t: t[where]))
            tiles = _Lines(keys, values, layout.image_epoch)
            self._tiles.pop(layer, None)
            if layout.image_epoch is not None and self._kept_bytes() + 2 * tiles.keys.nbytes <= HELD_BYTES:
                self._tiles[layer] = tiles
        return self._reference(query, tiles.keys, tiles.values, layout.tile_rows, None, layout.rows)

    def _dense(self, query: torch.Tensor, lines: _Lines, masks: tuple[torch.Tensor, ...],
               bands: tuple[Band, ...]) -> torch.Tensor:  # fmt: skip
        """One fused attention per band over its rows' lines (the query heads of a key/value head as its query
        length); the bands' rows follow each other, so their outputs are the step's rows in order."""
        rows, heads, dim = query.shape[0], self.shape.kv_heads, self.shape.head_dim
        block = lines.keys.shape[1]
        q = query.view(rows, heads, self.group, dim)
        outs = []
        for band, mask in zip(bands, masks, strict=True):
            count = band.stop - band.start
            where = (band.base, count, band.room)
            k, v = lines.views.get(where) or lines.views.setdefault(where, tuple(  # type: ignore[arg-type]
                t[band.base : band.base + band.blocks].view(count, -1, heads, dim).transpose(1, 2)
                for t in (lines.keys, lines.values)
            ))  # fmt: skip
            if band.width < band.room:  # the lines' room to grow is not read
                k, v = k[:, :, : band.width * block], v[:, :, : band.width * block]
            qb = q if count == rows else q[band.start : band.stop]
            outs.append(F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=self.scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(rows, self.heads * dim).to(query.dtype)

    def lines_kept(self, epoch: tuple[int, ...]) -> bool:
        """Whether every self-attention layer keeps its lines for this placement (then the step need not say where
        the blocks are: nothing is gathered)."""
        return all(self._kept(layer, epoch) is not None for layer in self.shape.self_layers)

    def _kept(self, layer: int, epoch: tuple[int, ...] | None) -> _Lines | None:
        """The lines this layer keeps, if they hold this placement."""
        held = self._held.get(layer)
        return held if held is not None and epoch is not None and held.epoch == epoch else None

    def _lines(self, layer: int, epoch: tuple[int, ...] | None, slots: torch.Tensor, bands: tuple[Band, ...],
               block: int, gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> _Lines:  # fmt: skip
        """This layer's dense lines for the layout: the ones it kept if they hold this ``epoch``, else the blocks
        ``gather`` reads from the pool placed at ``slots`` (of the bands' blocks; a slot no row fills keeps
        finite old values, which the mask hides)."""
        kept = self._kept(layer, epoch)
        if kept is not None:
            return kept
        held = self._held.get(layer)
        assert slots is not None, "the step said its lines were kept, so it did not say where the blocks are"
        keys, values = gather()
        shape = (bands[-1].base + bands[-1].blocks, block, *keys.shape[2:])
        if held is None or held.keys.shape != shape or held.keys.dtype != keys.dtype or held.keys.device != keys.device:
            size = 2 * keys[:1, :1].nbytes * shape[0] * block
            self._held.pop(layer, None)
            if epoch is None or self._kept_bytes() + size > HELD_BYTES:  # not kept: one scratch batch for every layer
                held = self._scratch.get(shape)
                if held is None or held.keys.dtype != keys.dtype or held.keys.device != keys.device:
                    held = _Lines(keys.new_zeros(shape), keys.new_zeros(shape), None)
                    self._scratch = {shape: held}
                epoch = None
            else:
                held = _Lines(keys.new_zeros(shape), keys.new_zeros(shape), None)
        held.keys.index_copy_(0, slots, keys)
        held.values.index_copy_(0, slots, values)
        held.epoch = epoch
        held.views.clear()  # a new placement: the bands' views are made again as asked (they do not pile up)
        if epoch is not None:
            self._held[layer] = held
        return held

    def _kept_bytes(self) -> int:
        """What the reference keeps between steps: dense lines and gathered tiles (at most ``HELD_BYTES``)."""
        lines = sum(2 * h.keys.nbytes for h in self._held.values() if h.epoch is not None)
        return lines + sum(2 * t.keys.nbytes for t in self._tiles.values())

    def _reference(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                   valid: torch.Tensor | None, count: int) -> torch.Tensor:  # fmt: skip
        q = query.view(count, self.shape.kv_heads, self.group, self.shape.head_dim)
        out = split_softmax(q, keys, values, rows, valid, count, self.scale)
        return out.reshape(count, self.heads * self.shape.head_dim).to(query.dtype)


def fewest_bands(used: list[int], budget: float, most: int) -> list[int] | None:
    """How many rows each band takes: the fewest bands (at most ``most``) of rows sorted longest first whose lines
    (each band's rows × its first row's ``used`` blocks) take at most ``budget`` blocks, the fewest blocks among
    those; ``None`` when no such split exists."""
    n = len(used)
    if n == 0:
        return []
    best: list[float] = [0.0] + [float("inf")] * n  # least blocks for the first j rows in the bands so far
    cuts: list[list[int]] = []
    for _ in range(most):
        nxt, cut = [float("inf")] * (n + 1), [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j):
                blocks = best[i] + (j - i) * used[i]
                if blocks < nxt[j]:
                    nxt[j], cut[j] = blocks, i
        best = nxt
        cuts.append(cut)
        if best[n] <= budget:
            sizes, j = [], n
            for cut in reversed(cuts):
                sizes.append(j - cut[j])
                j = cut[j]
            return sizes[::-1]
    return None


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


def _blocks(places: list[Any], used: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The text blocks the step's rows read (each row's first ``used`` pages, row by row): their pages, rows and
    columns."""
    owners, columns = np.nonzero(np.arange(width)[None, :] < used[:, None])
    return table([p.pages for p in places], width)[owners, columns], owners, columns
