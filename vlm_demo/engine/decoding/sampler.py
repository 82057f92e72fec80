"""Per-row sampling for a whole batch, on the device, in a fixed handful of kernels.

The rows of one batch differ: greedy or sampled, each with its own temperature, top-p and seed.
Greedy rows take the argmax. Sampled rows draw by inverse CDF over their top-p nucleus, from a
uniform number that is a hash of (row seed, draw index) — a counter-based generator, like Philox.
So a seeded row draws the same numbers whatever its neighbours, in either batching mode and on any
device; there is no per-row ``torch.Generator`` (which lives on one device: wrong when a model
spread over GPUs puts its logits elsewhere) and no per-row host round trip (a softmax, a 128k sort
and an ``int()`` per sampled row cost a GPU step its speed). Nothing here reads a value back to the
host: the caller does that once per step, for the tokens it streams.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch
from transformers import LogitsProcessor

from vlm_demo.request import ValidParams

MASK32 = 0xFFFFFFFF
REDRAW = 0x5BD1E995  # salts a redraw's draw index, so it never repeats a row's ordinary draws


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for int64 tensors holding 32-bit values, without int64 overflow."""
    low = (x & 0xFFFF) * constant
    high = (((x >> 16) * constant) & 0xFFFF) << 16
    return (low + high) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash, elementwise; exact integer maths, so every device
    gives the same bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """One float32 in [0, 1) per row (24 random bits): a function of the row's key and draw index only."""
    return (hash32(keys ^ hash32(draws & MASK32)) >> 8).to(torch.float32) * 2.0**-24


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids ``[S]`` drawn from ``[S, vocab]`` logits with per-row temperature and nucleus (top-p)
    filtering, by inverse CDF at the per-row uniforms ``u``."""
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)  # the most likely token always stays
    cdf = kept.cumsum(dim=-1)
    total = cdf[:, -1:]
    index = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = (cdf < total).sum(dim=-1, keepdim=True)  # the last token with mass (guards u * total rounding up)
    return order.gather(1, torch.minimum(index, last)).squeeze(1)


def _split_seed(seed: int | None) -> tuple[int, int]:
    value = int(seed or 0)
    return value & MASK32, (value >> 32) & MASK32


Send = Callable[[list[np.ndarray]], list[torch.Tensor]]


def plain_send(device: torch.device | str) -> Send:
    """Arrays to ``device`` one ``torch.tensor`` each (where no staging buffer is at hand: dynamic mode)."""
    return lambda parts: [torch.tensor(np.asarray(p), device=device) for p in parts]


class RowSampling:
    """The sampling state of a batch's rows, as tensors on the logits' device.

    Rows join (``cat``) and leave (``select``) with the batch; ``sample`` picks every row's next
    token and advances the sampled rows' draw counters. A row's ``n``-th token is always draw
    ``n``, so a row restarted after an out-of-memory step draws the same tokens again. The per-row
    numbers reach the device through ``send`` (the engine's staging buffer: one asynchronous copy).
    """

    def __init__(
        self,
        params: Sequence[ValidParams],
        device: torch.device | str,
        draws: torch.Tensor | None = None,
        send: Send | None = None,
    ):
        self.params = list(params)
        self.device = torch.device(device)
        self.send = send or plain_send(self.device)
        self.sampled = [i for i, p in enumerate(self.params) if not p.greedy]
        chosen = [self.params[i] for i in self.sampled]
        floats = np.asarray([[p.temperature, p.top_p] for p in chosen], dtype=np.float32).reshape(-1, 2)
        halves = np.asarray([_split_seed(p.seed) for p in chosen], dtype=np.int64).reshape(-1, 2)
        parts = [np.asarray(self.sampled, dtype=np.int64), floats.view(np.int32).astype(np.int64), halves]
        if draws is None:
            parts.append(np.zeros(len(self.params), dtype=np.int64))
        sent = self.send(parts)
        self.draws = draws if draws is not None else sent[3]
        if self.sampled:
            self.index = sent[0]
            bits = sent[1].to(torch.int32).view(torch.float32)  # the exact float32 values, sent as integers
            self.temperature, self.top_p = bits[:, 0].contiguous(), bits[:, 1].contiguous()
            self.keys = hash32(sent[2][:, 1] ^ hash32(sent[2][:, 0]))

    def __len__(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return not self.sampled

    def cat(self, other: RowSampling) -> RowSampling:
        """This batch's rows followed by ``other``'s (newcomers), counters kept."""
        draws = torch.cat([self.draws, other.draws.to(self.device)])
        return RowSampling(self.params + other.params, self.device, draws, self.send)

    def select(self, keep: Sequence[int], index: torch.Tensor | None = None) -> RowSampling:
        """Only the listed rows, in that order, counters kept (``index``: ``keep`` already on the device)."""
        if index is None:
            (index,) = self.send([np.asarray(list(keep), dtype=np.int64)])
        return RowSampling([self.params[i] for i in keep], self.device, self.draws.index_select(0, index), self.send)

    def redraw(self, logits: torch.Tensor, rows: Sequence[int], ban: torch.Tensor) -> torch.Tensor:
        """A second draw for ``rows`` (indices into this batch) with the ``ban`` vocabulary masked out: what the
        stage structure asks for when a stage with no text yet would be closed. Greedy rows take the masked
        argmax; sampled rows draw with their own parameters from a uniform keyed on (seed, the draw just
        made, a salt), so a redraw is as reproducible as any other draw."""
        index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
        masked = logits.index_select(0, index).float().masked_fill(ban.to(logits.device), float("-inf"))
        tokens = masked.argmax(dim=-1)
        sampled = [j for j, row in enumerate(rows) if not self.params[row].greedy]
        if sampled:
            where = [self.sampled.index(rows[j]) for j in sampled]
            pick = torch.tensor(where, dtype=torch.long, device=self.device)
            draws = (
                self.draws.index_select(0, torch.tensor([rows[j] for j in sampled], device=self.device)) - 1
            ) ^ REDRAW
            u = uniforms(self.keys.index_select(0, pick), draws)
            chosen = masked.index_select(0, torch.tensor(sampled, device=masked.device))
            drawn = draw(chosen, self.temperature.index_select(0, pick), self.top_p.index_select(0, pick), u)
            tokens = tokens.index_copy(0, torch.tensor(sampled, device=tokens.device), drawn.to(tokens.device))
        return tokens

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, vocab]`` logits -> ``[B]`` token ids on the same device (no host sync)."""
        tokens = logits.argmax(dim=-1)
        if self.sampled:
            all_rows = len(self.sampled) == len(self.params)
            rows = logits if all_rows else logits.index_select(0, self.index)
            draws = self.draws if all_rows else self.draws.index_select(0, self.index)
            drawn = draw(rows, self.temperature, self.top_p, uniforms(self.keys, draws))
            tokens = drawn if all_rows else tokens.index_copy(0, self.index, drawn)
            self.draws += 1
        return tokens


class RowSampler(LogitsProcessor):
    """Dynamic mode: ``generate`` runs greedy and this processor leaves only each sampled row's
    drawn token standing, so the argmax takes it; greedy rows pass through untouched."""

    def __init__(self, params: Sequence[ValidParams]) -> None:
        self.params = list(params)
        self.rows: RowSampling | None = None  # built on the first call, on the logits' device

    @property
    def needed(self) -> bool:
        return any(not p.greedy for p in self.params)

    def redraw(self, logits: torch.Tensor, rows: Sequence[int], ban: torch.Tensor) -> torch.Tensor:
        """See :meth:`RowSampling.redraw` (``generate`` has sampled at least once when this is asked)."""
        if self.rows is None:
            self.rows = RowSampling(self.params, logits.device)
        return self.rows.redraw(logits, rows, ban)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.rows is None:
            self.rows = RowSampling(self.params, scores.device)
        tokens = self.rows.sample(scores)
        index = self.rows.index
        picked = torch.full((len(index), scores.shape[1]), float("-inf"), dtype=scores.dtype, device=scores.device)
        picked.scatter_(1, tokens.index_select(0, index)[:, None], 0.0)
        return cast(torch.FloatTensor, scores.index_copy(0, index, picked))  # transformers' annotation
