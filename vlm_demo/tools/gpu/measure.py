"""What the one-shot GPU check measures (``python -m vlm_demo.tools.gpucheck`` runs these in order).

Each function is one check or one figure and runs on any device: the tests call them on CPU with the
tiny model, the GPU run with the narrow real-shape model in fp32 and the full 11B architecture in bf16.

- :func:`batched_vs_single`: every batched row against its single run through the same engine, in both
  batching modes, with forced mid-flight joins (one row runs first; the others are prefilled together while
  it runs) and one seeded sampled row (a seeded row draws the same tokens whatever its neighbours);
- :func:`step_vs_stock`: the engine's decode step over the page pool against the stock forward;
- :func:`attention_figures`: the decode step alone per attention kernel, eager and replayed from CUDA graphs,
  with the profiler's device time per kernel (:func:`profile_step`); the ops alone are
  :mod:`~vlm_demo.tools.gpu.kernel_stages`';
- :func:`decode_read_bytes` and :func:`bandwidth_bound`: what one decode step must read (the text
  weights it uses, not the vision tower, the embedding table or the cross-attention key/value
  projections; plus each row's cached image states and text keys/values) and the batch-1 speed that
  bandwidth allows;
- :func:`benchmark`: closed-loop throughput per mode and concurrency, each run isolated (a failed run is
  recorded and the others go on) with its peak GPU memory, and started only if its estimate fits in the
  time left;
- :func:`peak_run`: the planned row limit filled, rows joining and leaving, to see the join/evict peak
  next to the memory plan (:func:`peak_rows_that_fit`: fewer rows when time is short);
- :func:`load_saved`: the real loading path (``engine.loader.load``) on a saved model folder;
- :func:`format_figures` / :func:`quantized_figures`: one weight format (bf16, fp8, int8, int4) measured the
  same way: its bytes, decode at 1 and ``QUANTIZED_ROWS`` rows, the peak memory, its greedy tokens against
  bf16's; :func:`slower_than_bf16`: the formats that read fewer bytes and still decode slower.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlm_demo.config import Config, load_config
from vlm_demo.engine import make_engine
from vlm_demo.engine.batching.base import Engine
from vlm_demo.engine.batching.job import Request, make_request
from vlm_demo.engine.batching.rows import Row, RunningRows
from vlm_demo.engine.decoding.sampler import RowSampling
from vlm_demo.engine.executor.decode_step import TextDecodeStep, page_shape
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.kv.memory import KVShape, activation_reserve, plan_for, read_by_decode
from vlm_demo.engine.weights.loader import load
from vlm_demo.engine.weights.quantize import quantize_model, stored_bytes, weights_label
from vlm_demo.models import realshape
from vlm_demo.request import Limits, SamplingParams, ValidRequest, validate_request
from vlm_demo.tools.gpu.cards import by_device_name

log = logging.getLogger(__name__)

GB = 1e9
LIMITS = Limits(max_new_tokens=100_000)
LENGTHS = (16, 256)  # forced answer lengths, log-uniform
UNBATCHED_REQUESTS = 12  # one at a time whatever the concurrency: enough for its rate
REQUEST_TIMEOUT_S = 120.0  # no single request of the check may wait longer
JOIN_WAIT_S = 60.0  # the first row of the join check must have written its tokens by then
RUN_OVERHEAD_S = 5.0  # a benchmark run's engine start and warm-up request, on top of its answers
PEAK_TOKENS = (32, 96)  # forced answer lengths in the join/evict peak run, log-uniform
QUANTIZED_ROWS = 32  # the weight formats' throughput run: one wave of this many answers at once
SAMPLED = SamplingParams(max_new_tokens=0, temperature=0.8, top_p=0.9, seed=1234)  # length set per check

# (width, height) -> 1, 2, 3 and 4 tiles of 560 px; prompts of different lengths.
CASES = [
    ((50, 50), "Hi"),
    ((300, 900), "What is in this image?"),
    ((1200, 400), "Describe the picture in one sentence, please, with as much detail as you can manage."),
    ((1120, 1120), "Colour?"),
]


def spec_bandwidth(device_name: str) -> float | None:
    """Peak bandwidth (bytes/s) of a known GPU (:mod:`vlm_demo.tools.gpu.cards`), by its device name; None if unknown."""
    spec = by_device_name(device_name)
    return spec.bandwidth if spec else None


# ---- what a decode step reads -------------------------------------------------------------------------


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads (:func:`~vlm_demo.engine.kv.memory.read_by_decode`), as stored
    (a quantized weight's values and scales)."""
    return sum(stored_bytes(param) for name, param in model.named_parameters() if read_by_decode(name))


