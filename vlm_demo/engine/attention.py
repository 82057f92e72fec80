"""Decode-step attention over the page pool: each row reads its own tokens and its own tiles, nothing else.

A padded batch makes every row read as many keys as the longest one, and every picture four tiles of
image states. Here a step's rows are ragged: row ``r`` attends to ``text_lengths[r]`` tokens spread
over its pages (its new token included) and to the image-state tokens of the tiles it sees.

Two kernels, one contract (``Layout`` in, ``[rows, heads × head dim]`` out):

- ``reference``: torch operations any device runs (the CPU's path, and the GPU's when the fast kernel is
  missing). Keys and values are gathered block by block — a text page, or an image tile — so it reads
  whole text pages (at most ``page_tokens - 1`` tokens of slack per row) and exactly the tiles' tokens.
  Up to ``DENSE_ROWS`` rows the step runs its rows longest first, cut into at most ``DENSE_BANDS`` *bands*
  of neighbouring rows (the fewest whose padding costs little: all the bands' lines read at most
  ``DENSE_PADDING`` times the rows' own blocks). A band's rows' blocks are placed in a dense batch of lines
  (row ``r``'s blocks in its own line, the rest of the line masked), and one fused product runs per band and
  layer: its work and its reads are the band's rows × its longest row. Each layer keeps its lines between
  steps while the layout's ``epoch`` holds (the same rows, the same bands, each band within the room it was
  given to grow): the step's new keys/values are written into them as into the pool, so a step gathers from
  the pool only after rows joined or left or a band outgrew its room (kept up to ``HELD_BYTES``; past that
  one scratch batch is gathered again every layer). Otherwise the softmax runs per block and combines per
  row by its maximum (split-KV, as flash-decoding does): many more operations, no padding; its text blocks
  are gathered every step (head-major, for the products), its tiles only when rows change (kept within the
  same ``HELD_BYTES``).
- ``flash``: FlashAttention's paged variable-length kernel from torch itself
  (``aten._flash_attention_forward`` with a block table and per-row key counts), on CUDA in 16-bit
  floats; it reads exactly each row's live tokens in place. It is used only when this torch has it
  and it agrees with the reference on a probe at start (else the reference runs, and the log says so).

What each step read is counted from the layout on the host (the dense reference's whole lines, padding
included), for the ``vlm_attention_read_bytes_total`` and ``vlm_attention_live_bytes_total`` counters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vlm_demo.engine.pages import PagePool

log = logging.getLogger(__name__)

DENSE_ROWS = 16  # up to this many rows the reference attention takes masked products over lines (few operations)
# ... when the lines (each as long as its band's longest row) read at most this much more than the rows' blocks
DENSE_PADDING = 1.15
DENSE_BANDS = 4  # ... in at most this many bands of rows (each band one product per layer)
HELD_BYTES = 256 * 2**20  # the dense reference's lines kept between steps, at most (all layers together)


@dataclass
class Layout:
    """Where every row's keys are, for one decode step: what the chosen kernel reads (device tensors, built on
    the host from the rows' page lists), the other kernel's fields left ``None``."""

    rows: int
    max_text: int = 0  # the table's columns × page tokens (a static bound for the fast kernel)
    max_image: int = 0
    # FlashAttention's paged kernel: block tables and lengths.
    text_table: torch.Tensor | None = None  # [rows, pages] int32: each row's text pages (unused entries 0)
    text_lengths: torch.Tensor | None = None  # [rows] int32: tokens each row attends to (its new one included)
    image_table: torch.Tensor | None = None  # [rows, pages] int32
    image_lengths: torch.Tensor | None = None  # [rows] int32
    query_starts: torch.Tensor | None = None  # [rows + 1] int32: 0, 1, 2 … (one query per row)
    # The reference's gather plan: text blocks are pages, image blocks are tiles.
    text_pages: torch.Tensor | None = None  # [blocks] long
    text_rows: torch.Tensor | None = None  # [blocks] long: the row each block belongs to
    text_valid: torch.Tensor | None = None  # [blocks, page tokens] bool: which tokens of the page are the row's
    tile_pages: torch.Tensor | None = None  # [tiles, patches] long: the page of every image-state token of a tile
    tile_offsets: torch.Tensor | None = None  # [tiles, patches] long
    tile_rows: torch.Tensor | None = None  # [tiles] long
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
    image_epoch: tuple[int, ...] | None = None
    write_slots: torch.Tensor | None = None  # [rows] long: the line block that takes each row's new token
    # The step runs its rows longest first: where each of the engine's rows is in the step (None: in order).
    restore: torch.Tensor | None = None  # [rows] long


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


def _flash_available() -> bool:
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    return torch.cuda.is_available() and "block_table" in schema and "seqused_k" in schema


class PagedAttention:
    """Self- and cross-attention of one decode step over the pool, with the kernel chosen at start."""

    def __init__(self, pool: PagePool, heads: int, scale: float, kernel: str = "auto") -> None:
        self.pool = pool
        self.shape = pool.shape
        self.heads = heads
        self.group = heads // self.shape.kv_heads
        self.scale = scale
        devices = {t.device.type for t in pool.keys.values()}
        wanted = kernel
        if kernel == "auto":
            wanted = "flash" if devices == {"cuda"} and self.shape.dtype != torch.float32 else "reference"
        if wanted == "flash" and not (_flash_available() and self._probe()):
            log.warning("FlashAttention's paged kernel is not usable here; decode attention runs the reference")
            wanted = "reference"
        self.kernel = wanted
        self._held: dict[int, _Lines] = {}  # layer -> the dense lines it keeps between steps
        self._tiles: dict[int, _Lines] = {}  # cross layer -> its rows' tiles gathered head-major, one block per tile
        self._scratch: dict[tuple[int, ...], _Lines] = {}  # one batch of lines for layers that keep none

    # ---- the step's two attentions ------------------------------------------------------------
    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, layout: Layout) -> None:  # fmt: skip
        """A self-attention layer's new keys/values ``[rows, kv heads, dim]`` into the pool, and into the dense
        lines this layer keeps for the layout (so they stay what a gather would give)."""
        self.pool.write(layer, (pages, offsets), keys, values)
        held = self._held.get(layer)
        if held is None:
            return
        if held.epoch is not None and held.epoch == layout.text_epoch:
            held.keys.index_put_((layout.write_slots, offsets), keys)  # type: ignore[arg-type]
            held.values.index_put_((layout.write_slots, offsets), values)  # type: ignore[arg-type]
        else:  # a step that does not use them: they miss this token from now on
            held.epoch = None

    def self_attention(self, layer: int, query: torch.Tensor, layout: Layout) -> torch.Tensor:
        """``[rows, heads, dim]`` queries over each row's text tokens -> ``[rows, heads × dim]``."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        if self.kernel == "flash":
            return self._flash(query, keys, values, layout.text_table, layout.text_lengths, layout.max_text,
                               layout.query_starts)  # fmt: skip
        pages = layout.text_pages
        if layout.text_bands is not None:
            lines = self._lines(layer, layout.text_epoch, layout.text_slots, layout.text_bands, keys.shape[1],  # type: ignore[arg-type]
                                lambda: (keys.index_select(0, pages), values.index_select(0, pages)))  # fmt: skip
            return self._dense(query, lines, layout.text_masks, layout.text_bands)  # type: ignore[arg-type]
        gathered_k, gathered_v = (
            keys.transpose(1, 2).index_select(0, pages),
            values.transpose(1, 2).index_select(0, pages),
        )
        return self._reference(query, gathered_k, gathered_v, layout.text_rows, layout.text_valid, layout.rows)

    def cross_attention(self, layer: int, query: torch.Tensor, layout: Layout) -> torch.Tensor:
        """``[rows, heads, dim]`` queries over each row's image-state tokens -> ``[rows, heads × dim]``."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        if self.kernel == "flash":
            return self._flash(query, keys, values, layout.image_table, layout.image_lengths, layout.max_image,
                               layout.query_starts)  # fmt: skip
        where = (layout.tile_pages, layout.tile_offsets)
        if layout.image_bands is not None:
            lines = self._lines(layer, layout.image_epoch, layout.tile_slots, layout.image_bands, self.shape.patches,  # type: ignore[arg-type]
                                lambda: (keys[where], values[where]))  # fmt: skip
            return self._dense(query, lines, layout.image_masks, layout.image_bands)  # type: ignore[arg-type]
        tiles = self._tiles.get(layer)
        if tiles is None or layout.image_epoch is None or tiles.epoch != layout.image_epoch:  # kept while rows stay
            tiles = _Lines(*(t[where].transpose(1, 2).contiguous() for t in (keys, values)), layout.image_epoch)
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
            k, v = lines.views.get(where) or lines.views.setdefault(where, tuple(  # type: ignore[assignment]
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

    def _flash(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
               lengths: torch.Tensor, bound: int, starts: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        count = query.shape[0]
        starts = torch.arange(count + 1, dtype=torch.int32, device=query.device) if starts is None else starts
        # With a block table the kernel finds each row's keys through it and counts them by ``lengths``; the key
        # offsets it also takes are not read then, so the query offsets stand in for them.
        out = torch.ops.aten._flash_attention_forward(
            query, keys, values, starts, starts, 1, bound, 0.0, False, False,
            scale=self.scale, seqused_k=lengths, block_table=table,
        )[0]  # fmt: skip
        return out.reshape(count, self.heads * self.shape.head_dim)

    def _probe(self) -> bool:
        """The fast kernel on a small random case, against the reference (a torch without it, or a kernel
        that disagrees, leaves the reference in charge)."""
        try:
            layer = self.shape.self_layers[0]
            keys, values = self.pool.keys[layer], self.pool.values[layer]
            pages, page, device = min(3, keys.shape[0]), self.shape.page_tokens, keys.device
            saved = (keys[:pages].clone(), values[:pages].clone())
            keys[:pages].normal_()
            values[:pages].normal_()
            lengths = [page * pages - 5, 7]  # row 0 over pages 0..2 (the last one partly), row 1 over page 0
            table = torch.tensor([list(range(pages)), [0] * pages], dtype=torch.int32, device=device)
            query = torch.randn(2, self.heads, self.shape.head_dim, dtype=keys.dtype, device=device)
            starts = torch.arange(3, dtype=torch.int32, device=device)
            fast = self._flash(query, keys, values, table, torch.tensor(lengths, dtype=torch.int32, device=device),
                               pages * page, starts)  # fmt: skip
            blocks = torch.tensor([*range(pages), 0], device=device)
            owners = torch.tensor([0] * pages + [1], device=device)
            counts = torch.tensor([page] * (pages - 1) + [page - 5, 7], device=device)
            valid = torch.arange(page, device=device)[None, :] < counts[:, None]
            slow = self._reference(
                query, keys.transpose(1, 2).index_select(0, blocks), values.transpose(1, 2).index_select(0, blocks),
                owners, valid, 2,
            )  # fmt: skip
            keys[:pages].copy_(saved[0])
            values[:pages].copy_(saved[1])
            error = (fast.float() - slow.float()).abs().max().item()
            if error > 2e-2:
                log.warning("FlashAttention's paged kernel differs from the reference by %.3g", error)
                return False
            return True
        except Exception as exc:  # noqa: BLE001 - any failure here means: use the reference
            log.warning("FlashAttention's paged kernel failed its probe: %r", exc)
            return False

    # ---- accounting ---------------------------------------------------------------------------
    def read_tokens(self, text_lengths: list[int], image_tokens: list[int]) -> tuple[int, int]:
        """Text and image-state tokens this kernel reads for rows of these lengths (per layer), block by block
        (the dense reference's lines are counted where they are built, padding included)."""
        if self.kernel == "flash":
            return sum(text_lengths), sum(image_tokens)
        page = self.shape.page_tokens
        return sum(-(-n // page) * page for n in text_lengths), sum(image_tokens)


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
