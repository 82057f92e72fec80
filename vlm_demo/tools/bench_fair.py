"""What fair share and the caches change: ``python -m vlm_demo.tools.bench_fair --model tiny``.

1. *Flood*: one client sends ``--flood`` long answers at once, then another client asks one short
   question; the short question's latency, next to the same question on an idle engine. "FIFO" sends both
   clients' requests as one anonymous client (the queue in arrival order, as before fair share); "fair"
   tells them apart (turns in the queue, and the flooder gives a row back).
2. *Think harder*: K-candidate answers one after another, with and without the image-state cache
   (every judge call would otherwise run the vision tower again), and the vision-tower runs counted.
3. *Response cache*: the same greedy request twice through the response cache.

Medians over ``--repeats``; the engine runs in this process (continuous batching).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from typing import Any

from vlm_demo.backends.cache import CachingBackend
from vlm_demo.backends.local import LocalBackend
from vlm_demo.config import Config
from vlm_demo.engine import make_engine
from vlm_demo.engine.loader import load
from vlm_demo.engine.worker import Worker
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.schema import STAGE_BEAM, Limits, SamplingParams, ValidRequest, validate_request

LIMITS = Limits(max_new_tokens=100_000)
QUESTION = "What colour is this image?"


def request(colour: str, question: str, params: SamplingParams, client: str = "", size: int = 48) -> ValidRequest:
    valid = validate_request(solid_image(colour, size, size), question, params, LIMITS)
    return dataclasses.replace(valid, client=client)


def flood(worker: Worker, rows: int, flood_size: int, long_tokens: int, fair: bool) -> dict[str, float]:
    """The short question's latency while one client floods, and alone on the same idle engine."""
    config = Config(batching="continuous", max_batch_size=rows, batch_window_ms=0.0, max_per_client=0)
    engine = make_engine(config, worker)
    try:
        short = SamplingParams(160, 0.0)
        started = time.monotonic()
        engine.submit(request("blue", QUESTION, short, "visitor" if fair else "")).result(timeout=600)
        idle = time.monotonic() - started
        long = SamplingParams(long_tokens, 0.0, ignore_eos=True)
        colours = list(COLOURS)
        handles = [
            engine.submit(request(colours[i % 6], "Describe this picture in detail.", long, "flood" if fair else ""))
            for i in range(flood_size)
        ]
        while sum(len(h.token_ids) > 8 for h in handles) < min(rows, flood_size):
            time.sleep(0.002)
        started = time.monotonic()
        engine.submit(request("blue", QUESTION, short, "visitor" if fair else "")).result(timeout=600)
        loaded = time.monotonic() - started
        for handle in handles:
            handle.cancel()
        return {"idle_s": idle, "flooded_s": loaded, "ratio": loaded / idle, "preemptions": engine.stats().preemptions}
    finally:
        engine.shutdown()


def think_harder(worker: Worker, beams: int, answers: int, image_cache_mb: float) -> dict[str, float]:
    config = Config(batching="continuous", max_batch_size=16, batch_window_ms=0.0, image_cache_mb=image_cache_mb)
    engine = make_engine(config, worker)
    try:
        before = engine.stats().vision_encodes
        started = time.monotonic()
        for i in range(answers):
            params = SamplingParams(300, 1.0, 1.0, seed=i, reasoning=STAGE_BEAM, beams=beams)
            engine.submit(request(list(COLOURS)[i % 6], QUESTION, params, size=560)).result(timeout=600)
        wall = time.monotonic() - started
        return {
            "wall_s": wall,
            "per_answer_s": wall / answers,
            "vision_encodes": engine.stats().vision_encodes - before,
        }
    finally:
        engine.shutdown()


def response_cache(worker: Worker) -> dict[str, float]:
    engine = make_engine(Config(batching="continuous", max_batch_size=8, batch_window_ms=0.0), worker)
    backend = CachingBackend(LocalBackend(engine, "tiny"), 64 * 1024**2)
    try:
        item = request("green", "Describe this picture in detail.", SamplingParams(400, 0.0))
        times, texts = [], []
        for _ in range(2):
            started = time.monotonic()
            texts.append(backend.submit(item).result(timeout=600).text)
            times.append(time.monotonic() - started)
        return {"first_s": times[0], "repeat_s": times[1], "ratio": times[1] / times[0], "same": texts[0] == texts[1]}
    finally:
        backend.close()


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        k: statistics.median([r[k] for r in runs]) if isinstance(runs[0][k], float) else runs[0][k] for k in runs[0]
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="python -m vlm_demo.tools.bench_fair", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--flood", type=int, default=32, help="long answers the flooding client sends")
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--answers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default="")
    args = parser.parse_args(argv)
    worker = load(args.model, args.device)
    report: dict[str, Any] = {}
    for fair in (False, True):
        runs = [flood(worker, args.max_batch_size, args.flood, args.long_tokens, fair) for _ in range(args.repeats)]
        report["flood_fair" if fair else "flood_fifo"] = median_of(runs)
    for mb in (0.0, 2048.0):
        runs = [think_harder(worker, args.beams, args.answers, mb) for _ in range(args.repeats)]
        report["think_harder_image_cache" if mb else "think_harder_no_image_cache"] = median_of(runs)
    report["response_cache"] = median_of([response_cache(worker) for _ in range(args.repeats)])
    for name, figures in report.items():
        print(
            f"{name:<30} "
            + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
