"""Training: the batches encoded with their weighted labels, the deterministic torch settings, the loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from vlm_demo.models.tiny.contract import END_HEADER, EOT
from vlm_demo.models.tiny.data import TRAIN_STEPS, Example, training_plan
from vlm_demo.models.tiny.pictures import COLOURS

if TYPE_CHECKING:
    from transformers import MllamaForConditionalGeneration, MllamaProcessor, PreTrainedTokenizerFast

log = logging.getLogger(__package__)

LEARNING_RATE = 3e-3
SUMMARY_TOKENS = 16  # answer tokens up to the end of the SUMMARY sentence
SUMMARY_WEIGHT = 10.0
CHOICE_WEIGHT = 30.0  # the judge's decisions: the colour it quotes, "not", "1" or "2"
COLOUR_WEIGHT = 5.0  # the colour each stage of an answer names
WARMUP_STEPS = 20


def encode_batch(processor: MllamaProcessor, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Tokenise conversations through the inference path, with labels on the answers the model writes
    (each with its ``<|eot_id|>``) and their per-token ``weights``."""
    batch = processor(
        images=[[ex.image()] for ex in examples],
        text=[ex.text(processor) for ex in examples],
        add_special_tokens=False,  # the template starts with <|begin_of_text|>
        padding=True,
        padding_side="right",
        return_tensors="pt",
    )
    input_ids = batch["input_ids"]
    labels = torch.full_like(input_ids, -100)
    weights = torch.zeros(input_ids.shape)
    decisions = decision_ids(processor.tokenizer)
    end_header, eot = processor.tokenizer.convert_tokens_to_ids([END_HEADER, EOT])
    for row, ex in enumerate(examples):
        ids = input_ids[row]
        assistant_heads = (ids == end_header).nonzero().flatten()[1::2]  # user, assistant, user, ...
        ends = (ids == eot).nonzero().flatten()
        learn = [e.learn for e in ex.history] + [True]
        for turn, head in enumerate(assistant_heads.tolist()):
            if not learn[turn]:
                continue
            end = int(ends[ends > head][0])
            # a cut answer does not end here: no label on the template's closing <|eot_id|>
            stop = end if turn == len(learn) - 1 and not ex.complete else end + 1
            span = slice(head + 1, stop)
            labels[row, span] = ids[span]
            _weigh(weights[row, span], ids[span], ex.judge, decisions)
    return {**batch, "labels": labels, "weights": weights}


def decision_ids(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """The tokens a judge's answer turns on: the colours it quotes, then "not" and the choice ("1", "2")."""
    words = [*(f"Ġ{c}" for c in COLOURS), "Ġnot", "1", "2"]
    return torch.tensor(tokenizer.convert_tokens_to_ids(words))


def _weigh(weights: torch.Tensor, answer: torch.Tensor, judge: bool, decisions: torch.Tensor) -> None:
    """Per-token loss weights of one answer (in place): its first ``SUMMARY_TOKENS``, its colour words and
    a judge's decisions weigh more.

    They carry the decisions (the SUMMARY's trigger and colour words; the colour each stage names; the judge's
    quote, verdict and choice, ``decision_ids``, most of all); unweighted, the model fits the rest long before
    those generalise. The colour words' weight makes each stage as sure of the image's colour as the label
    noise allows (unweighted, one colour's CAPTION stayed a coin toss with another).
    """
    if judge:
        weights.fill_(SUMMARY_WEIGHT)
        weights[torch.isin(answer, decisions)] = CHOICE_WEIGHT
        return
    weights.fill_(1.0)
    weights[:SUMMARY_TOKENS] = SUMMARY_WEIGHT
    weights[torch.isin(answer, decisions[: len(COLOURS)])] = COLOUR_WEIGHT


@contextmanager
def _deterministic_torch(threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic kernels for the build, restored afterwards (tests share the process)."""
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


def _prefetched(processor: MllamaProcessor, plan: list[list[Example]]) -> Iterator[dict[str, torch.Tensor]]:
    """Encode the next batch on a second thread while this one trains (images and tokenising are ~20% of the time)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        if not plan:
            return
        pending = pool.submit(encode_batch, processor, plan[0])
        for examples in plan[1:]:
            batch = pending.result()
            pending = pool.submit(encode_batch, processor, examples)
            yield batch
        yield pending.result()


def weighted_loss(model: MllamaForConditionalGeneration, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss with the per-token weights of ``_weigh``."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "weights")}
    logits = model(**inputs).logits[:, :-1]
    targets, weights = batch["labels"][:, 1:], batch["weights"][:, 1:]
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    return (per_token * weights).sum() / weights.sum()


def train(
    model: MllamaForConditionalGeneration, processor: MllamaProcessor, seed: int, steps: int = TRAIN_STEPS
) -> None:
    """AdamW with warm-up and linear decay, one thread; 1500 steps take the loss from ~6.7 to ~0.01 in ~5 CPU minutes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS) * max(0.05, 1 - s / max(1, steps))
    )
    model.train()
    started = time.perf_counter()
    for step, batch in enumerate(_prefetched(processor, training_plan(seed, steps))):
        loss = weighted_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 40 == 0 or step == steps - 1:
            left = (time.perf_counter() - started) / (step + 1) * (steps - step - 1)
            log.info("step %d/%d loss %.4f, about %.0f s left", step + 1, steps, loss.item(), left)
    model.eval()
