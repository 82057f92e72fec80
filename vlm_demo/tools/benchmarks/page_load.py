"""Page-load benchmark: N light visitors stream answers from the running app at once, as browsers do.

Each visitor does what the page does when someone uploads a picture and presses Ask: it uploads the image
(``POST /gradio_api/upload``), joins the page's own Ask event (``POST /gradio_api/queue/join``, the event the
page's button triggers) and reads the session's server-sent events (``GET /gradio_api/queue/data``) until the
answer is complete. All visitors run in one asyncio process, so the client costs little next to the server
it measures. Meanwhile ``/health`` is polled every 100 ms, as a load balancer would.

Reported per run (the JSON keys are a public contract): the web process's CPU per page update *all-in*
(uploads, joins and connections included, divided by the updates the visitors received), each visitor's gaps
between updates, time to first text, ``/health`` latency, errors, and the idle server's CPU afterwards::

    python -m vlm_demo.tools.bench --page-load 16,128,256 --max-batch-size 128 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import logging
import os
import random
import statistics
import string
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.tools.benchmarks.stats import cpu_seconds, percentile
from vlm_demo.web.page import contract

log = logging.getLogger(__name__)

LONG_QUESTION = "Describe this picture in detail."  # the tiny model's long form: ~240 tokens, many updates
HEALTH_EVERY_S = 0.1
IDLE_WINDOW_S = 10.0


@dataclass
class PageLoadResult:
    """One run of N visitors; the JSON keys are a public contract."""

    visitors: int
    max_batch_size: int
    question: str
    updates: int
    errors: int
    wall_s: float
    web_cpu_s: float
    cpu_ms_per_update: float  # the web process's CPU over the run / page updates the visitors received
    updates_per_s: float
    gap_p50_s: float  # gaps between one visitor's consecutive updates, over all visitors
    gap_p95_s: float
    gap_max_s: float
    worst_visitor_gap_p95_s: float  # the visitor whose p95 gap was the longest
    ttft_p50_s: float  # from the visitor's first request (the upload) to the first stage text on its page
    ttft_p95_s: float
    health_p50_s: float
    health_p95_s: float
    health_max_s: float
    health_errors: int
    peak_running: int  # the most answers the engine ran at once, as /health reported it
    idle_cpu_pct: float  # the web process's CPU over the idle window after the run, % of one core
    engine_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    error_examples: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"{self.visitors} visitors · {self.updates} updates in {self.wall_s:.1f} s · "
            f"web CPU {self.cpu_ms_per_update:.2f} ms/update all-in · gaps p50 {self.gap_p50_s:.2f} s, "
            f"p95 {self.gap_p95_s:.2f} s, worst visitor's p95 {self.worst_visitor_gap_p95_s:.2f} s · "
            f"first text p50 {self.ttft_p50_s:.2f} s · /health p95 {self.health_p95_s * 1000:.0f} ms · "
            f"{self.errors} errors · idle {self.idle_cpu_pct:.1f}% of a core"
        )


@dataclass
class _Visit:
    """What one visitor saw."""

    updates: list[float] = field(default_factory=list)  # arrival times of page updates
    first_text: float | None = None
    error: str | None = None


def _pct(values: list[float], q: float) -> float:
    """The bench's nearest-rank percentile (``q`` in percent); 0 when nothing was seen (one update: no gap)."""
    return percentile(values, q) if values else 0.0


@dataclass(frozen=True)
class PageEvent:
    """The page's Ask event as the browser calls it: its id, its trigger, and where the panels are."""

    fn_index: int
    trigger_id: int
    panels: tuple[int, ...]  # output positions of the four stage panels

    @classmethod
    def find(cls, config: dict[str, Any]) -> PageEvent:
        elem_ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
        event = next((d for d in config["dependencies"] if d.get("api_name") == contract.ASK_PAGE), None)
        if event is None:
            raise SystemExit(f"the app has no {contract.ASK_PAGE!r} event: is it this demo?")
        panels = tuple(i for i, out in enumerate(event["outputs"]) if elem_ids.get(out) in contract.PANEL_ELEM_IDS)
        return cls(event["id"], event["targets"][0][0], panels)


