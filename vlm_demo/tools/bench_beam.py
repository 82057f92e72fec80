"""What "Think harder" costs: wall time per answer of stage-level beam search, batched vs one at a time.

For K candidates per stage (default 1, 2 and 4) every answer is run twice on the same engine and seeds:
with the stage's K candidates as one batch and each round's judge calls as one batch (what the server
does), and ``serial``, the same search one candidate and one judge call at a time (what the paper's
script does, minus its re-prefilling). Answers run one after another, so the time is one visitor's
wait on an otherwise idle server. The normal mode is measured alongside for reference.

    python -m vlm_demo.tools.bench_beam --model tiny --beams 1,2,4 --answers 12 --repeats 3

At temperature 1 (the default here) the tiny model's candidates disagree often enough that judging
runs; at the page's default (0.6, top-p 0.9) they are mostly identical and are not judged at all.
Every answer's CONCLUSION is checked against the image's colour (``right``). ``x K=1 batched`` is,
per repeat, a row's mean wall time over K=1 batched's in that repeat; the median of those is shown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass

from vlm_demo.config import Config
from vlm_demo.engine import make_engine
from vlm_demo.engine.batching.base import Engine
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.request import NORMAL, STAGE_BEAM, Limits, SamplingParams, ValidRequest, validate_request

log = logging.getLogger("vlm_demo.tools.bench_beam")

LIMITS = Limits(max_new_tokens=100_000)
QUESTIONS = ("What colour is this image?", "Describe this picture in detail.", "Which colour do you see here?")
SIZES = ((64, 64), (300, 120), (40, 500), (560, 560))


@dataclass
class BeamRun:
    mode: str  # "normal", "batched" or "serial"
    beams: int
    answers: int
    s_per_answer: float  # median over the answers
    mean_s: float
    judge_calls: float  # per answer
    right: int  # answers whose CONCLUSION names the image's colour
    tokens: float  # answer tokens (winners only) per answer
    vs_k1: float = 0.0  # mean wall time over K=1 batched's in the same repeat (median over repeats)


def workload(n: int, k: int, serial: bool, temperature: float, top_p: float, max_new_tokens: int) -> list:
    """``n`` answers (seeded: the same candidates in every mode of one K) and their image colours."""
    colours = list(COLOURS)
    items = []
    for i in range(n):
        colour = colours[i % len(colours)]
        width, height = SIZES[i % len(SIZES)]
        reasoning = NORMAL if k == 0 else STAGE_BEAM
        params = SamplingParams(max_new_tokens, temperature, top_p, seed=1000 + i, reasoning=reasoning, beams=max(k, 1))
        question = QUESTIONS[i % len(QUESTIONS)]
        valid = validate_request(solid_image(colour, width, height), question, params, LIMITS)
        items.append((dataclasses.replace(valid, serial_beams=serial), colour))
    return items


def run(engine: Engine, items: list[tuple[ValidRequest, str]], mode: str, k: int) -> BeamRun:
    times, calls, right, tokens = [], [], 0, []
    for valid, colour in items:
        start = time.perf_counter()
        result = engine.generate(valid)
        times.append(time.perf_counter() - start)
        calls.append(result.beam.judge_calls if result.beam is not None else 0)
        tokens.append(result.completion_tokens)
        conclusion = result.text.rsplit("<CONCLUSION>", 1)[-1]
        right += colour in conclusion and not any(c in conclusion for c in COLOURS if c != colour)
    return BeamRun(
        mode,
        k,
        len(items),
        round(statistics.median(times), 4),
        round(statistics.fmean(times), 4),
        round(statistics.fmean(calls), 2),
        right,
        round(statistics.fmean(tokens), 1),
    )


def summarise(collected: dict[tuple[str, int], list[BeamRun]]) -> list[BeamRun]:
    """Each row's median repeat, with its cost over K=1 batched taken pair by pair: repeats interleave the
    modes, so a repeat's ratio cancels the box's slow drifts, which the ratio of two medians does not."""
    base = collected.get(("batched", 1))
    runs = []
    for rs in collected.values():
        median = sorted(rs, key=lambda r: r.mean_s)[len(rs) // 2]
        if base:
            median.vs_k1 = round(statistics.median(r.mean_s / b.mean_s for r, b in zip(rs, base, strict=True)), 3)
        runs.append(median)
    return runs


def print_table(runs: list[BeamRun]) -> None:
    print(
        f"{'mode':8} {'K':>2} {'s/answer (median)':>18} {'mean s':>8} {'x K=1 batched':>14} {'judge calls':>12} "
        f"{'right':>6} {'tokens':>7}"
    )
    for r in runs:
        ratio = f"{r.vs_k1:.2f}" if r.vs_k1 else "-"
        print(
            f"{r.mode:8} {r.beams:>2} {r.s_per_answer:>18.3f} {r.mean_s:>8.3f} {ratio:>14} {r.judge_calls:>12.2f} "
            f"{r.right:>3}/{r.answers:<2} {r.tokens:>7.1f}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vlm_demo.tools.bench_beam", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="model id, folder, or 'tiny'")
    p.add_argument("--device", default="auto")
    p.add_argument("--beams", default="1,2,4", help="comma-separated candidates per stage")
    p.add_argument("--answers", type=int, default=12, help="answers per (mode, K)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats; the median repeat is reported")
    p.add_argument("--json", dest="json_path", default="", help="write the runs as a JSON list")
    return p


def main(argv: list[str] | None = None) -> list[BeamRun]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    config = Config(model=args.model, device=args.device, batching="continuous", batch_window_ms=0.0)
    engine = make_engine(config)
    plan = [("normal", 0)] + [(mode, int(k)) for k in args.beams.split(",") for mode in ("batched", "serial")]
    try:
        engine.generate(workload(1, 2, False, args.temperature, args.top_p, 64)[0][0])  # warm-up
        collected: dict[tuple[str, int], list[BeamRun]] = {}
        for repeat in range(args.repeats):
            for mode, k in plan:
                items = workload(args.answers, k, mode == "serial", args.temperature, args.top_p, args.max_new_tokens)
                result = run(engine, items, mode, max(k, 1) if mode != "normal" else 1)
                log.info("repeat %d: %s", repeat + 1, result)
                collected.setdefault((mode, k), []).append(result)
    finally:
        engine.shutdown()
    runs = summarise(collected)
    print_table(runs)
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump([asdict(r) for r in runs], fh, indent=2)
    return runs


if __name__ == "__main__":
    main()
