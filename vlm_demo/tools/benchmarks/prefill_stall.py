"""``bench --prefill-stall``: how long the running rows wait while newcomers with pictures are admitted.

Eight rows decode long answers; then eight newcomers with 4-tile pictures arrive at once. The engine is
driven by hand (``step()`` on this thread, no engine thread, no client threads), so every running row gets a
token at the end of each step and the gap between two of its tokens is the step's duration. Reported:
``longest_decode_pause_s`` (the longest such gap from the newcomers' arrival until the last one's first token),
``median_decode_step_s`` (the median step that did no prefill work), their ratio, the newcomers' time to first
token, the steps admission took and the tiles the vision tower ran. Each configuration runs on a fresh engine:
``--prefill-share 0`` with every tile run (the engine before pacing and real tiles) and the defaults.

The model is the real structure at narrow widths (``realshape.narrow_config``) with a vision tower sized so
its share of the work is like the 11B model's on a GPU (:data:`VISION`): a 4-tile picture through the tower
takes about five decode steps of eight rows and a newcomer's prompt about one, as estimated for an H200
(docs/BENCHMARKS.md). The figures printed say what this machine made of it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlm_demo.config import Config
from vlm_demo.request import SamplingParams, ValidRequest, validate_request

ROWS = 8  # running rows
NEWCOMERS = 8
WARM_STEPS = 12  # steps before the newcomers arrive (the pacer measures the decode step meanwhile)
RUNNING_TOKENS = 1500  # the running rows never end during a run
NEWCOMER_TOKENS = 32
# The tower: 560-px tiles as at 11B, in 28-px patches (11B: 14 px; a 4-tile picture is 1,604 tokens, not 6,404:
# the attention's cost grows with their square), narrower and shallower (11B: 1280 wide, 32 + 8 layers).
VISION = {"hidden_size": 64, "attention_heads": 2, "intermediate_size": 256, "num_hidden_layers": 6,
          "num_global_layers": 2, "intermediate_layers_indices": [1, 3, 5], "vision_output_dim": 256,
          "patch_size": 28}  # fmt: skip
CONFIGURATIONS = {  # name -> Config overrides
    "before: at once, every tile": {"prefill_share": 0.0, "vision_tiles": "all"},
    "after: paced, real tiles": {},
}


def stall_model() -> tuple[Any, Any]:
    """The narrow real-shape model with :data:`VISION`'s tower (fp32, CPU) and the real processor."""
    from vlm_demo.models import realshape

    config = realshape.narrow_config()
    for key, value in VISION.items():
        setattr(config.vision_config, key, value)
    return realshape.build_model(config, torch.float32, "cpu"), realshape.real_processor()


def picture(index: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8))


def ask(index: int, size: tuple[int, int], tokens: int) -> ValidRequest:
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    valid = validate_request(picture(index, *size), f"What is in picture {index}?", params)
    return dataclasses.replace(valid, client=f"client-{index}")


def run_once(worker: Any, overrides: dict[str, Any], rows: int = ROWS, newcomers: int = NEWCOMERS) -> dict[str, Any]:
    """One engine, ``rows`` decoding, one arrival of ``newcomers`` with 4-tile pictures: the figures of that run."""
    from vlm_demo.engine.batching.continuous import ContinuousEngine

    config = Config(batching="continuous", max_batch_size=rows + newcomers, max_new_tokens=2048,
                    structured_stages=False, image_cache_mb=0, **overrides)  # fmt: skip
    engine = ContinuousEngine(worker, config)
    tiles_before, tile = worker.vision_tiles_run, worker.tower.image_size  # pictures of 1 and of 2 × 2 tiles
    durations: list[float] = []
    decode_only: list[float] = []

    def step() -> float:
        started = time.perf_counter()
        engine.table.apply(engine.step())
        took = time.perf_counter() - started
        durations.append(took)
        if not engine.prefill_s:
            decode_only.append(took)
        return took

    try:
        running = [engine.submit(ask(i, (tile, tile), RUNNING_TOKENS)) for i in range(rows)]
        for _ in range(WARM_STEPS):
            step()
        arrived = time.perf_counter()
        joining = [engine.submit(ask(100 + i, (2 * tile, 2 * tile), NEWCOMER_TOKENS)) for i in range(newcomers)]
        first_token: dict[int, float] = {}
        window: list[float] = []
        while len(first_token) < newcomers:
            window.append(step())
            for i, handle in enumerate(joining):
                if handle.token_ids and i not in first_token:
                    first_token[i] = time.perf_counter() - arrived
        for _ in range(WARM_STEPS):
            step()
        assert all(not h.done for h in running), "a running row ended during the run"
    finally:
        engine.shutdown()
    median = statistics.median(decode_only)
    return {
        **{k: v for k, v in dataclasses.asdict(config).items() if k in ("prefill_share", "vision_tiles")},
        "longest_decode_pause_s": round(max(window), 4),
        "median_decode_step_s": round(median, 4),
        "pause_over_median": round(max(window) / median, 2),
        "admission_steps": len(window),
        "newcomers_first_token_s": {
            "median": round(statistics.median(first_token.values()), 3),
            "last": round(max(first_token.values()), 3),
        },
        "vision_tiles": worker.vision_tiles_run - tiles_before,
        "steps": len(durations),
    }


def lone_first_token(worker: Any, overrides: dict[str, Any]) -> float:
    """A lone request's time to its first token (a 4-tile picture; nothing else runs)."""
    from vlm_demo.engine.batching.continuous import ContinuousEngine

    engine = ContinuousEngine(worker, Config(batching="continuous", max_batch_size=4, image_cache_mb=0,
                                             structured_stages=False, **overrides))  # fmt: skip
    try:
        started = time.perf_counter()
        side = 2 * worker.tower.image_size
        handle = engine.submit(ask(999, (side, side), 4))
        while not handle.token_ids:
            engine.table.apply(engine.step())
        return time.perf_counter() - started
    finally:
        engine.shutdown()


def report(repeats: int = 1) -> dict[str, Any]:
    """Every configuration ``repeats`` times, interleaved; the median run (by pause ratio) of each."""
    from vlm_demo.engine.executor.worker import Worker

    torch.set_num_threads(1)
    model, processor = stall_model()
    worker = Worker(model, processor, "narrow real-shape, prefill-stall tower")
    lone_first_token(worker, {})  # warm-up: first calls' overheads are not the engine's
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGURATIONS}
    for _ in range(repeats):
        for name, overrides in CONFIGURATIONS.items():
            result = run_once(worker, overrides)
            result["lone_first_token_s"] = round(lone_first_token(worker, overrides), 4)
            runs[name].append(result)
    chosen = {name: sorted(results, key=lambda r: r["pause_over_median"])[len(results) // 2]
              for name, results in runs.items()}  # fmt: skip
    after = chosen["after: paced, real tiles"]
    return {
        "model": "realshape.narrow_config() text (hidden 256, 5 layers, 128k vocabulary) with vision tower "
        + json.dumps(VISION)
        + ", fp32, CPU, 1 thread",
        "rows": ROWS,
        "newcomers": NEWCOMERS,
        "newcomer_tiles": 4,
        "repeats": repeats,
        "longest_decode_pause_s": after["longest_decode_pause_s"],
        "median_decode_step_s": after["median_decode_step_s"],
        "configurations": chosen,
        "all_runs": runs,
    }
