"""Closed-loop load benchmark: batching modes side by side, in one process, on one model.

Like perf_analyzer's concurrency sweep: at each concurrency level C, C client threads each send a
request, wait for its last token, and send the next, until ``--requests`` have been served. Every
mode (``unbatched`` = max batch 1, ``dynamic``, ``continuous``, ``triton``) runs against the same
loaded weights, the same requests and the same forced output lengths (``ignore_eos``), so the
ratios between modes are fair even on a noisy machine. ``--repeats`` interleaves the modes and
reports medians.

    python -m vlm_demo.tools.bench --model tiny --concurrency 1,2,4,8 --requests 32 --json out.json --plot out.png

``--through-app`` measures what a visitor gets: the same load through the running web app (``/ask``
streaming and ``/ask_batch``, via ``gradio_client``), next to the engine alone in this process and the
FastAPI static batcher of the design documents (:mod:`vlm_demo.tools.baseline`), each in one run:

    python -m vlm_demo.tools.bench --model tiny --through-app --json docs/bench_app.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import re
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlm_demo.config import Config
from vlm_demo.engine import make_engine
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.weights.loader import load
from vlm_demo.engine.weights.quantize import KINDS
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.request import Limits, SamplingParams, ValidRequest, validate_request
from vlm_demo.tools.benchmarks.stats import cpu_seconds, percentile

log = logging.getLogger("vlm_demo.tools.bench")

SIZES = ((64, 64), (300, 120), (120, 300), (560, 560), (1024, 64), (40, 40))
BENCH_LIMITS = Limits(max_new_tokens=100_000)
QUESTIONS = (
    "What colour is this image?",
    "Describe the picture.",
    "Which colour dominates here, and why do you think so?",
    "Tell me about it.",
)


@dataclass
class Sample:
    latency_s: float
    ttft_s: float
    tokens: int
    batch_size: int
    error: str | None = None
    wrong: bool = False  # the answer is not the right one (checked when the workload knows it)


@dataclass
class RunResult:
    """One (mode, concurrency) measurement; the JSON keys are a public contract."""

    mode: str
    max_batch_size: int
    concurrency: int
    requests: int
    throughput_rps: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p95_s: float
    ttft_p50_s: float
    mean_batch_size: float
    errors: int
    wall_s: float
    wrong: int = 0  # finished answers that were not right (only workloads that know the answer)
    cpu_ms_per_request: dict[str, float] = dataclasses.field(default_factory=dict)  # by process, Linux only
    # The page pool's traffic during the run (continuous engines that report it; None elsewhere): bytes of
    # keys/values moved by joins, leaves and preemptions per byte written for new tokens, and bytes decode
    # attention read per byte of the rows' own tokens and tiles.
    kv_copied_per_written: float | None = None
    attention_read_over_live: float | None = None

    def __str__(self) -> str:
        """One readable line for the log (the table and the JSON hold every field)."""
        line = (
            f"{self.mode} · {self.concurrency} clients · {self.throughput_rps:.2f} req/s · "
            f"{self.tokens_per_s:.1f} tok/s · p50 {self.latency_p50_s:.3f} s · p95 {self.latency_p95_s:.3f} s · "
            f"mean batch {self.mean_batch_size:.2f}"
        )
        if self.errors or self.wrong:
            line += f" · {self.errors} errors · {self.wrong} wrong"
        return line


def forced_lengths(n: int, mixed: bool, max_new_tokens: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Per-request output lengths: all equal, or a seeded log-uniform spread in ``[low, high]``."""
    if not mixed:
        return [max_new_tokens] * n
    rng = random.Random(seed)
    return [int(round(math.exp(rng.uniform(math.log(low), math.log(high))))) for _ in range(n)]


def make_workload(n: int, lengths: list[int]) -> list[ValidRequest]:
    """Solid-colour images of several sizes and questions; greedy; forced length per request."""
    items = []
    colours = list(COLOURS)  # same order as the tiny model's table
    for i in range(n):
        width, height = SIZES[i % len(SIZES)]
        image = solid_image(colours[i % len(colours)], width, height)
        params = SamplingParams(max_new_tokens=lengths[i], temperature=0.0, ignore_eos=True)
        items.append(validate_request(image, QUESTIONS[i % len(QUESTIONS)], params, BENCH_LIMITS))
    return items


