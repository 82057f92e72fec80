"""One-shot device check: ``python -m vlm_demo.tools.gpucheck`` on a CUDA machine, with no download.

Everything else in this project runs on a 1 MB model on CPU. This builds the full
Llama-3.2-11B-Vision architecture (40 text layers, 32 + 8 vision layers, vocabulary 128256) with
random bf16 weights directly on the GPU and checks, in order:

1. placement and memory: every weight on the GPU; the engine's memory plan (rows, KV budget);
2. batched == single: the narrow real-shape model in fp32 on the GPU must give every batched row
   its single run's tokens (as CI does on CPU); the full model in bf16 is compared and reported but
   not required to match (bf16 kernels depend on the batch shape, so equality is not bitwise); the
   engine's written-out decode step against the stock forward;
3. throughput: unbatched, dynamic and continuous batching at concurrency 1, 8 and 32 with mixed
   forced lengths; decode tokens/s at batch 1 next to the memory-bandwidth bound (weight bytes ÷
   bandwidth, from the GPU's spec sheet and from a measured copy), and the throughput ratios.

About 3-5 minutes on an H100/H200 (a time budget skips what is left past ``--budget-s``). Random
weights decode random tokens, so lengths are forced (``ignore_eos``); that is what a throughput
check needs. A stage that fails is reported and the others still run. Exit code 0: all required
checks passed; 1: a check failed; 2: no CUDA. ``--device cpu --model tiny`` (or ``narrow``) is a
dry run of the whole script without the GPU-only stages (the tests run it).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlm_demo.config import Config
from vlm_demo.engine import make_engine
from vlm_demo.engine.batch_state import Row, RunningBatch
from vlm_demo.engine.loader import load
from vlm_demo.engine.memory import plan_for
from vlm_demo.engine.placement import check_on_gpus
from vlm_demo.engine.request import make_request
from vlm_demo.engine.sampler import RowSampling
from vlm_demo.engine.worker import Worker
from vlm_demo.models import realshape
from vlm_demo.schema import Limits, SamplingParams, ValidRequest, validate_request

log = logging.getLogger("vlm_demo.tools.gpucheck")

GB = 1e9
LIMITS = Limits(max_new_tokens=100_000)
LEVELS = (1, 8, 32)
LENGTHS = (16, 256)  # forced answer lengths, log-uniform
UNBATCHED_REQUESTS = 12  # one at a time whatever the concurrency: enough for its rate

# Peak memory bandwidth from the vendors' spec sheets (bytes/s); the first name contained in the
# device name wins, so specific names come before general ones.
SPEC_BANDWIDTH: list[tuple[str, float]] = [
    ("GH200", 4.0e12),
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L40", 0.864e12),
    ("A10G", 0.6e12),
    ("A10", 0.6e12),
    ("L4", 0.3e12),
    ("RTX 6000 Ada", 0.96e12),
    ("RTX A6000", 0.768e12),
    ("RTX 4090", 1.008e12),
]

# (width, height) -> 1, 2, 3 and 4 tiles of 560 px; prompts of different lengths.
CASES = [
    ((50, 50), "Hi"),
    ((300, 900), "What is in this image?"),
    ((1200, 400), "Describe the picture in one sentence, please, with as much detail as you can manage."),
    ((1120, 1120), "Colour?"),
]


def spec_bandwidth(device_name: str) -> float | None:
    """Peak bandwidth (bytes/s) of a known GPU, by name; None if unknown."""
    return next((bw for key, bw in SPEC_BANDWIDTH if key in device_name), None)


def bandwidth_bound(weight_bytes: int, bandwidth: float) -> float:
    """Decode tokens/s at batch 1 if every step only had to read all weights once."""
    return bandwidth / weight_bytes


def measure_bandwidth(device: torch.device, size: int = 2 * 1024**3, repeats: int = 10) -> float:
    """Device memory bandwidth (bytes/s) from timed copies: each copy reads and writes ``size``."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * size * repeats / (time.perf_counter() - started)


def noise_image(index: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8))


def jobs(params: SamplingParams) -> list[ValidRequest]:
    return [validate_request(noise_image(i, w, h), q, params, LIMITS) for i, ((w, h), q) in enumerate(CASES)]


@dataclass
class Comparison:
    """Batched rows against single runs: per mode, each row's first differing token (None: equal)."""

    first_diff: dict[str, list[int | None]] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return all(d is None for rows in self.first_diff.values() for d in rows)


def first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)