def decode_read_bytes(model: torch.nn.Module, kv: KVShape, context: int = 0) -> int:
    """Bytes one decode step of one row reads: the weights above, its image states, its text cache."""
    return decode_weight_bytes(model) + kv.bytes_per_row + context * kv.bytes_per_token


def bandwidth_bound(read_bytes: int, bandwidth: float) -> float:
    """Decode tokens/s at batch 1 if a step only had to read ``read_bytes`` once."""
    return bandwidth / read_bytes


# ---- batched rows against single runs -----------------------------------------------------------------


def noise_image(index: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8))


def jobs(params: SamplingParams) -> list[ValidRequest]:
    return [validate_request(noise_image(i, w, h), q, params, LIMITS) for i, ((w, h), q) in enumerate(CASES)]


@dataclass
class Comparison:
    """Batched rows against single runs: per mode, each row's first differing token (None: equal), the
    seeded sampled row's, and how the continuous run joined (rows joining a running one, prefills)."""

    first_diff: dict[str, list[int | None]] = field(default_factory=dict)
    sampled_first_diff: dict[str, int | None] = field(default_factory=dict)
    joins: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # a mode that could not be compared (timed out), and why

    @property
    def equal(self) -> bool:
        rows = [d for diffs in self.first_diff.values() for d in diffs] + list(self.sampled_first_diff.values())
        return not self.errors and all(d is None for d in rows)


def first_difference(got: list[int], want: list[int]) -> int | None:
    if len(got) != len(want):
        return min(len(got), len(want))
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)


def _results(handles: list[Any], timeout: float) -> list[Any]:
    """Every handle's result, all of them within ``timeout`` seconds together (else ``TimeoutError``)."""
    deadline = time.monotonic() + timeout
    return [h.result(timeout=max(0.0, deadline - time.monotonic())) for h in handles]


