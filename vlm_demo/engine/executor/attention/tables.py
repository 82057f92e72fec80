"""Block tables: the layout of the kernels that read each row's keys in place (``flash`` and ``triton``).

Each row's text pages and image pages in a table (one row of page numbers per row, ``int32``) and the tokens it
attends to in each: the kernel finds every key through the table, so it reads exactly the rows' own tokens, and
the layout has fixed shapes that a CUDA graph can replay from static buffers (``Tables.static``; a step's
tables are copied into their left columns, and the kernel is given the buffers' widths as its bounds).

**A picture read once for all its rows** (a kernel with ``cascade_slots``, the Triton one): rows whose image pages
are the same pages (rows showing one picture share them: :mod:`~vlm_demo.engine.kv.page_table`) are put in one
*picture row* of up to ``cascade_slots`` rows, and cross-attention runs over picture rows: one program per picture,
key/value head and split, with all its rows' query heads in one product (a cascade over the shared part, as
FlashInfer does for shared prefixes), so a step reads each picture's states once, not once per row. The picture
rows live in tables of the step's row count (a row that shares nothing is a picture row of its own; picture rows
past the pictures are empty), so the shapes do not depend on who shares, and a CUDA graph replays them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from vlm_demo.engine.executor.attention.base import PagedAttention, StepRows, table


@dataclass
class Tables:
    """One step's block tables (device tensors built on the host from the rows' page lists)."""

    rows: int
    max_text: int  # the text table's columns × page tokens: a static bound for the kernel
    max_image: int
    text_table: torch.Tensor  # [rows, pages] int32: each row's text pages (unused entries 0)
    text_lengths: torch.Tensor  # [rows] int32: tokens each row attends to (its new one included)
    image_table: torch.Tensor  # [rows, pages] int32
    image_lengths: torch.Tensor  # [rows] int32: image-state tokens (its tiles × patches)
    read: tuple[int, int] = (0, 0)
    restore: torch.Tensor | None = None  # the rows run in the engine's order
    # The cascade (``slots`` > 0): picture rows, each up to ``slots`` rows showing the same picture.
    slots: int = 0
    picture_table: torch.Tensor | None = None  # [rows, pages] int32: each picture row's image pages
    picture_lengths: torch.Tensor | None = None  # [rows] int32: its image-state tokens (0: an empty picture row)
    picture_slots: torch.Tensor | None = None  # [rows] long: each row's place, picture row × slots + its slot

    @classmethod
    def static(cls, rows: int, text_width: int, image_width: int, bounds: tuple[int, int], device: torch.device,
               slots: int = 0) -> Tables:  # fmt: skip
        """Buffers for the most rows and the widest tables, allocated once (a CUDA graph's inputs)."""

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        tables = cls(rows, *bounds, ints(rows, text_width), ints(rows), ints(rows, image_width), ints(rows))
        if slots:
            tables.slots, tables.picture_table, tables.picture_lengths = slots, ints(rows, image_width), ints(rows)
            tables.picture_slots = torch.arange(rows, dtype=torch.long, device=device) * slots
        return tables

    def fits(self, step: Tables) -> bool:
        """Whether a step's tables fit in these buffers."""
        return (
            step.rows <= self.rows
            and step.text_table.shape[1] <= self.text_table.shape[1]
            and step.image_table.shape[1] <= self.image_table.shape[1]
            and step.slots == self.slots
        )

    def view(self, rows: int, like: Tables | None = None) -> Tables:
        """The buffers' first ``rows`` rows, with ``like``'s bounds (a step run eagerly from the buffers) or the
        buffers' own (a step captured for any tables that fit)."""
        bounds = (like.max_text, like.max_image) if like is not None else (self.max_text, self.max_image)
        read = like.read if like is not None else (0, 0)
        view = Tables(rows, *bounds, self.text_table[:rows], self.text_lengths[:rows], self.image_table[:rows],
                      self.image_lengths[:rows], read)  # fmt: skip
        if self.slots:
            assert self.picture_table is not None and self.picture_lengths is not None
            assert self.picture_slots is not None
            view.slots, view.picture_table = self.slots, self.picture_table[:rows]
            view.picture_lengths, view.picture_slots = self.picture_lengths[:rows], self.picture_slots[:rows]
        return view

    def load(self, step: Tables) -> None:
        """Copy a step's tables in (into their left columns: columns past a row's pages are never read)."""
        n = step.rows
        self.text_table[:n, : step.text_table.shape[1]].copy_(step.text_table, non_blocking=True)
        self.text_lengths[:n].copy_(step.text_lengths, non_blocking=True)
        self.image_table[:n, : step.image_table.shape[1]].copy_(step.image_table, non_blocking=True)
        self.image_lengths[:n].copy_(step.image_lengths, non_blocking=True)
        if self.slots:
            mine, theirs = self.pictures(), step.pictures()
            mine[0][:n, : theirs[0].shape[1]].copy_(theirs[0], non_blocking=True)
            for buffer, tensor in zip(mine[1:], theirs[1:], strict=True):
                buffer[:n].copy_(tensor, non_blocking=True)

    def pictures(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cascade's table, lengths and row slots (the layout has them: ``slots`` > 0)."""
        assert self.picture_table is not None and self.picture_lengths is not None and self.picture_slots is not None
        return self.picture_table, self.picture_lengths, self.picture_slots

    def point_at(self, null: list[int]) -> None:
        """Every row at the pool's null pages (a text page, then a tile's image pages), one token each: what a graph
        is captured with (the pool's contents are not touched)."""
        self.text_table.fill_(null[0])
        self.image_table[:, : len(null) - 1].copy_(torch.tensor(null[1:], dtype=torch.int32))
        self.text_lengths.fill_(1)
        self.image_lengths.fill_(1)
        if self.slots:
            assert self.picture_table is not None and self.picture_lengths is not None
            self.picture_table[:, : len(null) - 1].copy_(torch.tensor(null[1:], dtype=torch.int32))
            self.picture_lengths.fill_(1)


class TableAttention(PagedAttention):
    """A kernel that reads block tables: builds them, and counts exactly the rows' own tokens as read (a shared
    picture once per picture row, where the kernel reads pictures in a cascade)."""

    graphable = True
    cascade_slots: ClassVar[int] = 0  # rows a picture row holds (0: every row reads its own picture)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._images: tuple[tuple[int, int], list[torch.Tensor], int, int] | None = None

    def prepare(self, step: StepRows, common: list[np.ndarray]) -> tuple[list[torch.Tensor], Tables]:
        s, page = self.shape, self.shape.page_tokens
        width = int(step.used(page).max())
        *sent, text_table, text_lengths = step.staging.send(
            [*common, table([p.pages for p in step.places], width), step.seen]
        )
        images, image_width, image_read = self._image_tables(step)
        read = (int(step.seen[: step.real].sum()), image_read)
        tables = Tables(len(step.places), width * page, image_width * s.image_page_tokens, text_table.int(),
                        text_lengths.int(), images[0], images[1], read)  # fmt: skip
        if self.cascade_slots:
            tables.slots = self.cascade_slots
            tables.picture_table, tables.picture_lengths, tables.picture_slots = images[2:]
        return sent, tables

    def _image_tables(self, step: StepRows) -> tuple[list[torch.Tensor], int, int]:
        """The image part (each row's tables, and the picture rows'), kept while the rows stay the same (pictures do
        not grow); with the image-state tokens the real rows read."""
        key = (step.version, len(step.places))
        if self._images is None or self._images[0] != key:
            places = step.places
            width = max(1, max(len(p.image_pages) for p in places))
            lengths = np.asarray([p.tiles * self.shape.patches for p in places], dtype=np.int64)
            arrays = [table([p.image_pages for p in places], width), lengths]
            read = int(lengths[: step.real].sum())
            if self.cascade_slots:
                pictures, slots, tiles = picture_rows(places, step.real, self.cascade_slots)
                read = tiles * self.shape.patches
                empty = len(places) - len(pictures)  # picture rows past the pictures: none of their keys is read
                arrays += [table([places[r].image_pages for r in pictures] + [[]] * empty, width),
                           np.pad(lengths[pictures], (0, empty)), slots]  # fmt: skip
            sent = step.staging.send(arrays, persist=True)
            ints = [t.int() for t in sent[:4]] + [t.long() for t in sent[4:]]
            self._images = (key, ints, width, read)
        return self._images[1], self._images[2], self._images[3]

    def static(self, rows: int, text_width: int, image_width: int, device: torch.device) -> Tables:
        """Static tables for a CUDA graph (see ``Tables.static``)."""
        bounds = (text_width * self.shape.page_tokens, image_width * self.shape.image_page_tokens)
        return Tables.static(rows, text_width, image_width, bounds, device, self.cascade_slots)


def picture_rows(places: list[Any], real: int, slots: int) -> tuple[list[int], np.ndarray, int]:
    """Rows gathered into picture rows: rows whose image pages are the same pages share one, up to ``slots`` rows
    each. Returns the row whose pages each picture row reads, each row's place (picture row × ``slots`` + its slot),
    and the tiles the picture rows that hold a real row read."""
    first: list[int] = []  # the row whose pages each picture row reads
    filled: list[int] = []  # rows each picture row holds so far
    open_row: dict[tuple[int, ...], int] = {}  # a picture's pages -> its latest picture row
    place = np.zeros(len(places), dtype=np.int64)
    for r, p in enumerate(places):
        pages = (p.tiles, *p.image_pages) if p.image_pages else (-1 - r,)  # a row without a picture shares nothing
        v = open_row.get(pages)
        if v is None or filled[v] == slots:
            v = open_row[pages] = len(first)
            first.append(r)
            filled.append(0)
        place[r] = v * slots + filled[v]
        filled[v] += 1
    holders = {int(place[r]) // slots for r in range(real)}
    return first, place, sum(places[first[v]].tiles for v in holders)
