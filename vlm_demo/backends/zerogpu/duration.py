"""How many seconds a ZeroGPU call asks for, from what it answers.

ZeroGPU checks the declared duration against the visitor's quota and tier before it lends a GPU (a call that
asks for more than the tier allows is refused, one that asks for less is scheduled sooner) and may end a call
that runs past it, so each call asks for what its answers can take: a new worker's start (moving the weights,
building the engine), then its longest answer at ``--zerogpu-tokens-per-s``, longer with Think harder's
candidates and with more answers in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vlm_demo.request import STAGE_BEAM, ValidParams

# Think harder with K candidates a stage takes 1 + 0.25 (K - 1) times a normal answer: measured 1.26x at K=2 and
# 1.77x at K=4 (docs/BENCHMARKS.md, Think harder), the candidates written as rows of one batch, the judges' too.
PER_CANDIDATE = 0.25
# A decode step reads every weight once for the whole batch: 32 rows take about twice one row's step time (a paper
# estimate for an H100, docs/BENCHMARKS.md), so each answer beyond the first adds 1/32 of the longest one's time.
ROWS_PER_DOUBLING = 32


def answer_seconds(params: ValidParams, tokens_per_s: float) -> float:
    """One answer alone: its longest possible length at ``tokens_per_s``, Think harder's candidates counted."""
    candidates = 1 + PER_CANDIDATE * (params.beams - 1) if params.reasoning == STAGE_BEAM else 1.0
    return params.max_new_tokens / tokens_per_s * candidates


def call_seconds(answers: Sequence[ValidParams], tokens_per_s: float, start_s: float) -> int:
    """Whole seconds one GPU call asks for to write ``answers`` together (one, or a Gradio batch)."""
    longest = max(answer_seconds(params, tokens_per_s) for params in answers)
    return math.ceil(start_s + longest * (1 + (len(answers) - 1) / ROWS_PER_DOUBLING))