def _wait_for_tokens(handle: Any, count: int, timeout: float) -> bool:
    """Whether ``handle`` wrote ``count`` tokens (or ended) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while len(handle.token_ids) < count and not handle.done:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _alone(worker: Worker, items: list[ValidRequest], mode: str = "continuous") -> list[list[int]]:
    """Each item alone, through a one-row engine of batching ``mode`` (the reference every row that engine batches
    must match: the same engine's path, its tiles and its sampling)."""
    engine = make_engine(Config(batching=mode, max_batch_size=1, batch_window_ms=0.0), worker)
    try:
        handles = []
        for item in items:
            handles.append(engine.submit(item))
            handles[-1].result(timeout=REQUEST_TIMEOUT_S)
        return [h.token_ids for h in handles]
    finally:
        engine.shutdown()


def generate_alone(worker: Worker, requests: list[ValidRequest], tokens: int) -> list[list[int]]:
    """Each request's greedy tokens alone, through plain ``model.generate`` (the reference)."""
    refs = []
    for valid in requests:
        inputs = worker.to_device(worker.prepare(valid.image, valid.question))
        with torch.inference_mode():
            out = worker.model.generate(**inputs, generation_config=worker.generation_config(tokens))
        refs.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return refs


def batched_vs_single(worker: Worker, tokens: int) -> Comparison:
    """Every case alone and a seeded sampled row alone, then all together, each engine against its own single runs
    (like with like: the dynamic engine runs the stock forward over every tile the processor packed, the
    continuous one its own step over the tiles ``--vision-tiles`` keeps, so their tokens may differ from each
    other's): through the dynamic engine in one batch, and through the continuous engine with a first row that runs
    ``4 × tokens`` while the others join it at one step boundary, prefilled together, a forward pass per tile
    count. A mode whose rows do not all end in ``REQUEST_TIMEOUT_S`` is recorded in ``errors``, not waited for."""
    greedy = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    requests = jobs(greedy)
    long_first = dataclasses.replace(
        requests[0], params=dataclasses.replace(greedy, max_new_tokens=4 * tokens).validated(LIMITS.max_new_tokens)
    )
    sampled = dataclasses.replace(
        requests[2], params=dataclasses.replace(SAMPLED, max_new_tokens=tokens).validated(LIMITS.max_new_tokens)
    )
    alone = {
        "dynamic": _alone(worker, [*requests, sampled], "dynamic"),
        "continuous": _alone(worker, [long_first, *requests[1:], sampled], "continuous"),
    }
    result = Comparison()
    for mode in ("dynamic", "continuous"):
        # --prefill-share 0: the joiners are prefilled at the step boundary they arrive at, not paced over steps
        config = Config(batching=mode, max_batch_size=len(requests) + 1, batch_window_ms=2000.0, prefill_share=0.0)
        engine = make_engine(config, worker)
        try:
            if mode == "continuous":
                first = engine.submit(long_first)
                if not _wait_for_tokens(first, 2, JOIN_WAIT_S):
                    result.errors.append(f"continuous: the first row wrote no 2 tokens in {JOIN_WAIT_S:.0f} s")
                    continue
                with engine.scheduler._cond:  # hold the queue: the rest arrive at the same step boundary
                    written = len(first.token_ids)
                    handles = [first, *(engine.submit(v) for v in requests[1:]), engine.submit(sampled)]
            else:
                handles = [*(engine.submit(v) for v in requests), engine.submit(sampled)]
            results = _results(handles, REQUEST_TIMEOUT_S)
            stats = engine.stats()
        except TimeoutError as exc:
            result.errors.append(f"{mode}: {exc}")
            continue
        finally:
            engine.shutdown()
        *wanted, sampled_ref = alone[mode]
        result.first_diff[mode] = [first_difference(h.token_ids, r) for h, r in zip(handles, wanted, strict=False)]
        result.sampled_first_diff[mode] = first_difference(handles[-1].token_ids, sampled_ref)
        if mode == "continuous":
            result.joins = {
                "first_row_tokens_when_others_joined": written,
                "first_row_tokens": 4 * tokens,
                "prefills": stats.prefills_run,
                "tile_counts_joining": len(
                    {worker.tiles_run(worker.prepare(v.image, v.question)) for v in requests[1:]}
                ),
                "max_batch_size": max(r.batch_size for r in results),
            }
    return result


def step_vs_stock(worker: Worker, steps: int = 4) -> dict[str, float | bool | str]:
    """The engine's decode step over the page pool against each row's own stock forward (what ``generate``
    runs): the largest logit difference, whether every row picks the same token, and which attention
    kernel the step ran (on CUDA: FlashAttention's paged kernel when it passed its probe)."""
    with worker.tiles_as("all"):  # the stock forward runs every tile the processor packed
        return _step_vs_stock(worker, steps)


def _step_vs_stock(worker: Worker, steps: int) -> dict[str, float | bool | str]:
    requests: list[Request] = [
        make_request(valid, worker) for valid in jobs(SamplingParams(max_new_tokens=steps + 1, temperature=0))
    ]
    shape = page_shape(worker.model, worker.dtype)
    pages = sum(shape.row_pages(r.prompt_tokens + steps + 1, shape.max_tiles) for r in requests)
    decoder = TextDecodeStep.over_pool(worker.model, worker.dtype, pages)
    rows = RunningRows(decoder.pool, decoder.attention, worker.device, worker.dtype)
    with torch.inference_mode():
        prefill = worker.prefill(requests)
        sampling = RowSampling([r.params for r in requests], prefill.logits.device)
        places = rows.place(prefill, list(range(len(requests))))
        assert places is not None
        tokens = sampling.sample(prefill.logits)
        rows.join([Row(r, None) for r in requests], places, tokens, sampling)  # type: ignore[arg-type]
        alone = []
        for request in requests:
            inputs = worker.to_device(request.inputs)
            out = worker.model(**inputs, use_cache=True, logits_to_keep=1)
            alone.append((out.cache, inputs["cross_attention_mask"][:, -1:]))
        worst, same = 0.0, True
        positions = [r.prompt_tokens for r in requests]
        for _ in range(steps):
            mine = worker.decode(decoder, rows.step_inputs())
            stock = torch.cat([
                worker.model(input_ids=tokens[i].view(1, 1), position_ids=torch.tensor([[positions[i]]], device=tokens.device),
                             cross_attention_mask=mask, cache=cache, use_cache=True).logits[:, -1].float()
                for i, (cache, mask) in enumerate(alone)
            ])  # fmt: skip
            worst = max(worst, float((mine - stock).abs().max()))
            same = same and bool(torch.equal(mine.argmax(-1), stock.argmax(-1)))
            tokens = stock.argmax(-1)
            rows.advance(tokens)
            positions = [p + 1 for p in positions]
    return {"max_abs_logit_diff": worst, "same_argmax": same, "decode_attention": decoder.attention.kernel}


# ---- throughput -----------------------------------------------------------------------------------------


def forced_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(round(x)) for x in np.exp(rng.uniform(np.log(low), np.log(high), n))]