def batched_vs_single(worker: Worker, tokens: int) -> Comparison:
    """Every case alone through plain ``model.generate`` (greedy), then all together through the
    dynamic engine and through the continuous engine (one first, the rest joining it)."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    requests = jobs(params)
    refs = []
    for valid in requests:
        inputs = worker.to_device(worker.prepare(valid.image, valid.question))
        with torch.inference_mode():
            out = worker.model.generate(**inputs, generation_config=worker.generation_config(tokens))
        refs.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    result = Comparison()
    for mode in ("dynamic", "continuous"):
        engine = make_engine(Config(batching=mode, max_batch_size=len(requests), batch_window_ms=2000.0), worker)
        try:
            handles = [engine.submit(requests[0])]
            if mode == "continuous":
                while len(handles[0].token_ids) < 2 and not handles[0].done:
                    time.sleep(0.005)
            handles += [engine.submit(valid) for valid in requests[1:]]
            for handle in handles:
                handle.result(timeout=600)
        finally:
            engine.shutdown()
        result.first_diff[mode] = [first_difference(h.token_ids, ref) for h, ref in zip(handles, refs, strict=True)]
    return result


def step_vs_stock(worker: Worker, steps: int = 4) -> dict[str, float | bool]:
    """The written-out decode step against the text model's stock forward on the same padded batch."""
    requests = []
    for valid in jobs(SamplingParams(max_new_tokens=steps + 1, temperature=0.0)):
        requests.append(make_request(valid, worker))
    batch = RunningBatch(cross_layers=worker.cross_attention_layers)
    prefill = worker.prefill(requests)
    sampling = RowSampling([r.params for r in requests], prefill.logits.device)
    batch.join([Row(r, None) for r in requests], prefill, sampling.sample(prefill.logits), sampling)
    worst, same = 0.0, True
    written_step = worker.decode_step
    for _ in range(steps):
        inputs = batch.step_inputs()
        stock_inputs = {**inputs, "cache": copy.deepcopy(inputs["cache"])}
        worker.decode_step = None
        try:
            stock = worker.decode(stock_inputs)
        finally:
            worker.decode_step = written_step
        mine = worker.decode(inputs)
        worst = max(worst, float((mine - stock).abs().max()))
        same = same and bool(torch.equal(mine.argmax(-1), stock.argmax(-1)))
        batch.advance(batch.sampling.sample(mine))
    return {"max_abs_logit_diff": worst, "same_argmax": same, "written_out_step": written_step is not None}


def forced_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(round(x)) for x in np.exp(rng.uniform(np.log(low), np.log(high), n))]


def workload(n: int, seed: int = 0) -> list[ValidRequest]:
    lengths = forced_lengths(n, *LENGTHS, seed=seed)
    items = []
    for i, length in enumerate(lengths):
        (w, h), question = CASES[i % len(CASES)]
        params = SamplingParams(max_new_tokens=length, temperature=0.0, ignore_eos=True)
        items.append(validate_request(noise_image(i, w, h), question, params, LIMITS))
    return items


def benchmark(worker: Worker, levels: tuple[int, ...], requests_at: Any, deadline: float) -> list[dict[str, Any]]:
    """Closed-loop load (``vlm_demo.tools.bench``'s clients) for each mode and concurrency level."""
    from vlm_demo.tools.bench import BatchCounter, run_load, summarise

    results = []
    for level in levels:
        for mode in ("unbatched", "dynamic", "continuous"):
            if time.monotonic() > deadline:
                log.warning("time budget spent: skipping %s at concurrency %d", mode, level)
                continue
            batching, rows = ("dynamic", 1) if mode == "unbatched" else (mode, max(level, 1))
            n = min(UNBATCHED_REQUESTS, requests_at(level)) if mode == "unbatched" else requests_at(level)
            engine = make_engine(Config(batching=batching, max_batch_size=rows, batch_window_ms=50.0), worker)
            counter = BatchCounter()
            engine.add_listener(counter)
            try:
                warm = validate_request(noise_image(99, 64, 64), "Hi", SamplingParams(4, 0.0, ignore_eos=True), LIMITS)
                engine.submit(warm).result(timeout=600)
                counter.sizes.clear()
                samples, wall = run_load(engine, workload(n, seed=level), level)
            finally:
                engine.shutdown()
            result = dataclasses.asdict(summarise(mode, rows, level, samples, wall, counter.sizes))
            log.info("%s", result)
            results.append(result)
    return results


