"""What fair share and the caches change: ``python -m vlm_demo.tools.bench_fair --model tiny``.

1. *Flood*: one client sends ``--flood`` long answers at once, then another client asks one short
   question; the short question's latency, next to the same question on an idle engine. "FIFO" sends both
   clients' requests as one anonymous client (the queue in arrival order, as before fair share); "fair"
   tells them apart (turns in the queue, and the flooder gives a row back).
2. *Think harder*: K-candidate answers one after another, with and without the image-state cache
   (every judge call would otherwise run the vision tower again), and the vision-tower runs counted.
3. *Response cache*: the same greedy request twice through the response cache.

Medians over ``--repeats``; the engine runs in this process (continuous batching). ``--through-app`` runs the
flood through the running web app instead (``app.py``, its default per-client cap), as two addresses would
(``X-Forwarded-For`` from the loopback proxy uvicorn trusts) over Gradio's HTTP API: the flooder's excess
is refused at once, and the visitor's latency is measured against the same question on the idle app.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import requests

from vlm_demo.backends.cache import CachingBackend
from vlm_demo.backends.local import LocalBackend
from vlm_demo.config import Config
from vlm_demo.engine import make_engine
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.weights.loader import load
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.request import STAGE_BEAM, Limits, SamplingParams, ValidRequest, validate_request

LIMITS = Limits(max_new_tokens=100_000)
QUESTION = "What colour is this image?"


def request(colour: str, question: str, params: SamplingParams, client: str = "", size: int = 48) -> ValidRequest:
    valid = validate_request(solid_image(colour, size, size), question, params, LIMITS)
    return dataclasses.replace(valid, client=client)


def flood(worker: Worker, rows: int, flood_size: int, long_tokens: int, fair: bool) -> dict[str, float]:
    """The short question's latency while one client floods, and alone on the same idle engine."""
    config = Config(batching="continuous", max_batch_size=rows, batch_window_ms=0.0)  # the engine caps no client
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


@dataclasses.dataclass
class Asked:
    """One question over Gradio's HTTP API: how it ended, its CONCLUSION or error, and when it ended."""

    ok: bool
    said: str  # the CONCLUSION, or the error's message
    ended: float  # time.monotonic() when the last event arrived


def ask_over_http(url: str, image_png: bytes, question: str, tokens: int, address: str) -> Asked:
    """Upload, ``POST /gradio_api/call/ask``, read its events: as a script on ``address`` would (the address in
    ``X-Forwarded-For``, which the app trusts from a loopback proxy)."""
    headers = {"X-Forwarded-For": address}
    with requests.Session() as session:
        files = {"files": ("image.png", image_png, "image/png")}
        path = session.post(f"{url}/gradio_api/upload", files=files, headers=headers, timeout=60).json()[0]
        data: list[Any] = [{"path": path, "meta": {"_type": "gradio.FileData"}}, question, tokens, 0.0, 1.0]
        call = session.post(f"{url}/gradio_api/call/ask", json={"data": data}, headers=headers, timeout=60)
        event = call.json()["event_id"]
        kind, payload = "", ""
        with session.get(f"{url}/gradio_api/call/ask/{event}", headers=headers, stream=True, timeout=600) as stream:
            for line in cast(Iterator[str], stream.iter_lines(decode_unicode=True)):  # an event stream: text
                if line.startswith("event:"):
                    kind = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and kind in ("complete", "error"):
                    payload = line.split(":", 1)[1].strip()
                    break
    if kind == "complete":
        return Asked(True, json.loads(payload)[3], time.monotonic())
    return Asked(False, payload, time.monotonic())


def png(colour: str, size: int = 48) -> bytes:
    buffer = io.BytesIO()
    solid_image(colour, size, size).save(buffer, format="PNG")
    return buffer.getvalue()


def flood_through_app(args: argparse.Namespace) -> dict[str, Any]:
    """The flood through the running app: one address sends ``--flood`` long answers at once, another asks a
    short question once the flooder's rows run; medians over ``--repeats``, against the idle app."""
    from vlm_demo.tools.benchmarks.load_clients import ServerProcess

    server = ServerProcess(["app.py", "--model", args.model, "--max-batch-size", str(args.max_batch_size)])
    runs = []
    try:
        for repeat in range(args.repeats):
            colour = list(COLOURS)[repeat % 6]  # another picture each time: no answer from the response cache
            started = time.monotonic()
            alone = ask_over_http(server.url, png(colour, 40 + repeat), QUESTION, 160, "198.51.100.9")
            idle = alone.ended - started
            with ThreadPoolExecutor(args.flood) as pool:
                flood = [
                    pool.submit(ask_over_http, server.url, png(colour, 60 + i), "Describe this picture in detail.",
                                args.long_tokens, "203.0.113.7")
                    for i in range(args.flood)
                ]  # fmt: skip
                deadline = time.monotonic() + 120
                while running(server.url) < args.max_batch_size and time.monotonic() < deadline:
                    time.sleep(0.01)
                started = time.monotonic()
                visitor = ask_over_http(server.url, png(colour, 41 + repeat), QUESTION, 160, "198.51.100.9")
                flooded = visitor.ended - started
                answers = [f.result() for f in flood]
            runs.append(
                {
                    "idle_s": idle,
                    "flooded_s": flooded,
                    "ratio": flooded / idle,
                    "visitor_right": visitor.ok and colour in visitor.said,
                    "flood_refused": float(sum(not a.ok and "answers in progress" in a.said for a in answers)),
                    "flood_answered": float(sum(a.ok for a in answers)),
                    "flood_after_visitor": float(sum(a.ok and a.ended > visitor.ended for a in answers)),
                }
            )
    finally:
        server.close()
    return median_of(runs)


def running(url: str) -> int:
    """The answers the app's engine is running now, as /health says."""
    return int(requests.get(f"{url}/health", timeout=10).json().get("details", {}).get("running") or 0)


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
        k: statistics.median([r[k] for r in runs])
        if isinstance(runs[0][k], float)
        else all(r[k] for r in runs)
        if isinstance(runs[0][k], bool)
        else runs[0][k]
        for k in runs[0]
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
    parser.add_argument("--through-app", action="store_true", help="only the flood, through the running web app")
    parser.add_argument("--json", dest="json_path", default="")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {}
    if args.through_app:
        report["flood_through_app"] = flood_through_app(args)
        return _report(report, args.json_path)
    worker = load(args.model, args.device)
    for fair in (False, True):
        runs = [flood(worker, args.max_batch_size, args.flood, args.long_tokens, fair) for _ in range(args.repeats)]
        report["flood_fair" if fair else "flood_fifo"] = median_of(runs)
    for mb in (0.0, 2048.0):
        runs = [think_harder(worker, args.beams, args.answers, mb) for _ in range(args.repeats)]
        report["think_harder_image_cache" if mb else "think_harder_no_image_cache"] = median_of(runs)
    report["response_cache"] = median_of([response_cache(worker) for _ in range(args.repeats)])
    return _report(report, args.json_path)


def _report(report: dict[str, Any], json_path: str) -> dict[str, Any]:
    for name, figures in report.items():
        print(
            f"{name:<30} "
            + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        )
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
