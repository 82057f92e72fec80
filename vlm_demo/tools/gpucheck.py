"""One-shot device check: ``python -m vlm_demo.tools.gpucheck`` on a CUDA machine, with no download.

Everything else in this project runs on a 1 MB model on CPU. This builds the full
Llama-3.2-11B-Vision architecture (40 text layers, 32 + 8 vision layers, vocabulary 128256) with
random bf16 weights directly on the GPU and measures (:mod:`vlm_demo.tools.gpu.kernel_stages`,
:mod:`vlm_demo.tools.gpu.measure`), the kernels first — what a short loan must learn before anything else:

1. versions: python, torch, transformers, accelerate, CUDA, the GPU; a transformers other than the
   pinned one (``requirements.txt``) stops the check in one line, before anything is built; then the model,
   its placement and the memory plan (always);
2. the kernel stages (``--stages`` groups ``bandwidth``, ``attention``, ``linear``, ``graphs``, ``batch1``):
   the device's copy bandwidth; the decode attention op alone at the model's page geometry (1-210 rows of 600
   tokens, 1- and 4-tile pictures) per kernel, against the reference; the weight-only op alone per packed format
   on the four projection shapes at 1-256 rows, against bf16's ``F.linear``; which kernel ``auto`` takes, and the
   decode step per kernel eagerly and replayed from CUDA graphs at 1 and 128 rows with 4-tile pictures, with
   the profiler's device time per kernel; decode at batch 1 against the bound from the bytes a step reads;
3. the engine's stages, within ``--engine-share`` of the budget (groups ``checks``, ``narrow``, ``prefill``,
   ``benchmark``, ``formats``, ``peak``): batched vs single and the written-out step vs the stock forward; the
   narrow model in fp32 on the GPU (batched == single exactly, loading a saved folder); admitting newcomers
   (the vision tower per tile count, the running rows' pause); unbatched, dynamic and continuous batching at
   concurrency 1, 8 and 32; the model rebuilt per weight format; the planned row limit filled.

On CUDA the check fails when a block-table decode attention captured no graph (or its replay differs from the
eager step), when a packed format is slower than bf16 at a row count where it reads fewer bytes, when batch-1
decode is below 40 % of the bound at the measured copy bandwidth, when a kernel differs from its reference, and
when the device ends on the reference decode attention (the decisions: ``gpu_kernels``' plain functions).

Device time is scarce (15 minutes a session, 10 a command, and a rerun must fit), so the run keeps to
a time budget and loses nothing it measured. No optional stage or benchmark run starts unless its
estimate fits in what is left of ``--budget-s`` (300 s from the start); the join/evict peak run shrinks
to the rows that fit; what is skipped is recorded with why. The JSON report is rewritten after every
stage, a stage or run that fails is recorded and the rest go on, every request has a 120 s timeout,
and a watchdog (``--deadline-s``, 360 s) dumps every thread's traceback and writes the report before
it ends the run. The kernel stages are estimated to end ~2.5-3 minutes after the start on an H100
(docs/gpu.md has the arithmetic). Exit code 0: all required checks that ran passed; 1: a check
failed; 2: no CUDA, or the wrong versions; 3: the watchdog stopped it. ``--device cpu --model tiny`` (or
``narrow``) is a dry run of the whole script without the GPU-only stages (the tests run it).

This module only orchestrates and reports, and imports nothing heavy until the versions are checked
(an old transformers may not even import our engine).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from vlm_demo import REPO_ROOT

log = logging.getLogger("vlm_demo.tools.gpucheck")

GB = 1e9
LEVELS = (1, 8, 32)
PACKAGES = (
    "torch",
    "torchao",
    "transformers",
    "accelerate",
    "tokenizers",
    "huggingface_hub",
    "safetensors",
    "numpy",
    "pillow",
)
PINNED = ("transformers",)  # must equal requirements.txt: the engine uses its cache and model internals
WATCHDOG_EXIT = 3
DEADLINE_S = 360.0  # the watchdog: report written, run ended (the device runner kills 20 s later)
BUDGET_S = 300.0  # no optional stage starts that would end past this (seconds from the start) ...
MARGIN_S = DEADLINE_S - BUDGET_S  # ... and it ends this long before the deadline, for the stage under way
BACKSTOP_S = 15.0  # after the deadline: faulthandler ends the run if the watchdog's thread could not
# Rough seconds each optional stage takes on an H100, with room to spare: it starts only with that much
# of the budget (the engine's stages: of their share) left.
NEED_S = {
    # the kernel stages (estimated for an H100; docs/gpu.md, 'The time budget', has the sum)
    "bandwidth": 5.0,
    "kernel: decode attention": 30.0,  # the ops alone; Triton compiles a few variants
    "kernel: weight-only linear": 60.0,  # ~30 Triton compilations: 2 input widths x 3 formats x 5 row tiers
    "decode attention: auto": 10.0,  # the fast kernels' probes
    # each: capture 12 buckets, time eager and replayed steps at 1 and 128 rows, one profiled step
    "decode step: flash": 30.0,
    "decode step: triton": 30.0,
    "decode step: reference": 25.0,  # eager only
    "decode at batch 1": 15.0,
    # the engine's stages, within --engine-share of the budget
    "batched vs single": 40.0,
    "written-out step vs stock": 10.0,
    "build narrow fp32": 15.0,
    "narrow fp32 batched == single": 30.0,
    "load from a folder on CUDA": 30.0,
    "prefill": 40.0,  # the tower at 1-4 tiles, then 8 rows while 8 newcomers join, at once and paced
    "weights: bf16": 30.0,  # greedy tokens, batch-1 decode, one wave of 32 answers
    "weights: quantized": 50.0,  # the same, plus building the model again and quantizing it
}
# --stages: the stage groups in the order they run. The kernel stages come first, right after the model is built
# (what a short loan must learn first); the engine's stages last, within ENGINE_SHARE of the budget.
STAGES = {
    "bandwidth": "device memory bandwidth from a timed copy_ (the yardstick of every GB/s and bound)",
    "attention": "the decode attention op alone at the model's page geometry, per kernel",
    "linear": "the weight-only linear op alone per packed format, on the four projection shapes",
    "graphs": "which kernel auto takes; the decode step per kernel, eager and replayed from CUDA graphs",
    "batch1": "decode at batch 1 against the bound from the bytes a step reads",
    "checks": "batched vs single, the written-out step vs the stock forward",
    "narrow": "the narrow model in fp32 on CUDA: batched == single exactly; loading a saved folder",
    "prefill": "the vision tower per tile count; the running rows' pause while newcomers join",
    "benchmark": "unbatched, dynamic and continuous batching at each concurrency level",
    "formats": "the model rebuilt per weight format (fp8, int8, int4) against bf16, end to end",
    "peak": "the planned row limit filled, rows joining and leaving",
}
ENGINE_STAGES = ("checks", "narrow", "prefill", "benchmark", "formats", "peak")
ENGINE_SHARE = 0.4  # of the budget, at most, for the engine's stages (whatever the kernel stages left)
KERNEL_TOLERANCE = 2e-2  # the packed kernel against torch's product, relative: bf16 rounding of the output, not more


# ---- versions ------------------------------------------------------------------------------------------


def installed_versions() -> dict[str, str | None]:
    """Python and each package's version as installed (read from its metadata: nothing is imported)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    spec = importlib.util.find_spec("transformers")  # which copy runs (the device carries its own)
    versions["transformers_from"] = os.path.dirname(spec.origin) if spec and spec.origin else None
    return versions