MIX_QUESTIONS = ("What colour is this image?", "Describe this picture in detail.")  # short and long answers
MIX_SIZES = ((64, 64), (300, 120), (120, 300), (560, 560))


def mixed_workload(n: int, max_new_tokens: int = 512) -> tuple[list[ValidRequest], list[str]]:
    """Half short, half long answers at their natural lengths (greedy, no forced length): six colours,
    four image sizes. Returns the requests and each one's colour, to check the answers."""
    colours = list(COLOURS)[:6]
    items, expected = [], []
    for i in range(n):
        colour = colours[i % len(colours)]
        width, height = MIX_SIZES[(i // len(colours)) % len(MIX_SIZES)]
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        items.append(validate_request(solid_image(colour, width, height), MIX_QUESTIONS[i % 2], params, BENCH_LIMITS))
        expected.append(colour)
    return items, expected


def names_colour(expected: list[str]) -> Callable[[int, str], bool]:
    """Right answer for the tiny model: the CONCLUSION names the image's colour."""

    def check(index: int, text: str) -> bool:
        match = re.search(r"<CONCLUSION>(.*?)(</CONCLUSION>|$)", text, re.S)
        return match is not None and expected[index] in match.group(1).lower()

    return check


TRAFFIC_FIELDS = ("kv_copied_bytes", "kv_written_bytes", "attention_read_bytes", "attention_live_bytes")


def traffic(backend: Any) -> dict[str, int] | None:
    """The engine's key/value byte counters now (``None`` where the backend reports none)."""
    engine = getattr(backend.health(), "engine", None)
    if engine is None or not engine.kv_written_bytes:
        return None
    return {name: getattr(engine, name) for name in TRAFFIC_FIELDS}


def traffic_ratios(before: dict[str, int] | None, after: dict[str, int] | None) -> tuple[float | None, float | None]:
    """``kv_copied_per_written`` and ``attention_read_over_live`` over the run between the two readings."""
    if before is None or after is None:
        return None, None
    delta = {name: after[name] - before[name] for name in TRAFFIC_FIELDS}
    written, live = delta["kv_written_bytes"], delta["attention_live_bytes"]
    copied = round(delta["kv_copied_bytes"] / written, 4) if written else None
    read = round(delta["attention_read_bytes"] / live, 4) if live else None
    return copied, read


class BatchCounter:
    """Engine listener that records batch sizes (for ``mean_batch_size``)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_batch(self, size: int) -> None:
        self.sizes.append(size)

    def on_request_done(self, request: Any) -> None:
        pass


def run_load(
    backend: Any,
    workload: list[ValidRequest],
    concurrency: int,
    check: Callable[[int, str], bool] | None = None,
    timeout: float = 600.0,
) -> tuple[list[Sample], float]:
    """Closed loop: ``concurrency`` threads each keep one request in flight until all are served.

    ``check(index, text)`` says whether request ``index`` got the right answer. A request that sends
    nothing for ``timeout`` seconds is cancelled and counted as an error.
    """
    samples: list[Sample] = []
    lock = threading.Lock()
    cursor = iter(range(len(workload)))

    def client() -> None:
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            start = time.monotonic()
            first = None
            try:
                handle = backend.submit(workload[index])
                try:
                    for _ in handle.stream(timeout=timeout):
                        if first is None:
                            first = time.monotonic()
                    result = handle.result(timeout=timeout)
                except TimeoutError:
                    handle.cancel()
                    raise
                end = time.monotonic()
                sample = Sample(end - start, (first or end) - start, result.completion_tokens, result.batch_size)
                sample.wrong = check is not None and not check(index, result.text)
            except Exception as exc:  # counted, not fatal: the benchmark reports errors
                sample = Sample(time.monotonic() - start, 0.0, 0, 0, f"{type(exc).__name__}: {exc}")
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.monotonic() - began


def summarise(
    mode: str, max_batch_size: int, concurrency: int, samples: list[Sample], wall_s: float, batches: list[int]
) -> RunResult:
    ok = [s for s in samples if s.error is None]
    tokens = sum(s.tokens for s in ok)
    if batches:
        mean_batch = statistics.fmean(batches)
    else:
        mean_batch = statistics.fmean([s.batch_size for s in ok]) if ok else 0.0
    return RunResult(
        mode=mode,
        max_batch_size=max_batch_size,
        concurrency=concurrency,
        requests=len(samples),
        throughput_rps=len(ok) / wall_s if wall_s > 0 else 0.0,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        latency_p50_s=percentile([s.latency_s for s in ok], 50),
        latency_p95_s=percentile([s.latency_s for s in ok], 95),
        ttft_p50_s=percentile([s.ttft_s for s in ok], 50),
        mean_batch_size=round(mean_batch, 3),
        errors=len(samples) - len(ok),
        wall_s=wall_s,
        wrong=sum(1 for s in ok if s.wrong),
    )


def median_run(runs: list[RunResult]) -> RunResult:
    """Field-wise median over repeats of the same (mode, concurrency)."""
    if len(runs) == 1:
        return runs[0]
    merged = {}
    for f in dataclasses.fields(RunResult):
        values = [getattr(r, f.name) for r in runs]
        merged[f.name] = statistics.median(values) if isinstance(values[0], float) else values[0]
    for name in ("kv_copied_per_written", "attention_read_over_live"):
        values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
        merged[name] = statistics.median(values) if values else None
    merged["errors"] = sum(r.errors for r in runs)
    merged["wrong"] = sum(r.wrong for r in runs)
    return RunResult(**merged)


def print_table(results: list[RunResult]) -> None:
    header = f"{'mode':<11}{'maxB':>5}{'conc':>5}{'reqs':>5}{'req/s':>9}{'tok/s':>9}{'p50 s':>8}{'p95 s':>8}{'ttft s':>8}{'meanB':>7}{'err':>5}{'wrong':>6}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.mode:<11}{r.max_batch_size:>5}{r.concurrency:>5}{r.requests:>5}{r.throughput_rps:>9.2f}"
            f"{r.tokens_per_s:>9.1f}{r.latency_p50_s:>8.3f}{r.latency_p95_s:>8.3f}{r.ttft_p50_s:>8.3f}"
            f"{r.mean_batch_size:>7.2f}{r.errors:>5}{r.wrong:>6}"
            + ("   cpu ms/req: " + ", ".join(f"{k} {v:.0f}" for k, v in r.cpu_ms_per_request.items()))
            + (
                f"   kv copied/written {r.kv_copied_per_written}, attention read/live {r.attention_read_over_live}"
                if r.attention_read_over_live is not None
                else ""
            )
        )
    by_level: dict[int, dict[str, RunResult]] = {}
    for r in results:
        by_level.setdefault(r.concurrency, {})[r.mode] = r
    for level, modes in sorted(by_level.items()):
        base = modes.get("unbatched")
        if base and base.throughput_rps > 0:
            ratios = ", ".join(
                f"{m} {r.throughput_rps / base.throughput_rps:.2f}x" for m, r in modes.items() if m != "unbatched"
            )
            print(f"concurrency {level}: throughput vs unbatched: {ratios}")
        for base_name in ("engine", "static"):
            base = modes.get(base_name)
            if base and base.throughput_rps > 0:
                ratios = ", ".join(
                    f"{m} {r.throughput_rps / base.throughput_rps:.2f}x"
                    for m, r in modes.items()
                    if m.startswith("app") or (base_name == "static" and m == "engine")
                )
                if ratios:
                    print(f"concurrency {level}: throughput vs {base_name}: {ratios}")


def plot(results: list[RunResult], path: str, title: str = "") -> Any:
    """Throughput and p95 latency by client count, one line per mode; returns the figure (saved to ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r.mode for r in results):
        rows = sorted((r for r in results if r.mode == mode), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in rows]
        ax1.plot(xs, [r.throughput_rps for r in rows], marker="o", label=mode)
        ax2.plot(xs, [r.latency_p95_s for r in rows], marker="o", label=mode)
    ax1.set(xlabel="concurrency (closed-loop clients)", ylabel="throughput (req/s)", title="Throughput")
    ax2.set(xlabel="concurrency (closed-loop clients)", ylabel="p95 latency (s)", title="p95 latency")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # client counts are whole numbers
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def describe_run(args: argparse.Namespace) -> str:
    """What was measured, for the plot's title: model, device, batch, workload, repeats."""
    lengths = f"max {args.max_new_tokens} new tokens" + (" (mixed lengths)" if args.mixed_lengths else "")
    return (
        f"{args.model} on {args.device} · max batch {args.max_batch_size or 'auto'} · {args.workload} workload, "
        f"{args.requests} requests, {lengths} · median of {args.repeats}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vlm_demo.tools.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="model id, folder, or 'tiny'")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated closed-loop client counts")
    p.add_argument("--requests", type=int, default=32, help="requests per (mode, concurrency)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="forced output length (uniform lengths)")
    p.add_argument("--max-batch-size", type=int, default=8, help="batch limit for the batched modes")
    p.add_argument("--batch-window-ms", type=float, default=50.0)
    p.add_argument("--mixed-lengths", action="store_true", help="seeded log-uniform forced lengths")
    p.add_argument("--length-range", default="16,512", help="low,high for --mixed-lengths")
    p.add_argument(
        "--modes",
        default="unbatched,dynamic,continuous",
        help="comma-separated: unbatched,dynamic,continuous (in-process engines), engine (in-process, the app's "
        "batching mode), engine-process (the same engine in its own process, over the pipe), app-ask, app-batch (the running web app via gradio_client), app-sse (its /ask over plain HTTP and "
        "server-sent events, a light client), app-openai (its /v1/chat/completions, streaming, the same light "
        "client), static (FastAPI static batcher baseline), triton",
    )
    p.add_argument(
        "--workload",
        choices=("forced", "mix"),
        default="forced",
        help="forced: --max-new-tokens or --mixed-lengths forced lengths; mix: half 'What colour is this image?', "
        "half 'Describe this picture in detail.' at natural lengths (answers checked)",
    )
    p.add_argument(
        "--through-app",
        action="store_true",
        help="preset: the engine alone vs the running app (/ask, /ask_batch, /v1) vs the static batcher, app defaults, "
        "--workload mix, 8 clients, 48 requests, max_new_tokens 512",
    )
    p.add_argument("--static-window-ms", type=float, default=100.0, help="collector window of the static baseline")
    p.add_argument("--static-max-batch-size", type=int, default=4, help="batch size of the static baseline")
    p.add_argument("--triton-url", default="", help="also measure a Triton endpoint (adds mode 'triton')")
    p.add_argument("--triton-model", default="llama_3_2v_11b_cot_ensemble")
    p.add_argument("--triton-protocol", default="auto")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats; medians are reported")
    p.add_argument(
        "--page-load",
        default="",
        help="instead of the closed loop: start the app and run N light page visitors at once (comma-separated "
        "counts, e.g. 16,128,256); reports the web process's CPU per page update, update gaps, time to first "
        "text, /health latency, errors and idle CPU (vlm_demo.tools.benchmarks.page_load)",
    )
    p.add_argument("--page-question", default="Describe this picture in detail.", help="what page visitors ask")
    p.add_argument("--page-tokens", type=int, default=300, help="max new tokens page visitors ask for")
    p.add_argument(
        "--count-kernels",
        action="store_true",
        help="print, as JSON, the kernels one decode step launches at the real 11B depth and the bytes its linear "
        "layers read from their weights (tools/benchmarks/kernel_count.py)",
    )
    p.add_argument(
        "--quantize",
        choices=KINDS,
        default="none",
        help="the language model's weight format: for --count-kernels the format counted; for the in-process modes "
        "(unbatched, dynamic, continuous, engine) the format the model loads in",
    )
    p.add_argument(
        "--kv-closeness",
        action="store_true",
        help="instead of the closed loop: how close an fp8 key/value cache keeps the model (--kv-cache-dtype fp8), as "
        "JSON: teacher-forced logits against the bf16 cache on the real-shape model, and the tiny model's held-out "
        "answers with each cache (vlm_demo.tools.benchmarks.kv_closeness)",
    )
    p.add_argument(
        "--prefill-stall",
        action="store_true",
        help="instead of the closed loop: 8 rows decoding while 8 newcomers with 4-tile pictures join at once, "
        "before (prefilled at once, every tile) and after (paced, real tiles); prints the longest pause of the "
        "running rows and the median decode step as JSON (vlm_demo.tools.benchmarks.prefill_stall; --repeats runs each)",
    )
    p.add_argument(
        "--kernel-sass",
        action="store_true",
        help="instead of the closed loop: compile every decode kernel (attention_text, attention_image, merge, "
        "attention_text_fp8, attention_image_fp8 (over --kv-cache-dtype fp8 pages), packed_int8, packed_fp8, packed_int4) at the 11B shapes for sm_80, sm_89, sm_90 and sm_120 with a launch's "
        "specialisation, read the machine code, and print per kernel and target its registers, spills, main loop "
        "and ceiling as JSON (vlm_demo.tools.benchmarks.kernel_sass; no GPU needed)",
    )
    p.add_argument("--sass-targets", default="", help="with --kernel-sass: only these targets (comma-separated)")
    p.add_argument("--sass-kernels", default="", help="with --kernel-sass: only these kernels (comma-separated)")
    p.add_argument("--json", dest="json_path", default="", help="write the runs as a JSON list")
    p.add_argument("--plot", dest="plot_path", default="", help="write a PNG of throughput and p95 latency")
    return p


def backend_factories(args: argparse.Namespace) -> dict[str, tuple[int, Callable[[], Any]]]:
    """Mode name -> (max batch size, factory of a fresh backend). Local modes share one worker."""
    from vlm_demo.backends.local import LocalBackend

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.triton_url and "triton" not in modes:
        modes.append("triton")
    factories: dict[str, tuple[int, Callable[[], Any]]] = {}
    worker: Worker | None = None
    if any(m in ("unbatched", "dynamic", "continuous", "engine") for m in modes):
        worker = load(args.model, args.device, args.dtype, cpu_threads=args.cpu_threads, quantize=args.quantize)

    def local(max_batch: int, batching: str) -> Callable[[], Any]:
        def make() -> Any:
            config = Config(
                model=args.model,
                batching=batching,
                max_batch_size=max_batch,
                batch_window_ms=args.batch_window_ms,
                max_queue=max(1024, args.requests),
                max_new_tokens=100_000,
            )
            engine = make_engine(config, worker)
            return LocalBackend(engine, args.model)

        return make

    def app(endpoint: str) -> Callable[[], Any]:
        def make() -> Any:
            from vlm_demo.tools.benchmarks.load_clients import AppClient, OpenAIClient, ServerProcess, SSEClient

            command = ["app.py", "--model", args.model, "--max-batch-size", str(args.max_batch_size)]
            command += ["--cpu-threads", str(args.cpu_threads), "--max-new-tokens", str(max(2048, args.max_new_tokens))]
            # One load generator is one client, and repeats ask the same questions: neither the per-client cap
            # nor the response cache may shape what the engine is measured doing.
            command += ["--max-per-client", "0", "--response-cache-mb", "0"]
            if endpoint == "sse":
                return SSEClient(ServerProcess(command))
            if endpoint == "openai":
                return OpenAIClient(ServerProcess(command))
            return AppClient(ServerProcess(command), endpoint)

        return make

    def static() -> Any:
        from vlm_demo.tools.benchmarks.load_clients import ServerProcess, StaticClient

        command = [
            "-m",
            "vlm_demo.tools.baseline",
            "--model",
            args.model,
            "--max-batch-size",
            str(args.static_max_batch_size),
        ]
        command += ["--window-ms", str(args.static_window_ms), "--cpu-threads", str(args.cpu_threads)]
        return StaticClient(ServerProcess(command))

    def engine_process() -> Any:
        from vlm_demo.backends.engine_client import EngineProcessBackend

        config = Config(model=args.model, model_explicit=True, max_batch_size=args.max_batch_size)
        return EngineProcessBackend(dataclasses.replace(config, cpu_threads=args.cpu_threads, max_new_tokens=100_000))

    for mode in modes:
        if mode == "engine-process":
            factories[mode] = (args.max_batch_size, engine_process)
        elif mode == "engine":
            factories[mode] = (args.max_batch_size, local(args.max_batch_size, Config().batching))
        elif mode in ("app-ask", "app-batch", "app-sse", "app-openai"):
            endpoint = {"app-ask": "/ask", "app-batch": "/ask_batch", "app-sse": "sse", "app-openai": "openai"}[mode]
            factories[mode] = (args.max_batch_size, app(endpoint))
        elif mode == "static":
            factories[mode] = (args.static_max_batch_size, static)
        elif mode == "unbatched":
            factories[mode] = (1, local(1, "dynamic"))
        elif mode in ("dynamic", "continuous"):
            factories[mode] = (args.max_batch_size, local(args.max_batch_size, mode))
        elif mode == "triton":
            from vlm_demo.backends import make_backend

            config = Config(
                triton_url=args.triton_url,
                triton_model=args.triton_model,
                triton_protocol=args.triton_protocol,
                max_new_tokens=100_000,
            )
            factories[mode] = (0, lambda config=config: make_backend(config))  # type: ignore[misc]  # default binds it
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    return factories


def main(argv: list[str] | None = None) -> list[RunResult]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.through_app:  # the preset changes defaults only: explicit flags still win
        parser.set_defaults(
            modes="engine,app-ask,app-sse,app-openai,app-batch,static",
            workload="mix",
            concurrency="8",
            requests=48,
            max_new_tokens=512,
            max_batch_size=Config().max_batch_size,  # the app's default (0: the engine sizes it)
        )
        args = parser.parse_args(argv)
    if args.count_kernels or args.prefill_stall or args.kernel_sass or args.kv_closeness:
        from vlm_demo.tools.benchmarks import kernel_count as kernels
        from vlm_demo.tools.benchmarks import kernel_sass, kv_closeness, prefill_stall

        if args.kv_closeness:
            counted = kv_closeness.report()
        elif args.kernel_sass:
            counted = kernel_sass.report(*kernel_sass.chosen(args.sass_targets, args.sass_kernels))
        elif args.count_kernels:
            counted = kernels.report(args.quantize)
        else:
            counted = prefill_stall.report(args.repeats)
        print(json.dumps(counted, indent=2))
        if args.json_path:
            with open(args.json_path, "w") as out:
                json.dump(counted, out, indent=2)
        return []
    if args.page_load:
        from vlm_demo.tools.benchmarks import page_load

        page_load.run(args)
        return []
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    low, high = (int(x) for x in args.length_range.split(","))
    lengths = forced_lengths(args.requests, args.mixed_lengths, args.max_new_tokens, low, high)
    check = None
    if args.workload == "mix":
        workload, colours = mixed_workload(args.requests, args.max_new_tokens)
        check = names_colour(colours)
    else:
        workload = make_workload(args.requests, lengths)
    factories = backend_factories(args)
    collected: dict[tuple[str, int], list[RunResult]] = {}
    for repeat in range(args.repeats):
        for level in levels:
            for mode, (max_batch, make) in factories.items():
                backend = make()
                try:
                    counter = BatchCounter()
                    backend.add_listener(counter)
                    warm = make_workload(1, [min(8, lengths[0])])[0]
                    backend.submit(warm).result(timeout=600)  # warm-up: first-call overheads are not load
                    counter.sizes.clear()
                    pids = {"bench": os.getpid(), **backend.pids()}
                    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                    bytes_before = traffic(backend)
                    samples, wall = run_load(backend, workload, level, check)
                    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
                    ratios = traffic_ratios(bytes_before, traffic(backend))
                    max_batch = backend.health().max_batch_size or max_batch  # as the engine sized it
                finally:
                    backend.close()  # servers started for a mode stop even when the run fails
                result = summarise(mode, max_batch, level, samples, wall, counter.sizes)
                result.kv_copied_per_written, result.attention_read_over_live = ratios
                result.cpu_ms_per_request = {k: round(1000 * v / max(1, len(samples)), 1) for k, v in cpu.items()}
                log.info("repeat %d: %s", repeat + 1, result)
                collected.setdefault((mode, level), []).append(result)
    results = [median_run(runs) for runs in collected.values()]
    results.sort(key=lambda r: (r.concurrency, list(factories).index(r.mode)))
    print_table(results)
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in results], fh, indent=2)
    if args.json_path:
        print(f"runs written to {os.path.abspath(args.json_path)}")
    if args.plot_path:
        plot(results, args.plot_path, describe_run(args))
        print(f"plot saved to {os.path.abspath(args.plot_path)}")
    return results


if __name__ == "__main__":
    main()
