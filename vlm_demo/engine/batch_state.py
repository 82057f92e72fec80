"""Cache bookkeeping for continuous batching: one left-padded batch that rows join and leave.

The running batch keeps, per layer, self-attention keys/values of shape ``[B, heads, T, dim]``
(rows left-padded to the common length ``T``) and cross-attention keys/values of the image,
``[B, heads, vision_tokens, dim]``, plus the 2-D attention mask, each row's next position, its
next input token and its cross-attention masks (prepared once, when the row joins, in the form
the text model's layers take: the model would rebuild them from raw masks on every step) and
sampling state. Newcomers, prefilled together and left-padded among themselves, are padded to
``T`` (or the batch is padded to theirs); leaving rows are dropped with ``index_select`` and
columns that became padding for every row are trimmed, so memory follows the live rows. Row
lengths are also kept on the host, so planning a trim never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from vlm_demo.engine.request import Request
from vlm_demo.engine.sampler import RowSampling
from vlm_demo.engine.streamer import RowStreamer
from vlm_demo.errors import DemoError


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


class CandidateOwner(Protocol):
    """The stage-beam search a row is a candidate of (:class:`~vlm_demo.engine.beam.StageBeam`), as the
    continuous engine drives it."""

    request: Request  # the visitor's request

    def candidate_done(self, row: Row, snapshot: Snapshot | None) -> None: ...

    def restart_stage(self, error: DemoError) -> None: ...


@dataclass(eq=False)
class Row:
    """One request while it is in the running batch."""

    request: Request
    streamer: RowStreamer
    beam: CandidateOwner | None = None  # set for a stage-beam candidate


@dataclass
class Prefill:
    """Newcomers prefilled together (``Worker.prefill``): left-padded among themselves, as a dynamic batch."""

    cache: Any  # a transformers DynamicCache: [n, heads, L, dim] per self-attention layer, image states per cross layer
    logits: torch.Tensor  # [n, vocab] float32 at each row's last prompt position
    attention_mask: torch.Tensor  # [n, L] bool, False for left padding
    lengths: list[int]  # each row's real prompt tokens (host side: no device reads to plan with them)
    cross_mask: torch.Tensor  # [n, 1, 1, vision tokens] additive mask for one query, in the layers' form
    row_mask: torch.Tensor  # [n, 1, 1, 1]: 0 for a row that sees no image tile

    def select(self, index: list[int], cross_layers: frozenset[int]) -> Prefill:
        """These rows only (in this order, repeats allowed), without columns that are padding for all of them."""
        lengths = [self.lengths[i] for i in index]
        first = self.attention_mask.shape[1] - max(lengths)
        rows = torch.tensor(index, device=self.attention_mask.device)
        layers = []
        for number, layer in enumerate(self.cache.layers):
            here = rows.to(layer.keys.device)
            keys, values = layer.keys.index_select(0, here), layer.values.index_select(0, here)
            if number not in cross_layers:
                keys, values = keys[:, :, first:], values[:, :, first:]
            layers.append((keys, values))
        return Prefill(
            DynamicCache(ddp_cache_data=layers),
            self.logits.index_select(0, rows.to(self.logits.device)),
            self.attention_mask.index_select(0, rows)[:, first:],
            lengths,
            self.cross_mask.index_select(0, rows.to(self.cross_mask.device)),
            self.row_mask.index_select(0, rows.to(self.row_mask.device)),
        )

    def snapshot(self, row: int, cross_layers: frozenset[int]) -> Snapshot:
        """Row ``row`` on its own, ready to fork: its first candidates sample from its last logits."""
        length = self.lengths[row]
        layers = [
            _copy_row(layer, row, None if number in cross_layers else length)
            for number, layer in enumerate(self.cache.layers)
        ]
        return Snapshot(
            layers,
            self.cross_mask[row : row + 1].clone(),
            self.row_mask[row : row + 1].clone(),
            length,
            logits=self.logits[row : row + 1].clone(),
        )


@dataclass
class Snapshot:
    """One row's cache at a stage boundary of a stage-beam search: what the stage's candidates fork from.

    Forking copies these tensors into new rows instead of recomputing them: the prompt and image are
    prefilled once per answer, and each stage continues from the winner's own cache. A snapshot taken
    in the running batch may leave the image states out (``None`` for cross-attention layers); they
    are the same for every candidate of one answer, so the search keeps one copy and passes it to ``fork``.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer [1, heads, n, dim]
    cross_mask: torch.Tensor  # [1, 1, 1, vision tokens]
    row_mask: torch.Tensor  # [1, 1, 1, 1]
    length: int  # real tokens in the self-attention cache (= the position of the next input)
    logits: torch.Tensor | None = None  # [1, vocab] after a prefill: candidates draw their first token from it
    next_token: torch.Tensor | None = None  # [1] after a step: the row's next input, not yet in the cache

    def fork(self, rows: int, image: Snapshot | None = None) -> Prefill:
        """``rows`` copies of this row as a :class:`Prefill` that joins the running batch (``logits`` is
        this row's, repeated, or empty when the copies continue from ``next_token``)."""
        layers = []
        for number, layer in enumerate(self.layers):
            if layer is None:
                assert image is not None and image.layers[number] is not None, "image states needed to fork"
                layer = image.layers[number]
            keys, values = layer
            layers.append((keys.expand(rows, -1, -1, -1).contiguous(), values.expand(rows, -1, -1, -1).contiguous()))
        device = self.cross_mask.device
        logits = self.logits if self.logits is not None else torch.empty(1, 0, device=device)
        return Prefill(
            DynamicCache(ddp_cache_data=layers),
            logits.expand(rows, -1),
            torch.ones(rows, self.length, dtype=torch.bool, device=device),
            [self.length] * rows,
            self.cross_mask.expand(rows, -1, -1, -1).contiguous(),
            self.row_mask.expand(rows, -1, -1, -1).contiguous(),
        )