def pinned_versions(requirements: str = os.path.join(REPO_ROOT, "requirements.txt")) -> dict[str, str]:
    """``name==version`` lines of the requirements file (names normalised as pip does)."""
    pins = {}
    with open(requirements) as fh:
        for line in fh:
            match = re.match(r"\s*([A-Za-z0-9_.\-\[\]]+?)\s*==\s*([^\s;#]+)", line)
            if match:
                pins[re.sub(r"\[.*\]", "", match.group(1)).lower().replace("-", "_")] = match.group(2)
    return pins


def version_problem(versions: dict[str, str | None], pins: dict[str, str]) -> str | None:
    """One line saying which pinned package is missing or at another version (``None``: all as pinned)."""
    for name in PINNED:
        want, have = pins.get(name), versions.get(name)
        if want and have != want:
            return (
                f"gpucheck needs {name}=={want} (requirements.txt) but finds {name} {have or 'not installed'}: "
                f"on the device run `python -m vlm_demo.tools.device gpucheck`, which installs the carried wheels "
                f"(prepared here with `python -m vlm_demo.tools.device prepare`)."
            )
    return None


# ---- the report and the clock ----------------------------------------------------------------------------


class Report(dict):
    """Every figure so far; :meth:`write` replaces the JSON file whole (a reader never sees half of it)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._lock = threading.Lock()

    def write(self) -> None:
        if not self.path:
            return
        with self._lock:
            partial = self.path + ".partial"
            with open(partial, "w") as fh:
                json.dump(self, fh, indent=1, default=str)
            os.replace(partial, self.path)


class Clock:
    """Seconds since the run began and what is left of its budget: the budget and the watchdog both count
    from the start of :func:`main`, as the device's own limit counts everything."""

    def __init__(self, budget_s: float) -> None:
        self.started = time.monotonic()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def share(self, seconds: float) -> Clock:
        """The same clock with a budget that ends ``seconds`` from now, or with this one's if sooner."""
        clock = Clock(min(self.budget_s, self.elapsed() + seconds))
        clock.started = self.started
        return clock