def workload(
    n: int, seed: int = 0, lengths: tuple[int, int] = LENGTHS, sizes: list | None = None
) -> list[ValidRequest]:
    items = []
    for i, length in enumerate(forced_lengths(n, *lengths, seed=seed)):
        (w, h), question = CASES[i % len(CASES)]
        if sizes is not None:
            w, h = sizes[i % len(sizes)]
        params = SamplingParams(max_new_tokens=length, temperature=0.0, ignore_eos=True)
        items.append(validate_request(noise_image(i, w, h), question, params, LIMITS))
    return items


def _peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def load_run(
    worker: Worker, mode: str, level: int, items: list[ValidRequest], rows: int, window_ms: float = 50.0
) -> dict[str, Any]:
    """One closed-loop run (``vlm_demo.tools.bench``'s clients) and its peak GPU memory."""
    from vlm_demo.tools.bench import BatchCounter, run_load, summarise

    batching = "dynamic" if mode == "unbatched" else mode
    engine: Engine = make_engine(Config(batching=batching, max_batch_size=rows, batch_window_ms=window_ms), worker)
    counter = BatchCounter()
    engine.add_listener(counter)
    try:
        warm = validate_request(noise_image(99, 64, 64), "Hi", SamplingParams(4, 0.0, ignore_eos=True), LIMITS)
        engine.submit(warm).result(timeout=REQUEST_TIMEOUT_S)
        counter.sizes.clear()
        _reset_peak(worker.device)
        samples, wall = run_load(engine, items, level, timeout=REQUEST_TIMEOUT_S)
        stats = engine.stats()
    finally:
        engine.shutdown()
    result = dataclasses.asdict(summarise(mode, rows, level, samples, wall, counter.sizes))
    result.update(peak_memory_bytes=_peak_memory(worker.device), prefills=stats.prefills_run)
    errors = [s.error for s in samples if s.error]
    if errors:
        result["first_error"] = errors[0]
    return result


def run_estimate_s(tokens: int, tokens_per_s: float | None) -> float:
    """Seconds a run writing ``tokens`` answer tokens should take at ``tokens_per_s`` (0: no rate known)."""
    return RUN_OVERHEAD_S + tokens / tokens_per_s if tokens_per_s else 0.0


def benchmark(
    worker: Worker,
    levels: tuple[int, ...],
    requests_at: Callable[[int], int],
    time_left: Callable[[], float],
    on_run: Callable[[dict[str, Any]], None],
    rate_floor: float | None = None,
) -> list[dict[str, Any]]:
    """Unbatched, dynamic and continuous batching at each concurrency level. At concurrency 1 dynamic
    batching is unbatched (batches of one), so it runs once there. Each run is isolated: one that
    raises is recorded with its error and the others go on. A run starts only if its estimate fits in
    ``time_left()`` seconds, at the rate its mode reached at the level before (first: ``rate_floor``,
    batch-1 decode's; at higher levels a mode only gets faster); else it is recorded as skipped, with
    why. ``on_run`` sees every run as it ends."""
    results = []
    rates: dict[str, float] = {}
    for level in levels:
        for mode in ("unbatched", "dynamic", "continuous"):
            if mode == "dynamic" and level == 1:
                continue
            rows = 1 if mode == "unbatched" else max(level, 1)
            n = min(UNBATCHED_REQUESTS, requests_at(level)) if mode == "unbatched" else requests_at(level)
            items = workload(n, seed=level)
            need = run_estimate_s(sum(item.params.max_new_tokens for item in items), rates.get(mode, rate_floor))
            left = time_left()
            if left <= 0 or left < need:
                why = f"time budget: needs ~{need:.0f} s, {max(left, 0):.0f} s left"
                log.warning("skipping %s at concurrency %d: %s", mode, level, why)
                result: dict[str, Any] = {"mode": mode, "concurrency": level, "skipped": why}
            else:
                try:
                    result = load_run(worker, mode, level, items, rows)
                    if result["tokens_per_s"]:
                        rates[mode] = result["tokens_per_s"]
                except Exception as exc:  # noqa: BLE001 - recorded; the other runs' figures still count
                    log.exception("%s at concurrency %d failed", mode, level)
                    result = {"mode": mode, "concurrency": level, "error": f"{type(exc).__name__}: {exc}"}
                log.info("%s", result)
            results.append(result)
            on_run(result)
    return results