def _png(index: int) -> bytes:
    """A different picture per visitor (colour and size), so no answer comes from the response cache."""
    colour = list(COLOURS)[index % len(COLOURS)]
    buffer = io.BytesIO()
    solid_image(colour, 48 + index % 97, 32 + index // 97).save(buffer, format="PNG")
    return buffer.getvalue()


def _has_text(diff: Any) -> bool:
    """Whether one output's update (a value, or Gradio's diff: [[op, path, value], ...]) carries text."""
    if isinstance(diff, str):
        return bool(diff.strip())
    if isinstance(diff, list):
        return any(isinstance(op, list) and len(op) == 3 and isinstance(op[2], str) and op[2].strip() for op in diff)
    return False


async def _visit(
    client: httpx.AsyncClient, url: str, event: PageEvent, index: int, question: str, max_new_tokens: int
) -> _Visit:
    seen = _Visit()
    start = time.monotonic()
    session = "".join(random.choices(string.ascii_lowercase + string.digits, k=11))
    close = {"Connection": "close"}  # as a browser would, never reuse a connection the server may be closing
    try:
        upload = await client.post(
            f"{url}/gradio_api/upload", files={"files": (f"v{index}.png", _png(index), "image/png")}, headers=close
        )
        upload.raise_for_status()
        image = {"path": upload.json()[0], "meta": {"_type": "gradio.FileData"}}
        inputs = dict(zip(contract.INPUTS, (image, question, max_new_tokens, 0.0, 1.0, "normal", 2), strict=True))
        data = [inputs[name] for name in contract.INPUTS] + [None]  # the page's event also takes the conversation
        join = await client.post(
            f"{url}/gradio_api/queue/join",
            json={"data": data, "fn_index": event.fn_index, "trigger_id": event.trigger_id, "session_hash": session},
            headers=close,
        )
        join.raise_for_status()
        async with client.stream("GET", f"{url}/gradio_api/queue/data", params={"session_hash": session}) as stream:
            async for line in stream.aiter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                kind = message.get("msg")
                if kind == "process_generating":
                    now = time.monotonic()
                    seen.updates.append(now)
                    outputs = message.get("output", {}).get("data") or []
                    if seen.first_text is None and any(_has_text(outputs[i]) for i in event.panels if i < len(outputs)):
                        seen.first_text = now - start
                elif kind == "process_completed":
                    if not message.get("success", False):
                        seen.error = f"failed: {json.dumps(message.get('output'))[:200]}"
                    break
                elif kind in ("unexpected_error", "close_stream"):
                    seen.error = seen.error or f"{kind}: {message.get('message', '')}"[:200]
                    break
    except (httpx.HTTPError, ValueError, KeyError) as err:
        seen.error = f"{type(err).__name__}: {err}"[:200]
    return seen


async def _poll_health(client: httpx.AsyncClient, url: str, stop: asyncio.Event) -> tuple[list[float], int, int]:
    """``/health`` latencies while the load runs, the errors, and the most running answers it reported."""
    latencies, errors, peak = [], 0, 0
    while not stop.is_set():
        start = time.monotonic()
        try:
            response = await client.get(f"{url}/health", timeout=10)
            latencies.append(time.monotonic() - start)
            peak = max(peak, int(response.json().get("details", {}).get("running") or 0))
        except (httpx.HTTPError, ValueError):
            errors += 1
        try:
            await asyncio.wait_for(stop.wait(), HEALTH_EVERY_S)
        except asyncio.TimeoutError:
            pass
    return latencies, errors, peak


async def run_visitors(
    url: str,
    web_pid: int,
    visitors: int,
    question: str = LONG_QUESTION,
    max_new_tokens: int = 300,
    idle_window_s: float = IDLE_WINDOW_S,
) -> PageLoadResult:
    """``visitors`` arrive at once; returns what they saw and what the web process spent (and, over
    ``idle_window_s`` afterwards, what it spends idle; 0 skips that)."""
    limits = httpx.Limits(max_connections=4 * visitors + 16, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        event = PageEvent.find((await client.get(f"{url}/config")).json())
        max_batch = int((await client.get(f"{url}/health")).json().get("details", {}).get("max_batch_size") or 0)
        stop = asyncio.Event()
        health = asyncio.create_task(_poll_health(client, url, stop))
        before, client_before, started = cpu_seconds(web_pid), time.process_time(), time.monotonic()
        visits = await asyncio.gather(
            *(_visit(client, url, event, i, question, max_new_tokens) for i in range(visitors))
        )
        wall, web_cpu = time.monotonic() - started, cpu_seconds(web_pid) - before
        client_cpu = time.process_time() - client_before
        stop.set()
        latencies, health_errors, peak = await health
    idle = 0.0
    if idle_window_s > 0:
        await asyncio.sleep(3)  # let the last connections close before the idle window
        idle_before = cpu_seconds(web_pid)
        await asyncio.sleep(idle_window_s)
        idle = (cpu_seconds(web_pid) - idle_before) / idle_window_s * 100
    updates = sum(len(v.updates) for v in visits)
    gaps_per_visitor = [[b - a for a, b in zip(v.updates, v.updates[1:])] for v in visits]
    gaps = [g for visitor in gaps_per_visitor for g in visitor]
    firsts = [v.first_text for v in visits if v.first_text is not None]
    failed = [v.error for v in visits if v.error]
    return PageLoadResult(
        visitors=visitors,
        max_batch_size=max_batch,
        question=question,
        updates=updates,
        errors=len(failed) + sum(1 for v in visits if not v.error and v.first_text is None),
        wall_s=round(wall, 2),
        web_cpu_s=round(web_cpu, 2),
        cpu_ms_per_update=round(1000 * web_cpu / max(1, updates), 2),
        updates_per_s=round(updates / wall, 1),
        gap_p50_s=round(_pct(gaps, 50), 3),
        gap_p95_s=round(_pct(gaps, 95), 3),
        gap_max_s=round(max(gaps, default=0.0), 3),
        worst_visitor_gap_p95_s=round(max((_pct(g, 95) for g in gaps_per_visitor), default=0.0), 3),
        ttft_p50_s=round(_pct(firsts, 50), 3),
        ttft_p95_s=round(_pct(firsts, 95), 3),
        health_p50_s=round(_pct(latencies, 50), 4),
        health_p95_s=round(_pct(latencies, 95), 4),
        health_max_s=round(max(latencies, default=0.0), 4),
        health_errors=health_errors,
        peak_running=peak,
        idle_cpu_pct=round(idle, 2),
        client_cpu_s=round(client_cpu, 2),
        error_examples=failed[:3],
    )


def median_result(runs: list[PageLoadResult]) -> PageLoadResult:
    """Field-wise median over repeats of the same visitor count (errors summed)."""
    merged: dict[str, Any] = {}
    for f in dataclasses.fields(PageLoadResult):
        values = [getattr(r, f.name) for r in runs]
        if f.name in ("errors", "health_errors"):
            merged[f.name] = sum(values)
        elif f.name == "error_examples":
            merged[f.name] = [e for r in runs for e in r.error_examples][:3]
        elif isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            merged[f.name] = type(values[0])(statistics.median(values))
        else:
            merged[f.name] = values[0]
    return PageLoadResult(**merged)


def run(args: argparse.Namespace) -> list[PageLoadResult]:
    """Start the app (tiny model unless told), run each visitor count ``--repeats`` times, report medians."""
    from vlm_demo.tools.benchmarks.load_clients import ServerProcess

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per /health poll would drown the report
    levels = [int(v) for v in str(args.page_load).split(",") if v.strip()]
    command = ["app.py", "--model", args.model, "--max-batch-size", str(args.max_batch_size or max(levels))]
    command += ["--cpu-threads", str(args.cpu_threads), "--max-queue", str(max(128, 2 * max(levels)))]
    command += ["--response-cache-mb", "0"]  # every visitor's answer is computed, as new pictures' are
    results = []
    server = ServerProcess(command)
    try:
        engine = httpx.get(server.url + "/health", timeout=10).json().get("details", {}).get("engine_pid")
        asyncio.run(run_visitors(server.url, server.proc.pid, 2, args.page_question, args.page_tokens))  # warm-up
        for visitors in levels:
            runs = []
            for repeat in range(args.repeats):
                engine_before = cpu_seconds(engine) if isinstance(engine, int) else 0.0
                result = asyncio.run(
                    run_visitors(server.url, server.proc.pid, visitors, args.page_question, args.page_tokens)
                )
                result.engine_cpu_s = round(cpu_seconds(engine) - engine_before, 2) if isinstance(engine, int) else 0
                log.info("repeat %d: %s", repeat + 1, result)
                runs.append(result)
            results.append(median_result(runs))
    finally:
        server.close()
    for result in results:
        print(result)
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in results], fh, indent=2)
        print(f"runs written to {os.path.abspath(args.json_path)}")
    return results
