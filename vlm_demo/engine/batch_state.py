"""Cache bookkeeping for continuous batching: one left-padded batch that rows join and leave.

The running batch keeps, per layer, self-attention keys/values of shape ``[B, heads, T, dim]``
(rows left-padded to the common length ``T``) and cross-attention keys/values of the image,
``[B, heads, vision_tokens, dim]``, plus the 2-D attention mask, each row's next position, its
next input token and its cross-attention masks (prepared once, when the row joins, in the form
the text model's layers take: the model would rebuild them from raw masks on every step). A
joining row (prefilled alone) is padded to ``T`` (or the batch is padded to the row's length);
leaving rows are dropped with ``index_select`` and columns that became padding for every row are
trimmed, so memory follows the live rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from vlm_demo.engine.request import Request
from vlm_demo.engine.streamer import RowStreamer


class SlackLayer(DynamicLayer):
    """Self-attention keys/values with spare columns after the last one.

    ``DynamicLayer`` concatenates on every step, copying the layer's whole cache for each token
    (quadratic in the answer's length). Here a step writes its column in place; when the spare
    columns run out, or rows join or leave, the buffer is rebuilt with a quarter more room.
    """

    MIN_SPARE = 64

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self.assign(keys, values)

    def assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take ``[B, heads, T, dim]`` keys and values (any strides) into a fresh buffer."""
        length = keys.shape[2]
        room = length + max(self.MIN_SPARE, length // 4)
        self._keys = keys.new_empty((*keys.shape[:2], room, keys.shape[3]))
        self._values = values.new_empty((*values.shape[:2], room, values.shape[3]))
        self._keys[:, :, :length].copy_(keys)
        self._values[:, :, :length].copy_(values)
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        start = self.keys.shape[2]
        end = start + key_states.shape[2]
        if end > self._keys.shape[2]:
            self.assign(self.keys, self.values)
        self._keys[:, :, start:end].copy_(key_states)
        self._values[:, :, start:end].copy_(value_states)
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values


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
    attention_mask: torch.Tensor | None = None  # [B, T] bool, False for left padding
    positions: torch.Tensor | None = None  # [B] position id of each row's next input token
    next_tokens: torch.Tensor | None = None  # [B] each row's next input token
    cross_mask: torch.Tensor | None = None  # [B, 1, 1, vision tokens] additive mask for one query
    row_mask: torch.Tensor | None = None  # [B, 1, 1, 1]: 0 for a row that sees no image tile
    padded: bool = False  # whether some row has left padding (else no self-attention mask is needed)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return 0 if self.attention_mask is None else int(self.attention_mask.shape[1])

    @property
    def cached_slots(self) -> int:
        """Token slots held in the self-attention cache, padding included (what memory is spent on)."""
        return len(self.rows) * self.length

    def join(
        self,
        row: Row,
        cache: Any,
        prompt_length: int,
        cross_masks: tuple[torch.Tensor, torch.Tensor],
        first_token: int,
    ) -> None:
        """Merge a row prefilled alone (batch of one, no padding) into the running batch."""
        cross_mask, row_mask = cross_masks
        device = cross_mask.device
        mask = torch.ones(1, prompt_length, dtype=torch.bool, device=device)
        position = torch.tensor([prompt_length], device=device)
        token = torch.tensor([first_token], device=device)
        if not self.rows:
            for index, layer in enumerate(cache.layers):
                if index not in self.cross_layers:
                    cache.layers[index] = SlackLayer(layer.keys, layer.values)
            self.rows, self.cache, self.attention_mask = [row], cache, mask
            self.positions, self.next_tokens = position, token
            self.cross_mask, self.row_mask, self.padded = cross_mask, row_mask, False
            return
        width = max(self.length, prompt_length)
        grow, pad_new = width - self.length, width - prompt_length
        self.padded = self.padded or grow > 0 or pad_new > 0
        for index, (old, new) in enumerate(zip(self.cache.layers, cache.layers, strict=False)):
            if index in self.cross_layers:  # image states: same length for every row
                old.keys = torch.cat([old.keys, new.keys], dim=0)
                old.values = torch.cat([old.values, new.values], dim=0)
            else:
                old.assign(
                    torch.cat([_pad_left(old.keys, grow, 2), _pad_left(new.keys, pad_new, 2)], dim=0),
                    torch.cat([_pad_left(old.values, grow, 2), _pad_left(new.values, pad_new, 2)], dim=0),
                )
        self.attention_mask = torch.cat([_pad_left(self.attention_mask, grow, 1), _pad_left(mask, pad_new, 1)], dim=0)
        self.positions = torch.cat([self.positions, position])
        self.next_tokens = torch.cat([self.next_tokens, token])
        self.cross_mask = torch.cat([self.cross_mask, cross_mask], dim=0)
        self.row_mask = torch.cat([self.row_mask, row_mask], dim=0)
        self.rows.append(row)

    def step_inputs(self) -> dict[str, Any]:
        """Text-model inputs for one decode step of every row; extends the mask by the new column.

        The self-attention mask goes in as the 4-D boolean ``[B, 1, 1, T]`` the attention kernel
        takes (passed through as is), or ``None`` while no row is padded, as ``generate`` would.
        """
        assert self.attention_mask is not None
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(self.rows), 1)], dim=1)
        return {
            "input_ids": self.next_tokens[:, None],
            "attention_mask": self.attention_mask[:, None, None, :] if self.padded else None,
            "position_ids": self.positions[:, None],
            "cross_attention_mask": self.cross_mask,
            "full_text_row_masked_out_mask": self.row_mask,
            "cache": self.cache,
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
            self.positions = self.next_tokens = self.cross_mask = self.row_mask = None
            self.padded = False
            return
        index = torch.tensor(keep, device=self.attention_mask.device)
        mask = self.attention_mask.index_select(0, index)
        first = int(mask.any(dim=0).byte().argmax())  # first column some remaining row uses
        for layer_index, layer in enumerate(self.cache.layers):
            keys = layer.keys.index_select(0, index)
            values = layer.values.index_select(0, index)
            if layer_index in self.cross_layers:
                layer.keys, layer.values = keys, values
            else:
                layer.assign(keys[:, :, first:], values[:, :, first:])
        self.attention_mask = mask[:, first:].contiguous()
        self.positions = self.positions.index_select(0, index)
        self.next_tokens = self.next_tokens.index_select(0, index)
        self.cross_mask = self.cross_mask.index_select(0, index)
        self.row_mask = self.row_mask.index_select(0, index)
        self.padded = not bool(self.attention_mask.all())
        self.rows = [self.rows[i] for i in keep]
