"""One-shot device check: ``python -m vlm_demo.tools.gpucheck`` on a CUDA machine, with no download.

Everything else in this project runs on a 1 MB model on CPU. This builds the full
Llama-3.2-11B-Vision architecture (40 text layers, 32 + 8 vision layers, vocabulary 128256) with
random bf16 weights directly on the GPU and measures, in order (:mod:`vlm_demo.tools.gpu_measure`):

1. versions: python, torch, transformers, accelerate, CUDA, the GPU; a transformers other than the
   pinned one (``requirements.txt``) stops the check in one line, before anything is built;
2. the narrow real-shape model in fp32 on the GPU: every batched row (both modes, rows joining a running
   one, a seeded sampled row beside them) must give its single run's tokens; the same model saved and
   loaded back through the server's own loading path (placement, the on-GPU check);
3. the full model in bf16: every weight on the GPU, the memory plan, batched vs single (reported, not
   required: bf16 kernels depend on the batch shape), the written-out decode step vs the stock forward;
4. speed: decode tokens/s at batch 1 next to the bound from the bytes a decode step reads; unbatched,
   dynamic and continuous batching at concurrency 1, 8 and 32, each run isolated, with its peak memory;
   the planned row limit filled (rows joining and leaving) to check the join/evict peak.

Device time is scarce, so nothing measured is lost: the JSON report is rewritten after every stage, a
stage or run that fails is recorded and the rest go on, every request has a 120 s timeout, and a
watchdog (``--deadline-s``) dumps every thread's traceback and writes the report before it ends the
run. About 3-5 minutes on an H100/H200. Exit code 0: all required checks passed; 1: a check failed;
2: no CUDA, or the wrong versions; 3: the watchdog stopped it. ``--device cpu --model tiny`` (or
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
PACKAGES = ("torch", "transformers", "accelerate", "tokenizers", "huggingface_hub", "safetensors", "numpy", "pillow")
PINNED = ("transformers",)  # must equal requirements.txt: the engine uses its cache and model internals
WATCHDOG_EXIT = 3


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


class Stages:
    """Runs the check's stages in order; a stage that raises is recorded as failed and the rest go on
    (device time is scarce: one broken stage must not cost the other figures). The report is written
    after every stage."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.failed: list[str] = report.setdefault("failed", [])
        self.timings: dict[str, float] = report.setdefault("stage_s", {})

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
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


