"""Cache bookkeeping for continuous batching: one left-padded batch that rows join and leave.

The running batch keeps, per layer, self-attention keys/values of shape ``[B, heads, T, dim]``
(rows left-padded to the common length ``T``) and cross-attention keys/values of the image,
``[B, heads, vision_tokens, dim]``, plus the 2-D attention mask, each row's next position, its
next input token and its cross-attention mask row. A joining row (prefilled alone) is padded to
``T`` (or the batch is padded to the row's length); leaving rows are dropped with ``index_select``
and columns that became padding for every row are trimmed, so memory follows the live rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_demo.engine.request import Request
from vlm_demo.engine.streamer import RowStreamer


@dataclass(eq=False)
class Row:
    """One request while it is in the running batch."""

    request: Request
    streamer: RowStreamer
    generator: torch.Generator | None  # None for greedy rows


def _pad_left(tensor: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
    if columns <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


@dataclass
class RunningBatch:
    cross_layers: frozenset[int]
    rows: list[Row] = field(default_factory=list)
    cache: Any = None  # a transformers DynamicCache shared by all rows
    attention_mask: torch.Tensor | None = None  # [B, T] long
    positions: torch.Tensor | None = None  # [B] position id of each row's next input token
    next_tokens: torch.Tensor | None = None  # [B] each row's next input token
    cross_mask: torch.Tensor | None = None  # [B, 1, images, tiles]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return 0 if self.attention_mask is None else int(self.attention_mask.shape[1])

    @property
    def cached_slots(self) -> int:
        """Token slots held in the self-attention cache, padding included (what memory is spent on)."""
        return len(self.rows) * self.length

    def join(self, row: Row, cache: Any, prompt_length: int, cross_mask: torch.Tensor, first_token: int) -> None:
        """Merge a row prefilled alone (batch of one, no padding) into the running batch."""
        device = cross_mask.device
        mask = torch.ones(1, prompt_length, dtype=torch.long, device=device)
        position = torch.tensor([prompt_length], device=device)
        token = torch.tensor([first_token], device=device)
        if not self.rows:
            self.rows, self.cache, self.attention_mask = [row], cache, mask
            self.positions, self.next_tokens, self.cross_mask = position, token, cross_mask
            return
        width = max(self.length, prompt_length)
        grow, pad_new = width - self.length, width - prompt_length
        for index, (old, new) in enumerate(zip(self.cache.layers, cache.layers, strict=False)):
            if index in self.cross_layers:  # image states: same length for every row
                old.keys = torch.cat([old.keys, new.keys], dim=0)
                old.values = torch.cat([old.values, new.values], dim=0)
            else:
                old.keys = torch.cat([_pad_left(old.keys, grow, 2), _pad_left(new.keys, pad_new, 2)], dim=0)
                old.values = torch.cat([_pad_left(old.values, grow, 2), _pad_left(new.values, pad_new, 2)], dim=0)
        self.attention_mask = torch.cat([_pad_left(self.attention_mask, grow, 1), _pad_left(mask, pad_new, 1)], dim=0)
        self.positions = torch.cat([self.positions, position])
        self.next_tokens = torch.cat([self.next_tokens, token])
        self.cross_mask = torch.cat([self.cross_mask, cross_mask], dim=0)
        self.rows.append(row)

    def step_inputs(self) -> dict[str, Any]:
        """Model inputs for one decode step of every row; extends the mask by the new column."""
        assert self.attention_mask is not None
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(self.rows), 1)], dim=1)
        return {
            "input_ids": self.next_tokens[:, None],
            "attention_mask": self.attention_mask,
            "position_ids": self.positions[:, None],
            "cross_attention_mask": self.cross_mask,
            "cache": self.cache,
            "use_cache": True,
        }

    def advance(self, tokens: torch.Tensor) -> None:
        self.positions = self.positions + 1
        self.next_tokens = tokens

    def keep(self, keep: list[int]) -> None:
        """Drop every row not listed; trim columns that are padding for all remaining rows."""
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.attention_mask = [], None, None
            self.positions = self.next_tokens = self.cross_mask = None
            return
        index = torch.tensor(keep, device=self.attention_mask.device)
        mask = self.attention_mask.index_select(0, index)
        first = int(mask.any(dim=0).long().argmax())  # first column some remaining row uses
        for layer_index, layer in enumerate(self.cache.layers):
            keys = layer.keys.index_select(0, index)
            values = layer.values.index_select(0, index)
            if layer_index not in self.cross_layers:
                keys, values = keys[:, :, first:].contiguous(), values[:, :, first:].contiguous()
            layer.keys, layer.values = keys, values
        self.attention_mask = mask[:, first:].contiguous()
        self.positions = self.positions.index_select(0, index)
        self.next_tokens = self.next_tokens.index_select(0, index)
        self.cross_mask = self.cross_mask.index_select(0, index)
        self.rows = [self.rows[i] for i in keep]
