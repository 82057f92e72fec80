"""Which token a row commits for the one it sampled: the one place that decides it.

A step's tokens are drawn on the device (:mod:`~vlm_demo.engine.decoding.sampler` holds the maths of a draw).
Each row's :class:`~vlm_demo.engine.decoding.structure.StageTracker` then keeps its token, replaces it, or
asks for a second draw from the same logits with the grammar's banned tokens masked; the rows that ask get
it together (the only extra host read, and only on the steps that need it). The engines only carry the
answer into the next input, since a replacement is not in the cache yet: the continuous engine through
``RunningRows.replace_next``, a joining row as its first input (``Joiner``), the dynamic engine in
``generate``'s last column (``BatchStreamer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.decoding.sampler import RowSampler, RowSampling
from vlm_demo.engine.decoding.structure import RESAMPLE, StageTracker
from vlm_demo.request import ValidParams


class WritingRow(Protocol):
    """What the choice reads of a row: a :class:`~vlm_demo.engine.decoding.detokenizer.RowStreamer`, named by
    its shape because the detokenizer's ``BatchStreamer`` imports this module."""

    structure: StageTracker | None
    ids: list[int]
    done: bool
    request: Request


def _checked(row: WritingRow, token: int, redrawn: bool = False) -> int:
    """The row's tracker's verdict on ``token`` (free text, a finished or cancelled row: the token itself)."""
    if row.structure is None or row.done or row.request.cancelled:
        return token
    return row.structure.check(token, len(row.ids), redrawn=redrawn)


S = TypeVar("S", RowSampling, RowSampler)  # the rows' sampling: the engine's, or dynamic mode's (inside generate)


class TokenChoice(Generic[S]):
    """One step's logits turned into the tokens a batch's rows commit: ``draw`` on the device, then, once
    the caller has read the draws back, ``commit`` (the grammar's check, and a second draw where it asks)."""

    def __init__(self, sampling: S, logits: torch.Tensor) -> None:
        self.sampling: S = sampling
        self.logits = logits

    def draw(self) -> torch.Tensor:
        """Every row's sampled token, on the device (no host read: the caller makes the step's one)."""
        assert isinstance(self.sampling, RowSampling), "dynamic mode draws inside generate (GenerateChoice)"
        return self.sampling.sample(self.logits)

    def commit(self, rows: Sequence[WritingRow], sampled: list[int], index: Sequence[int] | None = None) -> list[int]:
        """The tokens ``rows`` commit for their ``sampled`` ones; ``index``: each row's place in the logits
        and the sampling, when the rows are only some of them."""
        committed = [_checked(row, token) for row, token in zip(rows, sampled, strict=False)]
        again = [i for i, token in enumerate(committed) if token == RESAMPLE]
        if again:
            for i, token in zip(again, self._redraw(rows, again, index), strict=True):
                committed[i] = _checked(rows[i], token, redrawn=True)
        return committed

    def _redraw(self, rows: Sequence[WritingRow], again: list[int], index: Sequence[int] | None) -> list[int]:
        """A second draw for the rows ``again`` with the grammar's banned tokens masked (every tracker of a
        worker shares its grammar), keyed on the draw just made."""
        structure = rows[again[0]].structure
        assert structure is not None  # only a tracker asks for a second draw
        ban = structure.grammar.ban_mask(self.logits.shape[-1], self.logits.device)
        where = [index[i] for i in again] if index is not None else again
        return self.sampling.redraw(self.logits, where, ban).tolist()


def replacements(sampled: list[int], committed: list[int]) -> dict[int, int]:
    """Rows whose committed token is not the one they sampled (row index -> token): what the engine must
    write into their next input."""
    return {i: token for i, (token, was) in enumerate(zip(committed, sampled, strict=True)) if token != was}


class ScoresTap(LogitsProcessor):
    """Keeps a reference to each step's logits (first in the list: before any per-row sampling touches
    them), for the rare second draw the stage structure asks for."""

    def __init__(self) -> None:
        self.scores: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.scores = scores
        return scores


class GenerateChoice:
    """Dynamic mode's :class:`TokenChoice`: ``generate`` draws through ``processors`` (the per-row sampler,
    after the tap that keeps the logits), and its stopping criterion commits each step's draws here."""

    def __init__(self, params: Sequence[ValidParams]) -> None:
        self.sampler = RowSampler(params)
        self.tap = ScoresTap()

    @property
    def processors(self) -> LogitsProcessorList:
        return LogitsProcessorList([self.tap, self.sampler] if self.sampler.needed else [self.tap])

    def commit(self, rows: Sequence[WritingRow], sampled: list[int]) -> list[int]:
        """See :meth:`TokenChoice.commit` (the tap has this step's logits: processors run before the criteria)."""
        assert self.tap.scores is not None
        return TokenChoice(self.sampler, self.tap.scores).commit(rows, sampled)