def _copy_row(layer: Any, row: int, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of a cache layer's keys and values, copied (a view would keep the whole batch alive);
    with ``length``, only its last ``length`` columns (its real tokens, right-aligned)."""
    keys, values = layer.keys[row : row + 1], layer.values[row : row + 1]
    if length is not None:
        keys, values = keys[:, :, keys.shape[2] - length :], values[:, :, values.shape[2] - length :]
    return keys.clone(), values.clone()


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
    lengths: list[int] = field(default_factory=list)  # columns each row uses (right-aligned at T), host side
    positions: torch.Tensor | None = None  # [B] position id of each row's next input token
    next_tokens: torch.Tensor | None = None  # [B] each row's next input token
    cross_mask: torch.Tensor | None = None  # [B, 1, 1, vision tokens] additive mask for one query
    row_mask: torch.Tensor | None = None  # [B, 1, 1, 1]: 0 for a row that sees no image tile
    sampling: RowSampling | None = None  # every row's sampling parameters and draw counter

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return 0 if self.attention_mask is None else int(self.attention_mask.shape[1])

    @property
    def padded(self) -> bool:
        """Whether some row has left padding (else no self-attention mask is needed)."""
        return any(n < self.length for n in self.lengths)

    @property
    def cached_slots(self) -> int:
        """Token slots held in the self-attention cache, padding included (what memory is spent on)."""
        return len(self.rows) * self.length

    def join(self, rows: list[Row], prefill: Prefill, first_tokens: torch.Tensor, sampling: RowSampling) -> None:
        """Merge newcomers prefilled together into the running batch, after its rows."""
        device = prefill.attention_mask.device
        positions = torch.tensor(prefill.lengths, device=device)
        tokens = first_tokens.to(device)
        if not self.rows:
            cache = prefill.cache
            for index, layer in enumerate(cache.layers):
                if index not in self.cross_layers:
                    cache.layers[index] = SlackLayer(layer.keys, layer.values)
            self.rows, self.cache, self.attention_mask = list(rows), cache, prefill.attention_mask
            self.lengths, self.positions, self.next_tokens = list(prefill.lengths), positions, tokens
            self.cross_mask, self.row_mask, self.sampling = prefill.cross_mask, prefill.row_mask, sampling
            return
        width = max(self.length, prefill.attention_mask.shape[1])
        grow, pad_new = width - self.length, width - prefill.attention_mask.shape[1]
        for index, (old, new) in enumerate(zip(self.cache.layers, prefill.cache.layers, strict=False)):
            if index in self.cross_layers:  # image states: same length for every row
                old.keys = torch.cat([old.keys, new.keys], dim=0)
                old.values = torch.cat([old.values, new.values], dim=0)
            else:
                old.assign(
                    torch.cat([_pad_left(old.keys, grow, 2), _pad_left(new.keys, pad_new, 2)], dim=0),
                    torch.cat([_pad_left(old.values, grow, 2), _pad_left(new.values, pad_new, 2)], dim=0),
                )
        self.attention_mask = torch.cat(
            [_pad_left(self.attention_mask, grow, 1), _pad_left(prefill.attention_mask, pad_new, 1)], dim=0
        )
        self.lengths += prefill.lengths
        self.positions = torch.cat([self.positions, positions])
        self.next_tokens = torch.cat([self.next_tokens, tokens])
        self.cross_mask = torch.cat([self.cross_mask, prefill.cross_mask], dim=0)
        self.row_mask = torch.cat([self.row_mask, prefill.row_mask], dim=0)
        self.sampling = self.sampling.cat(sampling)
        self.rows.extend(rows)

    def step_inputs(self) -> dict[str, Any]:
        """Text-model inputs for one decode step of every row; extends the mask by the new column.

        The self-attention mask goes in as the 4-D boolean ``[B, 1, 1, T]`` (``True`` = attend; the
        worker converts it to the additive form if the attention kernel wants that), or ``None``
        while no row is padded, as ``generate`` would.
        """
        assert self.attention_mask is not None
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(self.rows), 1)], dim=1)
        self.lengths = [n + 1 for n in self.lengths]
        return {
            "input_ids": self.next_tokens[:, None],
            "attention_mask": self.attention_mask[:, None, None, :] if self.padded else None,
            "position_ids": self.positions[:, None],
            "cross_attention_mask": self.cross_mask,
            "full_text_row_masked_out_mask": self.row_mask,
            "cache": self.cache,
        }

    def replace_next(self, tokens: dict[int, int]) -> None:
        """Give rows another next input than the token they sampled (row index -> token id): the stage
        structure's replacements, made before the token enters the cache."""
        device = self.next_tokens.device
        index = torch.tensor(list(tokens), dtype=torch.long, device=device)
        self.next_tokens = self.next_tokens.index_copy(
            0, index, torch.tensor(list(tokens.values()), dtype=self.next_tokens.dtype, device=device)
        )

    def advance(self, tokens: torch.Tensor) -> None:
        """After a step: each row's next input is the token it just got (a device tensor, not read back)."""
        self.positions = self.positions + 1
        self.next_tokens = tokens.to(self.positions.device)

    def snapshot(self, row: int) -> Snapshot:
        """Row ``row``'s text cache and next input, copied out before it leaves (image states left out)."""
        length = self.lengths[row]
        layers = [
            None if number in self.cross_layers else _copy_row(layer, row, length)
            for number, layer in enumerate(self.cache.layers)
        ]
        return Snapshot(
            layers,
            self.cross_mask[row : row + 1],
            self.row_mask[row : row + 1],
            length,
            next_token=self.next_tokens[row : row + 1].clone(),
        )

    def keep(self, keep: list[int]) -> None:
        """Drop every row not listed; trim columns that are padding for all remaining rows.

        Which columns to trim follows from the host-side row lengths, so leaving costs no device read.
        """
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.attention_mask, self.lengths = [], None, None, []
            self.positions = self.next_tokens = self.cross_mask = self.row_mask = self.sampling = None
            return
        lengths = [self.lengths[i] for i in keep]
        first = self.length - max(lengths)  # first column some remaining row uses
        index = torch.tensor(keep, device=self.attention_mask.device)
        on_device = {index.device: index}  # a model spread over GPUs keeps each layer's cache on its own GPU
        for layer_index, layer in enumerate(self.cache.layers):
            rows_here = on_device.setdefault(layer.keys.device, index.to(layer.keys.device))
            keys = layer.keys.index_select(0, rows_here)
            values = layer.values.index_select(0, rows_here)
            if layer_index in self.cross_layers:
                layer.keys, layer.values = keys, values
            else:
                layer.assign(keys[:, :, first:], values[:, :, first:])
        self.attention_mask = self.attention_mask.index_select(0, index)[:, first:].contiguous()
        self.lengths = lengths
        self.positions = self.positions.index_select(0, index)
        self.next_tokens = self.next_tokens.index_select(0, index)
        self.cross_mask = self.cross_mask.index_select(0, index)
        self.row_mask = self.row_mask.index_select(0, index)
        self.sampling = self.sampling.select(keep)
        self.rows = [self.rows[i] for i in keep]