def peak_rows_that_fit(
    planned: int, seconds: float, tokens_per_s: float, answer_tokens: tuple[int, int] = PEAK_TOKENS
) -> int:
    """The most rows, up to ``planned``, whose answers (log-uniform in ``answer_tokens``) a run at
    ``tokens_per_s`` writes within ``seconds``; the rate measured at fewer rows makes it an underestimate."""
    low, high = answer_tokens
    per_row = (high - low) / math.log(high / low) if high > low else low  # the log-uniform mean
    return max(0, min(planned, int((seconds - RUN_OVERHEAD_S) * tokens_per_s / per_row)))


def peak_run(worker: Worker, rows: int, answer_tokens: tuple[int, int] = PEAK_TOKENS) -> dict[str, Any]:
    """``rows`` concurrent answers (1-tile images, so the vision tower's share stays small; every row's
    image states are 4 tiles' worth anyway) through the continuous engine with ``rows`` rows: newcomers
    join in prefill groups and finished rows leave while the batch is full, which is where the
    concatenations peak. Reports the peak next to the memory plan."""
    plan = plan_for(worker, Config(batching="continuous", max_batch_size=rows))
    items = workload(rows, seed=7, lengths=answer_tokens, sizes=[(560, 560)])
    result = load_run(worker, "continuous", rows, items, rows, window_ms=0.0)
    weights = sum(stored_bytes(p) for p in worker.model.parameters())
    if worker.device.type == "cuda":
        total = torch.cuda.get_device_properties(worker.device).total_memory
        result.update(
            gpu_total_bytes=total,
            weight_bytes=weights,
            kv_budget_bytes=plan.kv_budget_bytes,
            activation_reserve_bytes=activation_reserve(total),
            peak_over_weights_bytes=(result["peak_memory_bytes"] or 0) - weights,
        )
    return result


def bytes_read_per_token(worker: Worker) -> dict[str, float]:
    """What a decode step of one row reads (see :func:`decode_read_bytes`), in bytes."""
    kv = KVShape.of(worker.model.config, worker.dtype)
    return {
        "weights": decode_weight_bytes(worker.model),
        "image_states_per_row": kv.bytes_per_row,
        "text_kv_per_token": kv.bytes_per_token,
        "total_at_256_tokens": decode_read_bytes(worker.model, kv, 256),
    }


def batch1_decode(worker: Worker, tokens: int = 128) -> float:
    """Decode tokens/s of one request alone (continuous mode: the engine's own step)."""
    engine = make_engine(Config(batching="continuous", max_batch_size=1), worker)
    try:
        params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
        engine.submit(validate_request(noise_image(7, 64, 64), "Hi", SamplingParams(8, 0.0), LIMITS)).result(
            timeout=REQUEST_TIMEOUT_S
        )
        item = validate_request(noise_image(8, 560, 560), "Hi", params, LIMITS)
        return engine.submit(item).result(timeout=REQUEST_TIMEOUT_S).tokens_per_s
    finally:
        engine.shutdown()