class Stages:
    """Runs the check's stages in order; a stage that raises is recorded as failed and the rest go on
    (device time is scarce: one broken stage must not cost the other figures). A stage given ``need_s``
    starts only with that many seconds of the budget left, else it is recorded in ``skipped`` with why.
    The report is written after every stage."""

    def __init__(self, report: Report, clock: Clock) -> None:
        self.report = report
        self.clock = clock
        self.failed: list[str] = report.setdefault("failed", [])
        self.skipped: dict[str, str] = report.setdefault("skipped", {})
        self.timings: dict[str, float] = report.setdefault("stage_s", {})

    def run(self, name: str, fn: Callable[..., Any], *args: Any, need_s: float | None = None) -> Any:
        left = self.clock.left()
        if need_s is not None and left < need_s:
            self.skip(name, f"time budget: needs ~{need_s:.0f} s, {max(left, 0):.0f} s left")
            return None
        self.report["stage"] = name
        self.report.write()
        started = time.monotonic()
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported in the summary and the exit code
            log.exception("stage %r failed", name)
            self.fail(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        finally:
            self.timings[name] = round(time.monotonic() - started, 2)
            self.report.write()

    def fail(self, why: str) -> None:
        self.failed.append(why)
        self.report.write()

    def skip(self, name: str, why: str) -> None:
        log.warning("skipping %r: %s", name, why)
        self.skipped[name] = why
        self.report.write()


class Watchdog:
    """Ends the run at ``deadline_s`` from the start, before the device's own limit would, with the report
    written and every thread's traceback in the log (where a hang is). Should its thread not get to run
    (a call that never releases the interpreter), faulthandler dumps the tracebacks and exits
    ``BACKSTOP_S`` later, without the report."""

    def __init__(self, report: Report, deadline_s: float, clock: Clock) -> None:
        self.report = report
        self.deadline_s = deadline_s
        self.clock = clock
        self._timer = threading.Timer(max(0.0, deadline_s - clock.elapsed()), self._expire)
        self._timer.daemon = True

    def start(self) -> Watchdog:
        self._timer.start()
        faulthandler.dump_traceback_later(
            self._timer.interval + BACKSTOP_S, exit=True, file=sys.__stderr__ or sys.stderr
        )
        return self

    def cancel(self) -> None:
        self._timer.cancel()
        faulthandler.cancel_dump_traceback_later()

    def _expire(self) -> None:
        print(f"\ngpucheck: watchdog: {self.deadline_s:.0f} s are up; tracebacks follow", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.report.setdefault("failed", []).append(
            f"watchdog: stopped after {self.deadline_s:.0f} s (stage: {self.report.get('stage')})"
        )
        self.report["total_s"] = self.clock.elapsed()
        self.report.write()
        sys.stderr.flush()
        os._exit(WATCHDOG_EXIT)


# ---- the run ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlm_demo.tools.gpucheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument(
        "--model", default="full", choices=("full", "narrow", "tiny"), help="narrow/tiny: a dry run (also on CPU)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds from the start: no optional stage or benchmark run starts that would end past them "
        f"(estimated; skipped ones are recorded; default {BUDGET_S:.0f}, or --deadline-s less {MARGIN_S:.0f} if sooner)",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=DEADLINE_S,
        help=f"watchdog: write the report and stop after this many seconds (default {DEADLINE_S:.0f})",
    )
    parser.add_argument(
        "--stages",
        default="all",
        help="comma-separated stage groups to run, in their fixed order (the model is always built and planned): "
        + ", ".join(STAGES)
        + " (default all; for a rerun on a warm machine)",
    )
    parser.add_argument(
        "--engine-share",
        type=float,
        default=ENGINE_SHARE,
        help=f"share of --budget-s the engine's stages ({', '.join(ENGINE_STAGES)}) may take at most, from where "
        f"the kernel stages end (default {ENGINE_SHARE:g}; 1 for a rerun of engine stages only)",
    )
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels")
    parser.add_argument("--requests", type=int, default=0, help="requests per run (default: max(8, 2 x level))")
    parser.add_argument("--check-tokens", type=int, default=16, help="tokens per row in the batched == single checks")
    parser.add_argument(
        "--peak-rows",
        type=int,
        default=0,
        help="rows for the join/evict peak run (default: the planned row limit; fewer if the budget is short)",
    )
    parser.add_argument("--json", dest="json_path", default="", help="write every figure here (after every stage)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.stages = chosen_stages(args.stages)
    except ValueError as exc:
        parser.error(str(exc))
    if args.budget_s is None:
        args.budget_s = max(0.0, min(BUDGET_S, args.deadline_s - MARGIN_S))
    elif args.budget_s > args.deadline_s:
        parser.error(f"--budget-s {args.budget_s:g} is past --deadline-s {args.deadline_s:g}")
    clock = Clock(args.budget_s)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = Report(args.json_path)
    report.update(model=args.model, device=args.device, budget_s=args.budget_s, deadline_s=args.deadline_s)
    report.update(stages=list(args.stages), engine_share=args.engine_share)
    report.update(versions=installed_versions(), failed=[], skipped={})
    problem = version_problem(report["versions"], pinned_versions())
    if problem:
        report["failed"].append(problem)
        report.write()
        print(problem, file=sys.stderr)
        return 2
    watchdog = Watchdog(report, args.deadline_s, clock).start()
    try:
        import torch

        report["versions"].update(torch_cuda=torch.version.cuda)
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available() or device.type != "cuda" and args.model == "full":
            report["failed"].append("no CUDA GPU")
            report.write()
            print(no_cuda_message(torch), file=sys.stderr)
            return 2
        return run(args, report, device, clock)
    finally:
        watchdog.cancel()


def no_cuda_message(torch: Any) -> str:
    return (
        f"vlm_demo.tools.gpucheck needs a CUDA GPU and PyTorch sees none (torch {torch.__version__}, CUDA build "
        f"{torch.version.cuda or 'none'}). Run it on a machine with an NVIDIA GPU (about 30 GB free for the "
        f"11B model in bf16); on CPU, tests/models/test_realshape.py runs the real-shape checks at narrow widths."
    )


def chosen_stages(text: str) -> tuple[str, ...]:
    """``--stages``: the named groups in their run order (``all``: every one); an unknown name is a ``ValueError``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return tuple(STAGES)
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise ValueError(f"--stages {text!r}: choose from all, {', '.join(STAGES)}")
    return tuple(n for n in STAGES if n in names)


def run(args: argparse.Namespace, report: Report, device: Any, clock: Clock) -> int:
    """The model, then the kernel stages (each op alone, the decode step and its graphs, batch-1 decode), then the
    engine's stages within ``--engine-share`` of the budget; only the ``--stages`` groups."""
    import torch

    from vlm_demo.models import realshape

    cuda = device.type == "cuda"
    report["gpu"] = report["versions"]["gpu"] = torch.cuda.get_device_name(device) if cuda else "cpu (dry run)"
    stages = Stages(report, clock)
    processor = realshape.real_processor()
    worker = build(stages, device, processor, args)
    if worker is None:
        return finish(report, clock)
    on = set(args.stages).__contains__
    if on("bandwidth"):
        bandwidth(stages, worker)
    if on("attention"):
        attention_op(stages, worker)
    if on("linear"):
        weights_op(stages, worker)
    if on("graphs"):
        decode_attention(stages, worker)
    if on("batch1"):
        batch1(stages, worker)
    if not any(on(name) for name in ENGINE_STAGES):
        return finish(report, clock)
    engine = Stages(report, clock.share(args.engine_share * args.budget_s))
    report["engine_budget_s"] = round(engine.clock.budget_s, 1)
    levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
    if on("checks"):
        model_checks(engine, worker, args.check_tokens)
    if on("narrow") and cuda:
        narrow_checks(engine, device, processor, args.check_tokens)
    elif on("narrow"):
        engine.skip("narrow fp32", "needs CUDA (on a CPU the model under test runs in fp32: `checks` is that check)")
    if on("prefill"):
        prefill(engine, worker)
    if on("benchmark"):
        benchmark(engine, worker, levels, args.requests)
    if on("formats"):
        weight_formats(engine, worker, processor, args.model)
    if on("peak"):
        peak(engine, worker, args.peak_rows, max(levels, default=1) if on("benchmark") else 0)
    return finish(report, clock)


def build(stages: Stages, device: Any, processor: Any, args: argparse.Namespace) -> Any:
    """The model under test (the full 11B architecture, random bf16 weights, built on the GPU), its placement and
    the memory plan (required, whatever ``--stages`` says); returns its worker (None: no build)."""
    from vlm_demo.engine.weights.quantize import stored_bytes
    from vlm_demo.tools.gpu import measure

    report = stages.report
    worker = stages.run("build model", measure.build_worker, args.model, device, processor)
    if worker is None:
        return None
    if device.type == "cuda":
        from vlm_demo.engine.weights.placement import check_on_gpus

        stages.run("weights on the GPU", check_on_gpus, worker.model)
    report.update(
        parameters=sum(p.numel() for p in worker.model.parameters()),
        weight_bytes=sum(stored_bytes(p) for p in worker.model.parameters()),
        dtype=str(worker.dtype),
        decode_reads=measure.bytes_read_per_token(worker),
    )
    report["memory_plan"] = stages.run("memory plan", plan_stats, worker)
    return worker


def bandwidth(stages: Stages, worker: Any) -> None:
    """The device's copy bandwidth, and from it (and the spec sheet's) the batch-1 bound: tokens/s if a decode step
    only read its bytes once (``decode_reads.total_at_256_tokens``: the weights it uses, a 4-tile picture's image
    states, 256 tokens of keys/values — a little more than the batch-1 run's row reads, so a lenient bound)."""
    from vlm_demo.tools.gpu import kernel_stages as kernels
    from vlm_demo.tools.gpu import measure

    report, device = stages.report, worker.device
    if device.type != "cuda":
        stages.skip("bandwidth", "needs CUDA (a GPU's memory bandwidth)")
        return
    reads = report["decode_reads"]["total_at_256_tokens"]
    spec = report["bandwidth_spec"] = measure.spec_bandwidth(report["gpu"])
    measured = report["bandwidth_measured"] = stages.run(
        "bandwidth", kernels.measure_bandwidth, device, need_s=NEED_S["bandwidth"]
    )
    report["batch1_bound_spec"] = measure.bandwidth_bound(reads, spec) if spec else None
    report["batch1_bound_measured"] = measure.bandwidth_bound(reads, measured) if measured else None


def attention_op(stages: Stages, worker: Any) -> None:
    """(a) The decode attention op alone at the model's page geometry, per kernel (``gpu_kernels.attention_op``); a
    kernel that differs from the reference fails the check."""
    from vlm_demo.engine.executor.decode_step import attention_geometry
    from vlm_demo.tools.gpu import kernel_stages as kernels

    shape, heads, device = attention_geometry(worker.model, worker.dtype)
    name = "kernel: decode attention"
    figures = stages.report["attention_op"] = stages.run(
        name, kernels.attention_op, shape, heads, device, need_s=NEED_S[name] if device.type == "cuda" else None
    )
    for why in kernels.op_errors(figures, None, worker.dtype):
        stages.fail(why)


def weights_op(stages: Stages, worker: Any) -> None:
    """(b) The weight-only linear op alone per packed format (``gpu_kernels.weights_op``): on CUDA a format slower
    than the model dtype at a row count where it reads fewer bytes fails the check; anywhere, one that differs from
    the exact product by more than its tolerance."""
    from vlm_demo.tools.gpu import kernel_stages as kernels

    cuda = worker.device.type == "cuda"
    name = "kernel: weight-only linear"
    figures = stages.report["weights_op"] = stages.run(
        name, kernels.weights_op, worker.model.config, worker.device, worker.dtype,
        need_s=NEED_S[name] if cuda else None,
    )  # fmt: skip
    for why in kernels.op_errors(None, figures, worker.dtype) + (kernels.packed_slower(figures or {}) if cuda else []):
        stages.fail(why)


def batch1(stages: Stages, worker: Any) -> None:
    """Decode at batch 1 (the continuous engine, one row); on CUDA below ``gpu_kernels.BOUND_SHARE`` of the bound
    at the measured copy bandwidth fails the check."""
    from vlm_demo.tools.gpu import kernel_stages as kernels
    from vlm_demo.tools.gpu import measure

    report, name = stages.report, "decode at batch 1"
    rate = report["batch1_tokens_per_s"] = stages.run(name, measure.batch1_decode, worker, need_s=NEED_S[name])
    bound = report.get("batch1_bound_measured")
    report["batch1_over_bound"] = rate / bound if rate and bound else None
    why = kernels.below_bound(rate, bound) if worker.device.type == "cuda" else None
    if why:
        stages.fail(why)


def narrow_checks(stages: Stages, device: Any, processor: Any, tokens: int) -> None:
    """The CI model in fp32 on the GPU: batched rows must equal single runs; loading a saved copy. TF32 is turned
    off for the rest of the run (only fp32 products feel it: the stages after this one run bf16)."""
    import torch

    from vlm_demo.tools.gpu import measure

    report = stages.report
    # No TF32 in fp32 matmuls and convolutions (it would make fp32 depend on the batch shape). These flags
    # still work in torch 2.11-2.13; the newer ``fp32_precision`` settings are not mixed in (reads then raise).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = "build narrow fp32"
    need_s = NEED_S[name] + NEED_S["narrow fp32 batched == single"]  # no build without time for its check
    narrow = stages.run(name, measure.build_worker, "narrow", device, processor, torch.float32, need_s=need_s)
    if narrow is None:
        return
    name = "narrow fp32 batched == single"
    check = stages.run(name, measure.batched_vs_single, narrow, tokens, need_s=NEED_S[name])
    if check is not None:
        report["narrow_fp32"] = {
            "first_diff": check.first_diff,
            "sampled_first_diff": check.sampled_first_diff,
            "joins": check.joins,
            "errors": check.errors,
        }
        if check.errors:
            stages.fail(f"narrow fp32 batched == single: {'; '.join(check.errors)}")
        elif not check.equal:
            stages.fail("narrow fp32: batched rows differ from their single runs")
    name = "load from a folder on CUDA"
    loaded = report["load_saved"] = stages.run(name, measure.load_saved, narrow, "cuda", need_s=NEED_S[name])
    if loaded is not None and not (loaded["same_answer"] and all("cuda" in d for d in loaded["devices"])):
        stages.fail(f"loading a saved model on CUDA: {loaded}")
    del narrow
    torch.cuda.empty_cache()


def model_checks(stages: Stages, worker: Any, tokens: int) -> None:
    """The model under test: batched vs single (each engine against its own single runs; required on a CPU, where
    fp32 is exact, reported on CUDA: bf16 kernels depend on the batch shape), the written-out step vs the stock
    forward."""
    from vlm_demo.tools.gpu import measure

    report, cuda = stages.report, worker.device.type == "cuda"
    name = "batched vs single"
    check = stages.run(name, measure.batched_vs_single, worker, tokens, need_s=NEED_S[name])
    if check is not None:  # reported, not required: in bf16 batched rows are not bitwise equal
        report.update(first_diff=check.first_diff, sampled_first_diff=check.sampled_first_diff, joins=check.joins)
        if check.errors:
            stages.fail(f"batched vs single: {'; '.join(check.errors)}")
        elif not cuda and not check.equal:
            stages.fail("batched rows differ from their single runs (fp32 on CPU must be exact)")
    name = "written-out step vs stock"
    step = report["step_vs_stock"] = stages.run(name, measure.step_vs_stock, worker, need_s=NEED_S[name])
    if step is not None and not step["same_argmax"]:
        stages.fail("written-out decode step disagrees with the stock forward")


def benchmark(stages: Stages, worker: Any, levels: tuple[int, ...], requests: int) -> None:
    """Unbatched, dynamic and continuous batching at each level, each run only if it fits the time left."""
    from vlm_demo.tools.gpu import measure

    report = stages.report
    requests_at = (lambda level: requests) if requests else (lambda level: max(8, 2 * level))
    runs: list[dict[str, Any]] = report.setdefault("runs", [])

    def record(run_result: dict[str, Any]) -> None:
        runs.append(run_result)
        report["ratios"] = measure.ratios([r for r in runs if "tokens_per_s" in r])
        report.write()

    rate = report.get("batch1_tokens_per_s")
    stages.run("benchmark", measure.benchmark, worker, levels, requests_at, stages.clock.left, record, rate)
    failed_runs = [f"{r['mode']}@{r['concurrency']}: {r['error']}" for r in runs if "error" in r]
    if failed_runs:
        stages.fail("benchmark runs failed: " + "; ".join(failed_runs))


def decode_attention(stages: Stages, worker: Any) -> None:
    """(c) The decode step: which kernel ``auto`` takes here (a CUDA device that ends on the reference fails the
    check, saying why), then a stage per kernel this torch can run (``decode step: flash|triton|reference``): its
    probe, the step eagerly and (flash, triton) replayed from CUDA graphs at 1 and 128 rows of 600 tokens with 4-tile
    pictures, the replayed logits against the eager ones, NaN steps, and the device time per kernel of one profiled
    step. On CUDA a block-table kernel that captured no graph fails the check (``gpu_kernels.graphs_problems``). A
    kernel that cannot run here is skipped with the reason. On a CPU: the reference, and Triton under its
    interpreter when ``TRITON_INTERPRET=1``, at 1 and 2 short rows."""
    from vlm_demo.engine.executor.attention import KERNELS, check, decide
    from vlm_demo.engine.executor.decode_step import attention_geometry
    from vlm_demo.tools.gpu import kernel_stages as kernels
    from vlm_demo.tools.gpu import measure

    report, cuda = stages.report, worker.device.type == "cuda"
    shape, heads, device = attention_geometry(worker.model, worker.dtype)
    name = "decode attention: auto"
    decided = stages.run(name, decide, shape, heads, device, need_s=NEED_S[name] if cuda else None)
    chosen, passed_over = decided or (None, [])
    auto = chosen.name if chosen is not None else None
    report["decode_attention_auto"] = {"kernel": auto, "passed_over": passed_over}
    if cuda and auto == "reference":
        stages.fail(f"the CUDA device ends on the reference decode attention ({'; '.join(passed_over)})")
    figures = report.setdefault("decode_attention", {})
    for name in KERNELS:
        stage = f"decode step: {name}"
        need_s = NEED_S[stage] if cuda else None
        if need_s is not None and stages.clock.left() < need_s:
            stages.skip(stage, "time budget: none left")
            continue
        missing, probed = check(name, shape, heads, device, asked=True)
        probe = vars(probed) if probed is not None else None
        if missing is not None:
            figures[name] = {"skipped": missing, "probe": probe}
            stages.skip(stage, missing)
            continue
        rows, length, steps, tiles = ((1, 128), 600, 10, 4) if cuda else ((1, 2), 24, 1, 1)
        measured = stages.run(stage, measure.attention_figures, worker, name, rows, length, steps, tiles, need_s=need_s)
        figures[name] = {**(measured or {}), "probe": probe}
        if measured:
            for why in kernels.graphs_problems(measured, cuda, KERNELS[name].graphable):
                stages.fail(f"{stage}: {why}")
        if name == auto and measured:
            report["decode_graphs"] = measured


def prefill(stages: Stages, worker: Any) -> None:
    """Admitting newcomers: the vision tower's seconds per picture of 1-4 real tiles (and a 1-tile picture run
    on every tile, the stock way), then ``bench --prefill-stall`` on this model: the running rows' longest pause
    while 8 newcomers with 4-tile pictures join, against the median decode step (paced, the default, must stay
    within 3 of them). Skipped on a CPU (the tests and the bench measure it there)."""
    from vlm_demo.tools.gpu import measure

    if worker.device.type != "cuda":
        stages.skip("prefill", "needs CUDA (on a CPU: python -m vlm_demo.tools.bench --prefill-stall)")
        return
    report, need_s = stages.report, NEED_S["prefill"]
    report["vision_tower_s"] = stages.run("prefill: vision tower", measure.tower_seconds, worker, need_s=need_s / 4)
    stall = report["prefill_stall"] = stages.run("prefill: stall", measure.prefill_stall, worker, need_s=need_s)
    paced = (stall or {}).get("after: paced, real tiles")
    if paced and paced["pause_over_median"] > 3:
        stages.fail(
            f"prefill: the running rows paused {paced['pause_over_median']} decode steps while newcomers joined"
        )


def weight_formats(stages: Stages, worker: Any, processor: Any, model: str) -> None:
    """Weight formats end to end: bf16 (the model under test), then fp8 where the GPU has it, int8 and int4, each
    measured alike and timed against bf16; a format that reads fewer bytes per step yet decodes slower fails the
    check (``weight_formats_slower``). A format the GPU cannot run is skipped with the loader's own reason. CPU:
    skipped (these are GPU figures)."""
    import torch

    from vlm_demo.engine.weights.quantize import problem
    from vlm_demo.tools.gpu import measure

    report, device = stages.report, worker.device
    if device.type != "cuda":
        why = "needs a CUDA GPU: decode speed and memory per weight format are GPU figures (tests/models/test_quantize.py "
        stages.skip("weight formats", why + "checks every format's answers on CPU)")
        return
    formats = report["weight_formats"] = {}
    name = "weights: bf16"
    base = formats["bf16"] = stages.run(name, measure.format_figures, worker, None, need_s=NEED_S[name])
    if base is None:
        return
    capability = torch.cuda.get_device_capability(device)
    for kind in ("fp8", "int8", "int4"):
        name = f"weights: {kind}"
        refused = problem(kind, True, capability, report["gpu"], worker.dtype)
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
        if not refused and free < 1.2 * report["weight_bytes"]:  # rebuilt in bf16 next to the model under test
            refused = f"{free / GB:.1f} GB free: the model is rebuilt in bf16 before it is quantized (needs ~{1.2 * report['weight_bytes'] / GB:.0f} GB)"
        if refused:
            stages.skip(name, refused)
            continue
        need_s = NEED_S["weights: quantized"]
        figures = stages.run(
            name, measure.quantized_figures, model, device, processor, kind, base["greedy"], need_s=need_s
        )
        formats[kind] = figures
        if figures is not None and figures["errors"]:
            stages.fail(f"{name}: {figures['errors']} of the {measure.QUANTIZED_ROWS} answers failed")
        if figures is not None and figures.get("kernel_vs_torch", 0.0) > KERNEL_TOLERANCE:
            stages.fail(f"{name}: the packed kernel differs from torch's product by {figures['kernel_vs_torch']:.3g}")
        report.write()
    slower = report["weight_formats_slower"] = measure.slower_than_bf16(formats)
    for why in slower:
        stages.fail(why)


def peak(stages: Stages, worker: Any, rows: int, benchmarked: int) -> None:
    """The planned row limit (or ``rows``) filled, rows joining and leaving: the join/evict peak. Shrunk to
    the rows that fit the budget at the best continuous rate measured; skipped when that is no more rows
    than the benchmark already ran."""
    from vlm_demo.tools.gpu import measure

    report = stages.report
    planned = rows or (report["memory_plan"] or {}).get("max_batch_size", 0)
    continuous = [
        r["tokens_per_s"] for r in report.get("runs", []) if r["mode"] == "continuous" and "tokens_per_s" in r
    ]
    rate = max(continuous, default=None) or report.get("batch1_tokens_per_s")
    left = stages.clock.left()
    fit = measure.peak_rows_that_fit(planned, left, rate) if rate else planned
    name = "join/evict peak"
    short = f"time budget: {fit} of the planned {planned} rows fit in the {max(left, 0):.0f} s left"
    if not planned:
        stages.skip(name, "no memory plan to size it")
    elif left <= 0:
        stages.skip(name, "time budget: none left")
    elif fit < planned and fit <= benchmarked:
        stages.skip(name, short)
    else:
        result = report["peak_run"] = stages.run(name, measure.peak_run, worker, fit)
        if result is not None:
            result.update(planned_rows=planned, shrunk=short if fit < planned else None)
            if result.get("errors"):
                stages.fail(f"the peak run at {fit} rows had {result['errors']} errors: {result.get('first_error')}")
            report.write()


def plan_stats(worker: Any) -> dict[str, Any]:
    """The engine's memory plan for this worker (what a server would run with)."""
    from vlm_demo.config import Config
    from vlm_demo.engine.kv.memory import plan_for

    return plan_for(worker, Config(batching="continuous")).stats()


def finish(report: Report, clock: Clock) -> int:
    report["total_s"] = clock.elapsed()
    report.pop("stage", None)
    report.write()
    print_report(report)
    return 1 if report["failed"] else 0


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "n/a"


def print_report(report: dict[str, Any]) -> None:
    versions = report["versions"]
    print(
        f"\nGPU {report.get('gpu')} (python {versions['python']}, torch {versions['torch']}, CUDA "
        f"{versions.get('torch_cuda')}, transformers {versions['transformers']}); model {report['model']}"
    )
    if "parameters" in report:
        print(
            f"model: {report['parameters'] / 1e9:.2f} B parameters, {report['weight_bytes'] / GB:.2f} GB of "
            f"{report['dtype']} weights; a decode step reads {report['decode_reads']['weights'] / GB:.2f} GB of them"
        )
    plan = report.get("memory_plan") or {}
    if plan:
        budget = plan["kv_budget_bytes"] / 1024**3
        print(f"memory plan: {plan['max_batch_size']} rows, KV budget {budget:.1f} GiB ({plan['memory_plan']})")
    if "narrow_fp32" in report:
        print(f"narrow fp32 batched == single (first differing token per row): {report['narrow_fp32']}")
    if "load_saved" in report:
        print(f"loaded back from a folder: {report['load_saved']}")
    print(f"batched vs single, model under test (bf16 is not bitwise): {report.get('first_diff', 'n/a')}")
    print(f"paged decode step vs stock forward: {report.get('step_vs_stock')}")
    bound = ""
    if report.get("batch1_bound_measured"):
        bound += f"; bandwidth bound {report['batch1_bound_measured']:.1f} tokens/s"
        bound += f" (measured {report['bandwidth_measured'] / GB:.0f} GB/s)"
    if report.get("batch1_bound_spec"):
        bound += f", {report['batch1_bound_spec']:.1f} tokens/s (spec {report['bandwidth_spec'] / GB:.0f} GB/s)"
    print(f"decode at batch 1: {_num(report.get('batch1_tokens_per_s'), '.1f')} tokens/s" + bound)
    if report.get("batch1_over_bound"):
        print(f"decode at batch 1 reaches {report['batch1_over_bound']:.0%} of the measured bound")
    print(
        f"{'mode':<11}{'conc':>5}{'reqs':>5}{'tok/s':>9}{'p50 s':>8}{'ttft s':>8}{'meanB':>7}{'err':>5}{'peak GB':>9}"
    )
    for r in report.get("runs", []):
        if "tokens_per_s" not in r:
            print(f"{r['mode']:<11}{r['concurrency']:>5}  {r.get('error') or r.get('skipped')}")
            continue
        peak = r.get("peak_memory_bytes")
        print(
            f"{r['mode']:<11}{r['concurrency']:>5}{r['requests']:>5}{r['tokens_per_s']:>9.1f}"
            f"{r['latency_p50_s']:>8.2f}{r['ttft_p50_s']:>8.3f}{r['mean_batch_size']:>7.2f}{r['errors']:>5}"
            f"{_num(peak / GB if peak else None, '9.1f'):>9}"
        )
    for level, entry in report.get("ratios", {}).items():
        print(f"concurrency {level}: " + ", ".join(f"{k} {v:.2f}x" for k, v in entry.items()))
    for kind, figures in (report.get("weight_formats") or {}).items():
        if figures:
            print(
                f"{kind} weights: {figures['weight_bytes'] / GB:.2f} GB; decode {_num(figures['batch1_tokens_per_s'], '.1f')} "
                f"tokens/s at batch 1, {_num(figures['rows_tokens_per_s'], '.1f')} at {figures['rows']} rows; peak "
                f"{(figures['peak_memory_bytes'] or 0) / GB:.1f} GB; first token differing from bf16's greedy: "
                f"{figures.get('first_diff_vs_bf16', '(the reference)')}"
            )
    print_kernels(report)
    if report.get("peak_run"):
        peak = report["peak_run"]
        print(f"join/evict peak: {peak}")
    for name, why in report.get("skipped", {}).items():
        print(f"skipped {name}: {why}")
    verdict = "FAILED: " + "; ".join(report["failed"]) if report["failed"] else "OK"
    print(f"total {report['total_s']:.0f} s; {verdict}")


def print_kernels(report: dict[str, Any]) -> None:
    """The kernel stages' lines: the attention op and the weight-only op at their largest row counts, the decode
    step per kernel, its three longest kernels."""
    attention = report.get("attention_op") or {}
    for name, kernel in (attention.get("kernels") or {}).items():
        if "rows" not in kernel:
            print(f"attention op {name}: {kernel.get('skipped', 'failed')}")
            continue
        parts = []
        for rows, figures in kernel["rows"].items():
            parts.append(f"{rows} rows " + ", ".join(f"{part} {e['us']:.0f} µs {e['gb_s']:.0f} GB/s"
                                                    for part, e in figures.items()))  # fmt: skip
        print(f"attention op {name} (µs per layer): " + "; ".join(parts) + (f"; {kernel['failure']}" if "failure" in kernel else ""))  # fmt: skip
    weights = report.get("weights_op") or {}
    for shape, figures in (weights.get("shapes") or {}).items():
        line = []
        for m, entries in figures["rows"].items():
            line.append(f"M={m} " + " ".join(f"{fmt} {e['us']:.0f}" for fmt, e in entries.items()))
        print(f"weight-only op {shape} [{figures['out_features']}x{figures['in_features']}] µs: " + "; ".join(line))
    auto = report.get("decode_attention_auto") or {}
    if auto:
        print(f"decode attention (auto): {auto['kernel']}" + "".join(f"; {why}" for why in auto["passed_over"]))
    for name, figures in (report.get("decode_attention") or {}).items():
        if "rows" not in figures:
            print(f"decode step {name}: {figures.get('skipped', 'failed')}")
            continue
        steps = ", ".join(
            f"{rows} rows {_num(entry['eager_step_ms'], '.1f')}"
            + (f"/{entry['graphs_step_ms']:.1f}" if "graphs_step_ms" in entry else "")
            for rows, entry in figures["rows"].items()
        )
        longest = ", ".join(f"{k} {v['us']:.0f} µs x{v['calls']}" for k, v in list(figures["kernel_times"].items())[:3])
        print(f"decode step {name} ({figures['tiles']}-tile rows): ms eager/replayed {steps}; {figures['captured']} "
              f"graphs; NaN steps {figures['nan_steps']} of {figures['steps']}; longest kernels {longest or 'n/a'}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