class Watchdog:
    """Ends the run before the device's own limit would, with the report written and every thread's
    traceback in the log (where a hang is)."""

    def __init__(self, report: Report, deadline_s: float) -> None:
        self.report = report
        self.deadline_s = deadline_s
        self.started = time.monotonic()
        self._timer = threading.Timer(deadline_s, self._expire)
        self._timer.daemon = True

    def start(self) -> Watchdog:
        self._timer.start()
        return self

    def cancel(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        print(f"\ngpucheck: watchdog: {self.deadline_s:.0f} s are up; tracebacks follow", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.report.setdefault("failed", []).append(
            f"watchdog: stopped after {self.deadline_s:.0f} s (stage: {self.report.get('stage')})"
        )
        self.report["total_s"] = time.monotonic() - self.started
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
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip benchmark runs past this many seconds")
    parser.add_argument(
        "--deadline-s", type=float, default=540.0, help="watchdog: write the report and stop after this many seconds"
    )
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels")
    parser.add_argument("--requests", type=int, default=0, help="requests per run (default: max(8, 2 x level))")
    parser.add_argument("--check-tokens", type=int, default=16, help="tokens per row in the batched == single checks")
    parser.add_argument(
        "--peak-rows", type=int, default=0, help="rows for the join/evict peak run (default: the planned row limit)"
    )
    parser.add_argument("--json", dest="json_path", default="", help="write every figure here (after every stage)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = Report(args.json_path)
    report.update(model=args.model, device=args.device, versions=installed_versions(), failed=[])
    problem = version_problem(report["versions"], pinned_versions())
    if problem:
        report["failed"].append(problem)
        report.write()
        print(problem, file=sys.stderr)
        return 2
    import torch

    report["versions"].update(torch_cuda=torch.version.cuda)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available() or device.type != "cuda" and args.model == "full":
        report["failed"].append("no CUDA GPU")
        report.write()
        print(no_cuda_message(torch), file=sys.stderr)
        return 2
    watchdog = Watchdog(report, args.deadline_s).start()
    try:
        return run(args, report, device)
    finally:
        watchdog.cancel()


def no_cuda_message(torch: Any) -> str:
    return (
        f"vlm_demo.tools.gpucheck needs a CUDA GPU and PyTorch sees none (torch {torch.__version__}, CUDA build "
        f"{torch.version.cuda or 'none'}). Run it on a machine with an NVIDIA GPU (about 30 GB free for the "
        f"11B model in bf16); on CPU, tests/test_realshape.py runs the real-shape checks at narrow widths."
    )


def run(args: argparse.Namespace, report: Report, device: Any) -> int:
    import torch

    from vlm_demo.models import realshape
    from vlm_demo.tools import gpu_measure as measure

    started = time.monotonic()
    cuda = device.type == "cuda"
    report["gpu"] = report["versions"]["gpu"] = torch.cuda.get_device_name(device) if cuda else "cpu (dry run)"
    stages = Stages(report)
    processor = realshape.real_processor()

    if cuda:  # 2. the CI model, fp32 on the GPU: batched rows must equal single runs
        torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions would make fp32 depend on the batch
        torch.backends.cuda.matmul.allow_tf32 = False
        narrow = stages.run("build narrow fp32", measure.build_worker, "narrow", device, processor, torch.float32)
        if narrow is not None:
            check = stages.run("narrow fp32 batched == single", measure.batched_vs_single, narrow, args.check_tokens)
            if check is not None:
                report["narrow_fp32"] = {
                    "first_diff": check.first_diff,
                    "sampled_first_diff": check.sampled_first_diff,
                    "joins": check.joins,
                }
                if not check.equal:
                    stages.fail("narrow fp32: batched rows differ from their single runs")
            loaded = report["load_saved"] = stages.run("load from a folder on CUDA", measure.load_saved, narrow, "cuda")
            if loaded is not None and not (loaded["same_answer"] and all("cuda" in d for d in loaded["devices"])):
                stages.fail(f"loading a saved model on CUDA: {loaded}")
        del narrow
        torch.cuda.empty_cache()

    # 3. the model under test (the full 11B architecture, random bf16 weights, built on the GPU)
    worker = stages.run("build model", measure.build_worker, args.model, device, processor)
    if worker is None:
        return finish(report, started)
    if cuda:
        from vlm_demo.engine.placement import check_on_gpus

        stages.run("weights on the GPU", check_on_gpus, worker.model)
    report.update(
        parameters=sum(p.numel() for p in worker.model.parameters()),
        weight_bytes=sum(p.numel() * p.element_size() for p in worker.model.parameters()),
        dtype=str(worker.dtype),
        written_out_step=worker.decode_step is not None,
        decode_reads=measure.bytes_read_per_token(worker),
    )
    plan = report["memory_plan"] = stages.run("memory plan", plan_stats, worker)
    check = stages.run("batched vs single", measure.batched_vs_single, worker, args.check_tokens)
    if check is not None:  # reported, not required: in bf16 batched rows are not bitwise equal
        report["first_diff"], report["sampled_first_diff"], report["joins"] = (
            check.first_diff,
            check.sampled_first_diff,
            check.joins,
        )
        if not cuda and not check.equal:
            stages.fail("batched rows differ from their single runs (fp32 on CPU must be exact)")
    step = report["step_vs_stock"] = stages.run("written-out step vs stock", measure.step_vs_stock, worker)
    if step is not None and not step["same_argmax"]:
        stages.fail("written-out decode step disagrees with the stock forward")

    # 4. speed
    reads = report["decode_reads"]["total_at_256_tokens"]
    if cuda:
        spec = report["bandwidth_spec"] = measure.spec_bandwidth(report["gpu"])
        measured = report["bandwidth_measured"] = stages.run("bandwidth", measure.measure_bandwidth, device)
        report["batch1_bound_spec"] = measure.bandwidth_bound(reads, spec) if spec else None
        report["batch1_bound_measured"] = measure.bandwidth_bound(reads, measured) if measured else None
    report["batch1_tokens_per_s"] = stages.run("decode at batch 1", measure.batch1_decode, worker)
    levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
    requests_at = (lambda level: args.requests) if args.requests else (lambda level: max(8, 2 * level))
    runs: list[dict[str, Any]] = report.setdefault("runs", [])

    def record(run_result: dict[str, Any]) -> None:
        runs.append(run_result)
        report["ratios"] = measure.ratios([r for r in runs if "tokens_per_s" in r])
        report.write()

    stages.run("benchmark", measure.benchmark, worker, levels, requests_at, started + args.budget_s, record)
    failed_runs = [f"{r['mode']}@{r['concurrency']}: {r['error']}" for r in runs if "error" in r]
    if failed_runs:
        stages.fail("benchmark runs failed: " + "; ".join(failed_runs))
    rows = args.peak_rows or (plan["max_batch_size"] if plan else 0)
    if cuda and rows:
        peak = report["peak_run"] = stages.run(f"join/evict peak at {rows} rows", measure.peak_run, worker, rows)
        if peak is not None and peak.get("errors"):
            stages.fail(f"the peak run at {rows} rows had {peak['errors']} errors: {peak.get('first_error')}")
    return finish(report, started)


def plan_stats(worker: Any) -> dict[str, Any]:
    """The engine's memory plan for this worker (what a server would run with)."""
    from vlm_demo.config import Config
    from vlm_demo.engine.memory import plan_for

    return plan_for(worker, Config(batching="continuous")).stats()


def finish(report: Report, started: float) -> int:
    report["total_s"] = time.monotonic() - started
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
    print(f"written-out step vs stock forward: {report.get('step_vs_stock')}")
    bound = ""
    if report.get("batch1_bound_measured"):
        bound += f"; bandwidth bound {report['batch1_bound_measured']:.1f} tokens/s"
        bound += f" (measured {report['bandwidth_measured'] / GB:.0f} GB/s)"
    if report.get("batch1_bound_spec"):
        bound += f", {report['batch1_bound_spec']:.1f} tokens/s (spec {report['bandwidth_spec'] / GB:.0f} GB/s)"
    print(f"decode at batch 1: {_num(report.get('batch1_tokens_per_s'), '.1f')} tokens/s" + bound)
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
    if report.get("peak_run"):
        peak = report["peak_run"]
        print(f"join/evict peak: {peak}")
    verdict = "FAILED: " + "; ".join(report["failed"]) if report["failed"] else "OK"
    print(f"total {report['total_s']:.0f} s; {verdict}")


if __name__ == "__main__":
    sys.exit(main())
