"""How close an fp8 key/value cache keeps the model: ``python -m vlm_demo.tools.bench --kv-closeness``.

Two measurements, both on this CPU:

- **Logits, teacher-forced, on the real-shape model** (:func:`~vlm_demo.models.realshape.narrow_config` at the real
  hidden width 4,096 and head dim 128, 5 layers of which 2 cross-attention, random weights, computing in fp32):
  rows with 4-tile pictures are prefilled once, placed in three page pools — exact (fp32), bf16 (each key/value
  rounded to bf16 as it is written: a bf16 model's cache) and fp8 — and decoded step by step through the engine's
  own decode step, all fed the same tokens (the exact cache's greedy choice), so every step compares the same
  position. Per step, each cache against the exact one (and fp8 against bf16): the largest and mean absolute logit
  difference, the same over the logits' spread (their standard deviation), the KL divergence of the softmaxes, and
  whether the greedy token agrees. bf16's own difference is the yardstick: the random model (large weights, to keep
  greedy choices decisive) amplifies any change of its cache, so read fp8's figures against bf16's;
  ``realshape_logits_llama_init`` is the same model with Llama's own initial spread (0.02), which amplifies less.
- **Answers on the tiny trained model** (fp32, 1,024 vocabulary): held-out pictures through the continuous
  engine, greedy, with each cache: whether each answer is four-staged, names the picture's colour, and is the
  same text as the default cache's.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from vlm_demo.config import Config

STEPS = 300
ROWS = 2
HIDDEN = 4096  # the 11B model's width: head dim 128, its cache's real geometry
HELD_OUT = 24


CACHES = ("fp32", "bf16", "fp8")  # the exact cache, and the two a GPU stores: each compared with the exact one


def _decoders(model: Any, pages: int) -> dict[str, Any]:
    """One decode step per cache over an fp32 model: ``fp32`` keeps the keys/values exactly, ``bf16`` rounds each
    one written to bf16 (what a bf16 model's cache holds), ``fp8`` is ``--kv-cache-dtype fp8``'s pool."""
    from vlm_demo.engine.executor.decode_step import TextDecodeStep
    from vlm_demo.engine.kv.pages import FP8

    decoders = {
        kind: TextDecodeStep.over_pool(model, torch.float32, pages, "reference", FP8 if kind == "fp8" else None)
        for kind in CACHES
    }
    pool = decoders["bf16"].pool
    write = pool.write

    def rounded(layer: int, where: Any, keys: torch.Tensor, values: torch.Tensor) -> Any:
        return write(layer, where, keys.bfloat16().float(), values.bfloat16().float())

    pool.write = rounded  # type: ignore[method-assign]  # every write of this pool: the prefill's and each step's
    return decoders


def _compare(base: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """One step's logits of a cache against the exact cache's."""
    diff = (other - base).abs()
    spread = base.std(dim=-1, keepdim=True)
    kl = torch.nn.functional.kl_div(other.log_softmax(-1), base.log_softmax(-1), log_target=True, reduction="none")
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "max_over_std": float((diff / spread).max()),
        "mean_over_std": float((diff / spread).mean()),
        "kl": float(kl.sum(-1).mean()),
        "agree": float((other.argmax(-1) == base.argmax(-1)).float().mean()),
    }


def _summary(steps: list[dict[str, float]]) -> dict[str, float]:
    return {
        "max_abs_logit_difference": max(s["max_abs"] for s in steps),
        "mean_abs_logit_difference": statistics.fmean(s["mean_abs"] for s in steps),
        "max_difference_over_logit_std": max(s["max_over_std"] for s in steps),
        "mean_difference_over_logit_std": statistics.fmean(s["mean_over_std"] for s in steps),
        "mean_kl_divergence": statistics.fmean(s["kl"] for s in steps),
        "max_kl_divergence": max(s["kl"] for s in steps),
        "argmax_agreement": statistics.fmean(s["agree"] for s in steps),
    }


def logit_closeness(steps: int = STEPS, rows: int = ROWS, hidden: int = HIDDEN, seed: int = 0,
                    init: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The teacher-forced comparison on the real-shape model (see the module's docstring); ``init``: the text
    model's initial weights' spread in place of the narrow model's large 0.2 (0.02: Llama's own)."""
    from vlm_demo.engine.batching.job import Request
    from vlm_demo.engine.batching.rows import Row, RunningRows
    from vlm_demo.engine.executor.decode_step import page_shape
    from vlm_demo.engine.executor.worker import Worker
    from vlm_demo.images import image_digest
    from vlm_demo.models import realshape
    from vlm_demo.models.tiny import solid_image
    from vlm_demo.request import SamplingParams

    dtype = torch.float32
    config = realshape.narrow_config(hidden=hidden)
    if init is not None:
        config.get_text_config().initializer_range = init
    model = realshape.build_model(config, dtype, "cpu", seed=seed)
    worker = Worker(model, realshape.real_processor(), "realshape")
    params = SamplingParams(max_new_tokens=steps, temperature=0.0).validated(steps)
    colours = ("red", "blue", "green", "yellow")
    requests = []
    for r in range(rows):
        image = solid_image(colours[r % 4], 1120, 1120, noise=40, seed=seed + r)  # 4 tiles each
        question = "Describe this picture in detail, please."
        requests.append(Request(image, question, params, inputs=worker.prepare(image, question),
                                image_key=image_digest(image)))  # fmt: skip
    with torch.inference_mode():
        prefill = worker.prefill(requests)
        shape = page_shape(model, dtype)
        pages = rows * shape.row_pages(max(r.input_tokens for r in requests) + steps + 1, shape.max_tiles) + 8
        decoders = _decoders(model, pages)
        running = {}
        first = prefill.logits.argmax(-1)
        for kind, decoder in decoders.items():
            rows_of = RunningRows(decoder.pool, decoder.attention, worker.device, dtype)
            places = rows_of.place(prefill, list(range(rows)))
            assert places is not None
            rows_of.rows = [Row(r, None, place=p) for r, p in zip(requests, places, strict=True)]  # type: ignore[arg-type]
            rows_of.next_tokens = first.clone()
            running[kind] = (decoder, rows_of)
        compared: dict[str, list[dict[str, float]]] = {"bf16": [], "fp8": [], "fp8_against_bf16": []}
        for _ in range(steps):
            logits = {kind: decoder(rows_of.step_inputs()) for kind, (decoder, rows_of) in running.items()}
            compared["bf16"].append(_compare(logits["fp32"], logits["bf16"]))
            compared["fp8"].append(_compare(logits["fp32"], logits["fp8"]))
            compared["fp8_against_bf16"].append(_compare(logits["bf16"], logits["fp8"]))
            forced = logits["fp32"].argmax(-1)
            for _, rows_of in running.values():
                rows_of.advance(forced)
    return {
        "model": f"realshape narrow_config(hidden={hidden}, layers=5, cross layers 1 and 3), random fp32 weights"
        f" (initializer range {config.get_text_config().initializer_range})",
        "rows": rows,
        "steps": steps,
        "prompt_tokens": [r.input_tokens for r in requests],
        "against_exact_cache": {kind: _summary(compared[kind]) for kind in ("bf16", "fp8")},
        "fp8_against_bf16": _summary(compared["fp8_against_bf16"]),
        "pool_bytes_per_token": {
            "bf16": running["fp32"][0].pool.shape.text_bytes_per_token // 2,
            "fp8": running["fp8"][0].pool.shape.text_bytes_per_token,
        },
    }


def tiny_answers(worker: Any, count: int = HELD_OUT) -> dict[str, Any]:
    """Held-out pictures on the tiny model with each cache, greedy (see the module's docstring)."""
    from vlm_demo.cot.stages import STAGES, parse_stages
    from vlm_demo.engine.batching.continuous import ContinuousEngine
    from vlm_demo.models.tiny import COLOURS, solid_image
    from vlm_demo.request import SamplingParams, validate_request

    sizes = [(37, 23), (300, 80), (64, 64), (90, 500), (700, 60), (57, 61)]
    wordings = ["What colour is this picture?", "Which colour do you see?", "Describe this image.", "colour?"]
    colours = list(COLOURS)
    jobs = []
    for i in range(count):
        colour, (w, h) = colours[i % len(colours)], sizes[(i // len(colours)) % len(sizes)]
        picture = solid_image(colour, w, h, noise=7, seed=900 + i)
        jobs.append((colour, validate_request(picture, wordings[i % 4], SamplingParams(400, 0.0))))
    texts: dict[str, list[str]] = {}
    for kind in ("auto", "fp8"):
        config = Config(batching="continuous", max_batch_size=8, batch_window_ms=0.0, kv_cache_dtype=kind)
        engine = ContinuousEngine(worker, config).start()
        try:
            texts[kind] = [getattr(r, "text", f"error: {r}") for r in engine.run_batch([valid for _, valid in jobs])]
        finally:
            engine.shutdown()

    def staged(text: str) -> bool:
        stages = parse_stages(text, final=True)
        return all(stages.as_tuple()) and stages.seen == STAGES and "</CONCLUSION>" in text

    def right(colour: str, text: str) -> bool:
        conclusion = parse_stages(text, final=True).conclusion
        return colour in conclusion and all(c not in conclusion for c in colours if c != colour)

    return {
        "pictures": count,
        **{
            kind: {
                "four_staged": sum(staged(t) for t in texts[kind]),
                "right_colour": sum(right(c, t) for (c, _), t in zip(jobs, texts[kind], strict=True)),
            }
            for kind in texts
        },
        "fp8_same_text_as_auto": sum(a == b for a, b in zip(texts["auto"], texts["fp8"], strict=True)),
    }


def report(steps: int = STEPS) -> dict[str, Any]:
    """``bench --kv-closeness``'s JSON."""
    from vlm_demo.engine.weights.loader import load
    from vlm_demo.models.tiny import ensure_tiny

    tiny = load(ensure_tiny(None), device="cpu")
    out = {
        "realshape_logits": logit_closeness(steps),
        "realshape_logits_llama_init": logit_closeness(steps, init=0.02),
        "tiny_answers": tiny_answers(tiny),
    }
    assert not math.isnan(out["realshape_logits"]["fp8_against_bf16"]["mean_abs_logit_difference"])
    return out
