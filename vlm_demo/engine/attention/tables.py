"""Block tables: the layout of the kernels that read each row's keys in place (``flash`` and ``triton``).

Each row's text pages and image pages in a table (one row of page numbers per row, ``int32``) and the tokens it
attends to in each: the kernel finds every key through the table, so it reads exactly the rows' own tokens, and
the layout has fixed shapes that a CUDA graph can replay from static buffers (``Tables.static``; a step's
tables are copied into their left columns, and the kernel is given the buffers' widths as its bounds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlm_demo.engine.attention.base import PagedAttention, StepRows, table


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

    @classmethod
    def static(cls, rows: int, text_width: int, image_width: int, bounds: tuple[int, int],
               device: torch.device) -> Tables:  # fmt: skip
        """Buffers for the most rows and the widest tables, allocated once (a CUDA graph's inputs)."""

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return cls(rows, *bounds, ints(rows, text_width), ints(rows), ints(rows, image_width), ints(rows))

    def fits(self, step: Tables) -> bool:
        """Whether a step's tables fit in these buffers."""
        return (
            step.rows <= self.rows
            and step.text_table.shape[1] <= self.text_table.shape[1]
            and step.image_table.shape[1] <= self.image_table.shape[1]
        )

    def view(self, rows: int, like: Tables | None = None) -> Tables:
        """The buffers' first ``rows`` rows, with ``like``'s bounds (a step run eagerly from the buffers) or the
        buffers' own (a step captured for any tables that fit)."""
        bounds = (like.max_text, like.max_image) if like is not None else (self.max_text, self.max_image)
        read = like.read if like is not None else (0, 0)
        return Tables(rows, *bounds, self.text_table[:rows], self.text_lengths[:rows], self.image_table[:rows],
                      self.image_lengths[:rows], read)  # fmt: skip

    def load(self, step: Tables) -> None:
        """Copy a step's tables in (into their left columns: columns past a row's pages are never read)."""
        n = step.rows
        self.text_table[:n, : step.text_table.shape[1]].copy_(step.text_table, non_blocking=True)
        self.text_lengths[:n].copy_(step.text_lengths, non_blocking=True)
        self.image_table[:n, : step.image_table.shape[1]].copy_(step.image_table, non_blocking=True)
        self.image_lengths[:n].copy_(step.image_lengths, non_blocking=True)

    def point_at(self, null: list[int]) -> None:
        """Every row at the pool's null pages (a text page, then a tile's image pages), one token each: what a graph
        is captured with (the pool's contents are not touched)."""
        self.text_table.fill_(null[0])
        self.image_table[:, : len(null) - 1].copy_(torch.tensor(null[1:], dtype=torch.int32))
        self.text_lengths.fill_(1)
        self.image_lengths.fill_(1)


class TableAttention(PagedAttention):
    """A kernel that reads block tables: builds them, and counts exactly the rows' own tokens as read."""

    graphable = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._images: tuple[tuple[int, int], torch.Tensor, torch.Tensor, int] | None = None

    def prepare(self, step: StepRows, common: list[np.ndarray]) -> tuple[list[torch.Tensor], Tables]:
        s, page = self.shape, self.shape.page_tokens
        width = int(step.used(page).max())
        *sent, text_table, text_lengths = step.staging.send(
            [*common, table([p.pages for p in step.places], width), step.seen]
        )
        image_table, image_lengths, image_width = self._image_tables(step)
        read = (int(step.seen[: step.real].sum()), sum(step.image_tokens(s.patches)))
        tables = Tables(len(step.places), width * page, image_width * s.image_page_tokens, text_table.int(),
                        text_lengths.int(), image_table, image_lengths, read)  # fmt: skip
        return sent, tables

    def _image_tables(self, step: StepRows) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The image part, kept while the rows stay the same (pictures do not grow)."""
        key = (step.version, len(step.places))
        if self._images is None or self._images[0] != key:
            width = max(1, max(len(p.image_pages) for p in step.places))
            lengths = np.asarray([p.tiles * self.shape.patches for p in step.places], dtype=np.int64)
            image_table, image_lengths = step.staging.send(
                [table([p.image_pages for p in step.places], width), lengths], persist=True
            )
            self._images = (key, image_table.int(), image_lengths.int(), width)
        return self._images[1:]

    def static(self, rows: int, text_width: int, image_width: int, device: torch.device) -> Tables:
        """Static tables for a CUDA graph (see ``Tables.static``)."""
        bounds = (text_width * self.shape.page_tokens, image_width * self.shape.image_page_tokens)
        return Tables.static(rows, text_width, image_width, bounds, device)