def attention_figures(worker: Worker, kernel: str, row_counts: tuple[int, ...] = (1, 128), length: int = 600,
                      steps: int = 10, tiles: int = 4) -> dict[str, Any]:  # fmt: skip
    """The decode step alone with decode attention ``kernel`` (a ``--decode-attention`` choice), eagerly and (on
    CUDA, for a block-table kernel) replayed from CUDA graphs, at each row count that fits in memory (rows of
    ``length`` tokens and a picture of ``tiles`` tiles): step ms and tokens/s (rows ÷ step time), the replayed
    logits against the same step run eagerly through the graphs' buffers (``graphs_vs_eager``: the largest
    difference relative to the largest logit; the same kernels on the same inputs, so ~0 unless a replay reads
    something stale),
    the steps whose logits were not all finite, the graphs' capture time and memory pool, and the device time per
    kernel of one profiled eager step (``kernel_times``; on a CPU its operators' time). No client threads: the step
    is timed by itself."""
    from vlm_demo.config import Config
    from vlm_demo.engine.executor.attention import KERNELS
    from vlm_demo.engine.executor.decode_step import page_shape
    from vlm_demo.engine.executor.graphs import bucket_for, decode_graphs
    from vlm_demo.tools.benchmarks.kernel_count import synthetic_rows

    shape = page_shape(worker.model, worker.dtype)
    heads = worker.model.config.get_text_config().num_attention_heads
    row_pages = shape.text_pages(length + steps + 4) + shape.image_pages(tiles * shape.patches)
    working = KERNELS[kernel].working_bytes(shape, heads, 1, tiles, length) if kernel in KERNELS else 0
    fit, skipped = rows_that_fit(row_counts, row_pages * shape.page_bytes + working, worker.device)
    most = max(fit, default=1)
    decoder = TextDecodeStep.over_pool(worker.model, worker.dtype, most * row_pages + 16, kernel)
    graphs = decode_graphs(decoder, most, Config(cuda_graphs="auto", max_new_tokens=length), worker)
    figures: dict[str, Any] = {"decode_attention": decoder.attention.kernel, "graphable": decoder.attention.graphable,
                               "captured": len(graphs.graphs), "capture_s": graphs.capture_s,
                               "pool_bytes": graphs.pool_bytes, "text_tokens": length, "tiles": tiles, "rows": {},
                               "rows_skipped": skipped, "nan_steps": 0, "steps": 0}  # fmt: skip
    for rows in fit:
        running = synthetic_rows(decoder, rows, worker.device, length, worker.dtype, tiles)
        with torch.inference_mode():
            inputs = running.step_inputs(pad_to=bucket_for(rows, graphs.sizes) if graphs.captured else None)
            seconds, bad, eager = _step_seconds(decoder, inputs, steps, worker.device)
            entry: dict[str, Any] = {"eager_step_ms": seconds * 1e3, "eager_tokens_per_s": rows / seconds}
            figures["nan_steps"] += bad
            figures["steps"] += steps + 1
            if graphs.captured:
                # the same step eagerly through the graphs' own buffers and bounds: what the replay must give
                graphs.static.load(inputs)
                eager = graphs.step(graphs.static.view(inputs.layout.rows)).float()
                seconds, bad, replayed = _step_seconds(graphs, inputs, steps, worker.device)
                entry.update(graphs_step_ms=seconds * 1e3, graphs_tokens_per_s=rows / seconds)
                entry["graphs_vs_eager"] = float(
                    (replayed[:rows] - eager[:rows]).abs().max() / eager[:rows].abs().max().clamp_min(1e-30)
                )
                figures["nan_steps"] += bad
                figures["steps"] += steps + 1
        running.keep([])
        figures["rows"][str(rows)] = entry
    figures["attention_kernels"], figures["kernel_times"] = profile_step(decoder, worker, length, tiles, min(8, most))
    return figures


def rows_that_fit(row_counts: tuple[int, ...], row_bytes: int, device: torch.device,
                  share: float = 0.9) -> tuple[list[int], dict[str, str]]:  # fmt: skip
    """The row counts whose rows (``row_bytes`` each) take at most ``share`` of the free device memory, and why the
    others were left out (a CPU: all)."""
    from vlm_demo.tools.gpu.kernel_stages import free_bytes

    free = free_bytes(device)
    if free is None:
        return list(row_counts), {}
    fit = [rows for rows in row_counts if rows * row_bytes <= share * free]
    skipped = {
        str(r): f"needs ~{r * row_bytes / GB:.1f} GB, {free / GB:.1f} GB free" for r in row_counts if r not in fit
    }
    return fit, skipped


def _step_seconds(step: Any, inputs: Any, steps: int, device: torch.device) -> tuple[float, int, torch.Tensor]:
    """Seconds one call of ``step(inputs)`` takes, over ``steps`` calls after one warm-up, how many of all the calls
    gave logits that were not all finite (counted on the device, a reduction per call — well under 1 % of a
    step —, read once at the end), and the warm-up's logits (float32, a copy)."""
    cuda = device.type == "cuda"
    first = step(inputs).float()  # a copy: a graph's logits are overwritten by its next replay
    bad = (~torch.isfinite(first)).any().int()
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        bad += (~torch.isfinite(step(inputs))).any().int()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps, int(bad), first