def batch1_decode(worker: Worker, tokens: int = 128) -> float:
    """Decode tokens/s of one request alone (continuous mode: the engine's own step)."""
    engine = make_engine(Config(batching="continuous", max_batch_size=1), worker)
    try:
        params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
        engine.generate(validate_request(noise_image(7, 64, 64), "Hi", SamplingParams(8, 0.0), LIMITS))
        return engine.generate(validate_request(noise_image(8, 560, 560), "Hi", params, LIMITS)).tokens_per_s
    finally:
        engine.shutdown()


def ratios(results: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per concurrency: dynamic ÷ unbatched and continuous ÷ dynamic throughput (tokens/s)."""
    out: dict[int, dict[str, float]] = {}
    for level in sorted({r["concurrency"] for r in results}):
        by_mode = {r["mode"]: r["tokens_per_s"] for r in results if r["concurrency"] == level}
        entry = {}
        if by_mode.get("unbatched") and "dynamic" in by_mode:
            entry["dynamic/unbatched"] = by_mode["dynamic"] / by_mode["unbatched"]
        if by_mode.get("dynamic") and "continuous" in by_mode:
            entry["continuous/dynamic"] = by_mode["continuous"] / by_mode["dynamic"]
        out[level] = entry
    return out


def no_cuda_message() -> str:
    return (
        f"vlm_demo.tools.gpucheck needs a CUDA GPU and PyTorch sees none (torch {torch.__version__}, CUDA build "
        f"{torch.version.cuda or 'none'}). Run it on a machine with an NVIDIA GPU (about 30 GB free for the "
        f"11B model in bf16); on CPU, tests/test_realshape.py runs the real-shape checks at narrow widths."
    )


def build_worker(model: str, device: torch.device, processor: Any, dtype: torch.dtype | None = None) -> Worker:
    """The model under test: the full 11B architecture or the narrow one with random weights (bf16
    on a GPU, fp32 on CPU, unless ``dtype`` says), or the tiny test model (a dry run on CPU)."""
    if model == "tiny":
        return load("tiny", device=str(device))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = realshape.full_config() if model == "full" else realshape.narrow_config()
    return Worker(realshape.build_model(config, dtype, device), processor, f"{model}-random")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlm_demo.tools.gpucheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument(
        "--model", default="full", choices=("full", "narrow", "tiny"), help="narrow/tiny: a dry run (also on CPU)"
    )
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip benchmark runs past this many seconds")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels")
    parser.add_argument("--requests", type=int, default=0, help="requests per run (default: max(8, 2 x level))")
    parser.add_argument("--check-tokens", type=int, default=16, help="tokens per row in the batched == single checks")
    parser.add_argument("--json", dest="json_path", default="", help="write every figure here")
    return parser


class Stages:
    """Runs the check's stages in order; a stage that raises is recorded as failed and the rest go on
    (device time is scarce: one broken stage must not cost the other figures)."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, name: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported in the summary and the exit code
            log.exception("stage %r failed", name)
            self.failed.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available() or device.type != "cuda" and args.model == "full":
        print(no_cuda_message(), file=sys.stderr)
        return 2
    started = time.monotonic()
    cuda = device.type == "cuda"
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)"}
    report.update(torch=torch.__version__, cuda=torch.version.cuda, model=args.model)
    stages = Stages()
    processor = realshape.real_processor()

    if cuda:  # 1. the CI model, fp32 on the GPU: batched rows must equal single runs
        torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions would make fp32 depend on the batch
        narrow = stages.run("build narrow fp32", build_worker, "narrow", device, processor, torch.float32)
        if narrow is not None:
            check = stages.run("narrow fp32 batched == single", batched_vs_single, narrow, args.check_tokens)
            if check is not None:
                report["narrow_fp32_first_diff"] = check.first_diff
                if not check.equal:
                    stages.failed.append("narrow fp32: batched rows differ from their single runs")
        del narrow
        torch.cuda.empty_cache()

    # 2. the model under test (the full 11B architecture, random bf16 weights, built on the GPU)
    built = time.monotonic()
    worker = stages.run("build model", build_worker, args.model, device, processor)
    if worker is None:
        return finish(report, stages, started, args.json_path)
    if cuda:
        stages.run("weights on the GPU", check_on_gpus, worker.model)
    report.update(
        parameters=sum(p.numel() for p in worker.model.parameters()),
        weight_bytes=sum(p.numel() * p.element_size() for p in worker.model.parameters()),
        dtype=str(worker.dtype),
        build_s=time.monotonic() - built,
        written_out_step=worker.decode_step is not None,
    )
    report["memory_plan"] = stages.run("memory plan", lambda: plan_stats(worker))
    check = stages.run("batched vs single", batched_vs_single, worker, args.check_tokens)
    if check is not None:  # reported, not required: in bf16 batched rows are not bitwise equal
        report["first_diff"] = check.first_diff
    step = report["step_vs_stock"] = stages.run("written-out step vs stock", step_vs_stock, worker)
    if step is not None and not step["same_argmax"]:
        stages.failed.append("written-out decode step disagrees with the stock forward")

    # 3. throughput
    if cuda:
        spec = report["bandwidth_spec"] = spec_bandwidth(report["gpu"])
        measured = report["bandwidth_measured"] = stages.run("bandwidth", measure_bandwidth, device)
        report["batch1_bound_spec"] = bandwidth_bound(report["weight_bytes"], spec) if spec else None
        report["batch1_bound_measured"] = bandwidth_bound(report["weight_bytes"], measured) if measured else None
    report["batch1_tokens_per_s"] = stages.run("decode at batch 1", batch1_decode, worker)
    levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
    requests_at = (lambda level: args.requests) if args.requests else (lambda level: max(8, 2 * level))
    runs = stages.run("benchmark", benchmark, worker, levels, requests_at, started + args.budget_s)
    report["runs"] = runs or []
    report["ratios"] = ratios(report["runs"])
    return finish(report, stages, started, args.json_path)


