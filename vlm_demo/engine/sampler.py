"""Per-row sampling inside one batch.

``generate`` applies one decoding strategy to every row. We run it greedy and let this logits
processor pick each sampled row's token itself (temperature, top-p, the row's own RNG), then leave
only that token standing so the greedy argmax takes it. Greedy rows pass through untouched, so a
greedy row in a mixed batch equals its single run, and a sampled row with a fixed seed gives the
same text whatever it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from vlm_demo.engine.request import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token id from a row's logits with temperature and nucleus (top-p) filtering."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        keep = cumulative - sorted_probs < params.top_p  # always keeps the most likely token
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def pick_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Next token of every row: argmax for greedy rows, a seeded draw for sampled ones."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=False)):
        if gen is not None:
            tokens[row] = sample_token(logits[row], p, gen)
    return tokens


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A row's own RNG (None when greedy): its draws never depend on its neighbours."""
    if params.greedy:
        return None
    return torch.Generator(device=device).manual_seed(int(params.seed or 0))


class RowSampler(LogitsProcessor):
    """Turns sampled rows into one-hot scores; greedy rows are left as they are."""

    def __init__(self, params: Sequence[SamplingParams], device: torch.device | str) -> None:
        self.params = list(params)
        self.generators = [make_generator(p, device) for p in self.params]

    @property
    def needed(self) -> bool:
        return any(g is not None for g in self.generators)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for row, (p, gen) in enumerate(zip(self.params, self.generators, strict=False)):
            if gen is None:
                continue
            token = sample_token(scores[row], p, gen)
            scores[row].fill_(float("-inf"))
            scores[row, token] = 0.0
        return scores