def profile_step(decoder: Any, worker: Worker, length: int, tiles: int = 4,
                 rows: int = 8) -> tuple[list[str], dict[str, dict[str, float]]]:  # fmt: skip
    """One eager decode step of ``rows`` rows under the profiler: the kernels whose names say attention (which
    backend ran), and every kernel's device time and calls (:func:`~vlm_demo.tools.gpu.kernel_stages.kernel_times`; on
    a CPU the operators')."""
    from torch.profiler import ProfilerActivity, profile

    from vlm_demo.tools.benchmarks.kernel_count import synthetic_rows
    from vlm_demo.tools.gpu.kernel_stages import kernel_times

    cuda = worker.device.type == "cuda"
    running = synthetic_rows(decoder, rows, worker.device, length, worker.dtype, tiles)
    with torch.inference_mode():
        inputs = running.step_inputs()
        decoder(inputs)  # warm: the profile is of a step like the one before it
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            decoder(inputs)
            if cuda:
                torch.cuda.synchronize(worker.device)
    running.keep([])
    names = {event.key for event in prof.key_averages()}
    words = ("flash", "fmha", "attention", "attn", "sdpa", "_split_attention", "_merge")
    return sorted(n for n in names if any(k in n.lower() for k in words)), kernel_times(prof, cuda)


def ratios(results: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per concurrency: dynamic ÷ unbatched and continuous ÷ dynamic throughput (tokens/s)."""
    out: dict[int, dict[str, float]] = {}
    for level in sorted({r["concurrency"] for r in results}):
        by_mode = {r["mode"]: r["tokens_per_s"] for r in results if r["concurrency"] == level and "tokens_per_s" in r}
        entry = {}
        if by_mode.get("unbatched") and "dynamic" in by_mode:
            entry["dynamic/unbatched"] = by_mode["dynamic"] / by_mode["unbatched"]
        if by_mode.get("dynamic") and "continuous" in by_mode:
            entry["continuous/dynamic"] = by_mode["continuous"] / by_mode["dynamic"]
        out[level] = entry
    return out


# ---- weight formats ---------------------------------------------------------------------------------------


def format_figures(worker: Worker, reference: list[list[int]] | None = None, tokens: int = 16) -> dict[str, Any]:
    """One weight format of the model under test, measured as every other is: its weights' bytes (all, and what
    a decode step reads), decode tokens/s at batch 1 and with ``QUANTIZED_ROWS`` rows (continuous batching, one
    wave of answers), that run's peak memory, and its greedy tokens on two cases; with ``reference`` (bf16's
    tokens) the first token where each case differs from it (None: the same ``tokens`` tokens)."""
    greedy = generate_alone(worker, jobs(SamplingParams(max_new_tokens=tokens, temperature=0.0))[:2], tokens)
    batch1 = batch1_decode(worker)
    run = load_run(worker, "continuous", QUANTIZED_ROWS, workload(QUANTIZED_ROWS, seed=5), QUANTIZED_ROWS)
    figures = {
        "weights": weights_label(worker.model),
        "weight_bytes": sum(stored_bytes(p) for p in worker.model.parameters()),
        "decode_weight_bytes": decode_weight_bytes(worker.model),
        "batch1_tokens_per_s": batch1,
        "rows": QUANTIZED_ROWS,
        "rows_tokens_per_s": run["tokens_per_s"],
        "errors": run["errors"],
        "peak_memory_bytes": run["peak_memory_bytes"],
        "greedy": greedy,
    }
    if reference is not None:
        figures["first_diff_vs_bf16"] = [first_difference(g, r) for g, r in zip(greedy, reference, strict=True)]
    return figures


def slower_than_bf16(formats: dict[str, dict[str, Any] | None]) -> list[str]:
    """Each quantized format that decodes slower than bf16 (at batch 1 or at ``QUANTIZED_ROWS`` rows) though its
    decode step reads fewer weight bytes: what packing the weights is for, not delivered (one sentence each)."""
    base = formats.get("bf16")
    slower = []
    for kind, figures in formats.items():
        if kind == "bf16" or not figures or not base or figures["decode_weight_bytes"] >= base["decode_weight_bytes"]:
            continue
        for key, where in (("batch1_tokens_per_s", "at batch 1"), ("rows_tokens_per_s", f"at {figures['rows']} rows")):
            if figures[key] < base[key]:
                slower.append(
                    f"{kind} decodes slower than bf16 {where} ({figures[key]:.1f} against {base[key]:.1f} tokens/s) "
                    f"though its step reads {figures['decode_weight_bytes'] / GB:.1f} GB of weights against "
                    f"{base['decode_weight_bytes'] / GB:.1f}"
                )
    return slower


def packed_kernel_error(model: Any, rows: tuple[int, ...] = (1, 8, 300)) -> float:
    """The device's packed product (on CUDA the Triton kernel up to ``TRITON_ROWS`` rows) against the same product
    in torch operations, over the first text layer's packed projections with a residual: the largest difference
    relative to the product's largest value."""
    from vlm_demo.engine.weights.packed import PackedLinear, torch_product

    layer = model.model.language_model.layers[0]
    worst = 0.0
    generator = torch.Generator().manual_seed(0)
    for module in (m for m in layer.modules() if isinstance(m, PackedLinear)):
        weights = module.packed()
        dtype = layer.input_layernorm.weight.dtype
        for n in rows:
            x = torch.randn(n, module.in_features, generator=generator).to(module.weight.device, dtype)
            residual = torch.randn(n, module.out_features, generator=generator).to(x)
            with torch.inference_mode():
                got = weights(x, residual, 0.5).float()
                want = torch_product(x, weights.values, weights.scale, weights.zero, residual, 0.5).float()
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def quantized_figures(
    model: str, device: torch.device, processor: Any, kind: str, reference: list[list[int]]
) -> dict[str, Any]:
    """:func:`format_figures` for the model under test rebuilt (same seed: the same weights) and quantized to
    ``kind`` in place, with :func:`packed_kernel_error`; its memory is returned once measured."""
    worker = build_worker(model, device, processor, quantize=kind)
    try:
        return {**format_figures(worker, reference), "kernel_vs_torch": packed_kernel_error(worker.model)}
    finally:
        del worker
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---- building and loading ---------------------------------------------------------------------------------