def plan_stats(worker: Worker) -> dict[str, Any]:
    """The engine's memory plan for this worker (what a server would run with)."""
    return plan_for(worker, Config(batching="continuous")).stats()


def finish(report: dict[str, Any], stages: Stages, started: float, json_path: str) -> int:
    report["total_s"] = time.monotonic() - started
    report["failed"] = stages.failed
    print_report(report)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    return 1 if stages.failed else 0


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "n/a"


def print_report(report: dict[str, Any]) -> None:
    print(f"\nGPU {report['gpu']} (torch {report['torch']}, CUDA {report['cuda']}); model {report['model']}")
    if "parameters" in report:
        print(
            f"model: {report['parameters'] / 1e9:.2f} B parameters, {report['weight_bytes'] / GB:.2f} GB of "
            f"{report['dtype']} weights, built in {report['build_s']:.0f} s"
        )
    plan = report.get("memory_plan") or {}
    if plan:
        budget = plan["kv_budget_bytes"] / 1024**3
        print(f"memory plan: {plan['max_batch_size']} rows, KV budget {budget:.1f} GiB ({plan['memory_plan']})")
    if "narrow_fp32_first_diff" in report:
        print(f"narrow fp32 batched == single (first differing token per row): {report['narrow_fp32_first_diff']}")
    print(f"batched vs single, model under test (bf16 is not bitwise): {report.get('first_diff', 'n/a')}")
    print(f"written-out step vs stock forward: {report.get('step_vs_stock')}")
    bound = ""
    if report.get("batch1_bound_measured"):
        bound += f"; bandwidth bound {report['batch1_bound_measured']:.1f} tokens/s"
        bound += f" (measured {report['bandwidth_measured'] / GB:.0f} GB/s)"
    if report.get("batch1_bound_spec"):
        bound += f", {report['batch1_bound_spec']:.1f} tokens/s (spec {report['bandwidth_spec'] / GB:.0f} GB/s)"
    print(f"decode at batch 1: {_num(report.get('batch1_tokens_per_s'), '.1f')} tokens/s" + bound)
    print(f"{'mode':<11}{'conc':>5}{'reqs':>5}{'tok/s':>9}{'p50 s':>8}{'ttft s':>8}{'meanB':>7}{'err':>5}")
    for r in report["runs"]:
        print(
            f"{r['mode']:<11}{r['concurrency']:>5}{r['requests']:>5}{r['tokens_per_s']:>9.1f}"
            f"{r['latency_p50_s']:>8.2f}{r['ttft_p50_s']:>8.3f}{r['mean_batch_size']:>7.2f}{r['errors']:>5}"
        )
    for level, entry in report["ratios"].items():
        print(f"concurrency {level}: " + ", ".join(f"{k} {v:.2f}x" for k, v in entry.items()))
    verdict = "FAILED: " + "; ".join(report["failed"]) if report["failed"] else "OK"
    print(f"total {report['total_s']:.0f} s; {verdict}")


if __name__ == "__main__":
    sys.exit(main())