def build_worker(
    model: str, device: torch.device, processor: Any, dtype: torch.dtype | None = None, quantize: str = "none"
) -> Worker:
    """The model under test: the full 11B architecture or the narrow one with random weights (bf16
    on a GPU, fp32 on CPU, unless ``dtype`` says), or the tiny test model (a dry run on CPU); its language
    model's linear weights stored as ``quantize`` says."""
    if model == "tiny":
        return load("tiny", device=str(device), quantize=quantize, tiny_dir=load_config([]).tiny_dir)  # VLM_TINY_DIR
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = realshape.full_config() if model == "full" else realshape.narrow_config()
    built = quantize_model(realshape.build_model(config, dtype, device), quantize)
    return Worker(built, processor, f"{model}-random")


def load_saved(worker: Worker, device: str, tokens: int = 8) -> dict[str, Any]:
    """Save ``worker``'s model and processor to a folder and load it back through the server's own loading
    path (``engine.loader.load``: placement, the on-GPU check); the reloaded model must answer alike."""
    with tempfile.TemporaryDirectory() as folder:
        worker.model.save_pretrained(folder)
        worker.processor.save_pretrained(folder)
        started = time.monotonic()
        loaded = load(folder, device=device, dtype=str(worker.dtype).removeprefix("torch."))
        load_s = time.monotonic() - started
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    item = jobs(params)[1]
    answers = []
    for each in (worker, loaded):
        answers += _alone(each, [item])
    places = sorted({str(p.device) for p in loaded.model.parameters()})
    return {"load_s": load_s, "devices": places, "same_answer": answers[0] == answers[1]}


TILE_PICTURES = {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (2, 2)}  # tiles -> the picture's size in tiles (w, h)


def tower_seconds(worker: Worker, repeats: int = 3) -> dict[str, float]:
    """Seconds the vision tower and the projector take for one picture of 1, 2, 3 and 4 real tiles
    (``--vision-tiles real``), and for a 1-tile picture run the stock way (every tile): medians of ``repeats``."""
    figures = {}
    for mode, tiles in [("real", n) for n in TILE_PICTURES] + [("all", 1)]:
        with worker.tiles_as(mode):
            width, height = (side * worker.tower.image_size for side in TILE_PICTURES[tiles])
            inputs = worker.prepare(noise_image(tiles, width, height), "What is in this image?")
            assert worker.tiles_run(inputs) == (tiles if mode == "real" else 4)
            worker.encode_pictures([inputs])  # warm-up
            times = []
            for _ in range(repeats):
                worker.synchronize()
                start = time.perf_counter()
                worker.encode_pictures([inputs])
                worker.synchronize()
                times.append(time.perf_counter() - start)
            figures[f"{tiles}_tiles_{mode}"] = round(statistics.median(times), 5)
    return figures


def prefill_stall(worker: Worker, rows: int = 8, newcomers: int = 8) -> dict[str, Any]:
    """``bench --prefill-stall``'s figures on this model: the running rows' longest pause while newcomers with
    4-tile pictures join, against the median decode step, before (at once, every tile) and after (paced, real)."""
    from vlm_demo.tools.benchmarks import prefill_stall as stall

    return {
        name: stall.run_once(worker, overrides, rows, newcomers) for name, overrides in stall.CONFIGURATIONS.items()
    }
