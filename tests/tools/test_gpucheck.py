"""The device check's CPU-runnable parts: its arithmetic, its checks and benchmark on the tiny model, a clear
exit without CUDA or with the wrong transformers, a report that survives being stopped part-way, and the
device runner that carries our wheels to a machine without a registry. (On a GPU it builds the full 11B
architecture; see docs/gpu.md.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support import ROOT, wait_until
from transformers import MllamaForConditionalGeneration

from vlm_demo.engine.kv.memory import KVShape
from vlm_demo.models import realshape
from vlm_demo.tools import device, gpucheck
from vlm_demo.tools.gpu import kernel_stages as gpu_kernels
from vlm_demo.tools.gpu import measure as gpu_measure

PINNED_TRANSFORMERS = gpucheck.pinned_versions()["transformers"]


def run_check(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlm_demo.gpucheck", *args],
        cwd=ROOT,
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_bound_counts_the_bytes_a_decode_step_reads() -> None:
    """Not the vision tower (1.7 GB), the embedding table (1.05 GB) or the cross-attention k/v projections:
    ~18.4 GB of weights and 0.21 GB of image states per step, ~258 tokens/s on an H200 (4.8 TB/s)."""
    config = realshape.full_config()
    with torch.device("meta"):
        model = MllamaForConditionalGeneration(config).to(torch.bfloat16)
    kv = KVShape.of(config, torch.bfloat16)
    weights = gpu_measure.decode_weight_bytes(model)
    assert 18.3e9 < weights < 18.5e9
    assert 21.3e9 < sum(p.numel() * p.element_size() for p in model.parameters()) < 21.4e9
    reads = gpu_measure.decode_read_bytes(model, kv, context=256)
    assert reads == weights + kv.bytes_per_row + 256 * kv.bytes_per_token
    assert gpu_measure.spec_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_measure.spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_measure.spec_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_measure.spec_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert gpu_measure.spec_bandwidth("Some Future GPU") is None
    assert 255 < gpu_measure.bandwidth_bound(reads, 4.8e12) < 261
    assert 178 < gpu_measure.bandwidth_bound(reads, 3.35e12) < 182


def test_ratios_per_concurrency_level() -> None:
    runs = [
        {"mode": "unbatched", "concurrency": 8, "tokens_per_s": 100.0},
        {"mode": "dynamic", "concurrency": 8, "tokens_per_s": 500.0},
        {"mode": "continuous", "concurrency": 8, "tokens_per_s": 1250.0},
        {"mode": "continuous", "concurrency": 1, "tokens_per_s": 90.0},
        {"mode": "dynamic", "concurrency": 32, "error": "RuntimeError: boom"},
    ]
    assert gpu_measure.ratios(runs) == {1: {}, 8: {"dynamic/unbatched": 5.0, "continuous/dynamic": 2.5}, 32: {}}


def test_the_checks_pass_on_an_fp32_model(worker) -> None:
    """The same functions the GPU run calls, on the tiny model in fp32 on CPU (1-4 tile images): rows that
    joined a running one and a seeded sampled row beside them equal their single runs."""
    comparison = gpu_measure.batched_vs_single(worker, tokens=12)
    assert comparison.equal, comparison
    assert set(comparison.first_diff) == set(comparison.sampled_first_diff) == {"dynamic", "continuous"}
    assert all(len(rows) == len(gpu_measure.CASES) for rows in comparison.first_diff.values())
    joins = comparison.joins
    assert joins["first_row_tokens_when_others_joined"] < joins["first_row_tokens"], "nobody joined mid-flight"
    # the first row's prefill, then the joiners' together: one forward pass per tile count (1-4 tile pictures)
    assert joins["tile_counts_joining"] >= 2 and joins["prefills"] == 1 + joins["tile_counts_joining"], joins
    assert joins["max_batch_size"] == len(gpu_measure.CASES) + 1, joins
    step = gpu_measure.step_vs_stock(worker)
    assert step["same_argmax"] and step["max_abs_logit_diff"] < 1e-4 and step["decode_attention"] == "reference"


def test_loading_a_saved_model_goes_through_the_servers_loading_path(worker) -> None:
    loaded = gpu_measure.load_saved(worker, "cpu")
    assert loaded["same_answer"] and loaded["devices"] == ["cpu"]


def test_a_dry_run_on_cpu_goes_through_every_stage(tiny_dir, tmp_path, monkeypatch) -> None:
    """``--device cpu --model tiny``: the script end to end (versions, checks, memory plan, benchmark at
    two levels, the peak run, report, JSON) minus the GPU-only stages, so a GPU run does not die of a typo."""
    monkeypatch.setenv("VLM_TINY_DIR", tiny_dir)
    out = tmp_path / "gpucheck.json"
    argv = ["--device", "cpu", "--model", "tiny", "--levels", "1,3", "--requests", "3", "--json", str(out)]
    assert gpucheck.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["memory_plan"]["max_batch_size"] == 8
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["transformers"] == PINNED_TRANSFORMERS
    assert all(d is None for rows in report["first_diff"].values() for d in rows)  # fp32: equal
    assert set(report["sampled_first_diff"].values()) == {None}
    assert report["step_vs_stock"]["same_argmax"] and report["batch1_tokens_per_s"] > 0
    # the kernel stages first, right after the model; the engine's last
    order = list(report["stage_s"])
    kernel_stages = ["kernel: decode attention", "kernel: weight-only linear", "decode attention: auto",
                     "decode step: triton", "decode step: reference", "decode at batch 1"]  # fmt: skip
    engine_stages = ["batched vs single", "written-out step vs stock", "benchmark", "join/evict peak"]
    assert order == ["build model", "memory plan", *kernel_stages, *engine_stages], order
    assert report["stages"] == list(gpucheck.STAGES) and report["engine_budget_s"] <= report["budget_s"]
    runs = report["runs"]
    assert [(r["mode"], r["concurrency"]) for r in runs] == [  # at concurrency 1 dynamic is unbatched: once
        ("unbatched", 1),
        ("continuous", 1),
        ("unbatched", 3),
        ("dynamic", 3),
        ("continuous", 3),
    ]
    assert all(r["errors"] == 0 and r["requests"] == 3 and r["tokens_per_s"] > 0 for r in runs)
    assert set(report["ratios"]["3"]) == {"dynamic/unbatched", "continuous/dynamic"}
    peak = report["peak_run"]  # the planned row limit (8 on CPU) filled, rows joining and leaving
    assert peak["planned_rows"] == peak["max_batch_size"] == peak["requests"] == 8 and peak["errors"] == 0
    gpu_only = {"bandwidth", "decode step: flash", "narrow fp32", "weight formats", "prefill"}
    assert peak["shrunk"] is None and set(report["skipped"]) == gpu_only
    assert report["skipped"]["weight formats"].startswith("needs a CUDA GPU")
    assert report["skipped"]["decode step: flash"] == "needs CUDA"
    # the attention op alone: the reference at 1 and 3 rows, 1- and 4-tile pictures; Triton under its interpreter
    # (conftest sets TRITON_INTERPRET=1) at one row and one tile, against the reference
    op = report["attention_op"]
    assert (
        op["geometry"]["rows"] == [1, 3]
        and op["geometry"]["tiles"] == [1, 4]
        and op["kernels"]["flash"] == {"skipped": "needs CUDA"}
    )
    reference, triton = op["kernels"]["reference"]["rows"], op["kernels"]["triton"]["rows"]
    assert set(reference) == {"1", "3"} and set(reference["3"]) == {"self", "cross_1_tiles", "cross_4_tiles"}
    assert reference["3"]["cross_4_tiles"]["bytes"] == 4 * reference["3"]["cross_1_tiles"]["bytes"]
    assert set(triton) == {"1"} and set(triton["1"]) == {"self", "cross_1_tiles"}
    assert all(0 <= entry["max_error"] < 1e-5 and entry["us"] > 0 for entry in triton["1"].values())
    assert {entry["timed"] for rows in (reference, triton) for part in rows.values() for entry in part.values()} == {
        "cpu"
    }
    # the weight-only op alone: every format on the four projections, every tile tier, the Triton kernel too
    weights = report["weights_op"]
    assert list(weights["shapes"]) == ["qkv", "o", "gate_up", "down"] and weights["formats_skipped"] == {}
    for name, shape in weights["shapes"].items():
        assert list(shape["rows"]) == [str(m) for m in gpu_kernels.CPU_WEIGHT_ROWS]
        for entries in shape["rows"].values():
            assert list(entries) == ["float32", "int8", "fp8", "int4"]
            assert all(
                e["rel_error"] < 1e-5 and e["bytes"] < entries["float32"]["bytes"] for e in list(entries.values())[1:]
            )
            assert all(("triton_rel_error" in e) == (name == "o") for e in list(entries.values())[1:])
    assert weights["shapes"]["o"]["rows"]["128"]["int4"]["triton_rel_error"] < 1e-5
    # the decode step per kernel: the reference, and Triton under its interpreter
    attention = report["decode_attention"]
    assert set(attention) == {"flash", "triton", "reference"} and attention["flash"]["skipped"] == "needs CUDA"
    for name in ("triton", "reference"):
        assert attention[name]["decode_attention"] == name and attention[name]["nan_steps"] == 0
        assert set(attention[name]["rows"]) == {"1", "2"} and attention[name]["rows"]["2"]["eager_step_ms"] > 0
        assert attention[name]["attention_kernels"], name  # the profiler saw its attention operators
        times = attention[name]["kernel_times"]  # name -> µs, calls (on a CPU: the operators' own time)
        assert times and all(t["us"] > 0 and t["calls"] >= 1 for t in times.values())
    triton_ops = {"vlm_demo::paged_decode_attention", "vlm_demo::paged_decode_attention_split"}
    assert triton_ops & set(attention["triton"]["kernel_times"]), attention["triton"]["kernel_times"]
    assert attention["triton"]["probe"]["nan_steps"] == 0 and attention["triton"]["probe"]["steps"] == 2
    assert report["decode_attention_auto"]["kernel"] == "reference"  # a CPU: no failure
    assert report["decode_attention_auto"]["passed_over"][0] == "flash: needs CUDA"
    assert report["budget_s"] == gpucheck.BUDGET_S and report["deadline_s"] == gpucheck.DEADLINE_S <= 420


def test_stages_picks_stage_groups_by_name_for_a_rerun(tiny_dir, tmp_path, monkeypatch) -> None:
    """``--stages attention,linear``: the model is built and planned, then only those groups run (in their own
    order, whatever the order given); an unknown name stops the parser."""
    monkeypatch.setenv("VLM_TINY_DIR", tiny_dir)
    out = tmp_path / "gpucheck.json"
    argv = ["--device", "cpu", "--model", "tiny", "--stages", "linear,attention", "--json", str(out)]
    assert gpucheck.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["stages"] == ["attention", "linear"] and report["failed"] == [] and report["skipped"] == {}
    assert list(report["stage_s"]) == ["build model", "memory plan", "kernel: decode attention",
                                       "kernel: weight-only linear"]  # fmt: skip
    assert "runs" not in report and "decode_attention" not in report and "engine_budget_s" not in report
    assert gpucheck.chosen_stages("all") == tuple(gpucheck.STAGES)
    assert gpucheck.chosen_stages(" peak, checks") == ("checks", "peak")
    for wrong in ("", "kernels", "checks,nope"):
        with pytest.raises(ValueError, match="choose from all, bandwidth, attention"):
            gpucheck.chosen_stages(wrong)
    with pytest.raises(SystemExit):
        gpucheck.main(["--device", "cpu", "--model", "tiny", "--stages", "nope"])


def test_the_engine_stages_keep_within_their_share_of_the_budget() -> None:
    clock = gpucheck.Clock(budget_s=300.0)
    clock.started -= 200.0  # the kernel stages took 200 s: 100 s are left
    assert 99 < clock.share(0.4 * 300).left() <= 100  # the share is more than what is left
    clock.started += 150.0  # they took 50 s: 250 s left, the share is 120
    share = clock.share(120.0)
    assert 119 < share.left() <= 120 and share.started == clock.started


def test_each_weight_format_is_measured_alike(worker) -> None:
    """What the GPU run records per weight format (bf16, fp8, int8), here on the tiny model on CPU: its bytes,
    decode at batch 1 and at 32 rows, and its greedy tokens against the unquantized model's."""
    base = gpu_measure.format_figures(worker)
    assert base["weights"] == "fp32" and base["errors"] == 0 and base["rows"] == 32
    assert base["batch1_tokens_per_s"] > 0 and base["rows_tokens_per_s"] > 0 and len(base["greedy"]) == 2
    int8 = gpu_measure.quantized_figures("tiny", torch.device("cpu"), None, "int8", base["greedy"])
    assert int8["weights"] == "int8" and int8["weight_bytes"] < 0.7 * base["weight_bytes"]
    assert int8["decode_weight_bytes"] < base["decode_weight_bytes"] and int8["errors"] == 0
    assert int8["first_diff_vs_bf16"] == [None, None]  # the trained tiny model keeps its greedy tokens
    assert int8["kernel_vs_torch"] < 1e-6  # on a CPU both are torch's product (on CUDA: the Triton kernel)


def test_a_run_out_of_budget_skips_what_does_not_fit_and_says_why(tiny_dir, tmp_path, monkeypatch) -> None:
    """``--budget-s 0``: the model is still built and planned (required), every optional stage, benchmark
    run and the peak run are recorded as skipped with why, and that is no failure."""
    monkeypatch.setenv("VLM_TINY_DIR", tiny_dir)
    out = tmp_path / "gpucheck.json"
    argv = ["--device", "cpu", "--model", "tiny", "--levels", "1,3", "--budget-s", "0", "--json", str(out)]
    assert gpucheck.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["budget_s"] == 0 and report["memory_plan"]["max_batch_size"] == 8
    skipped = report["skipped"]
    budget = {"batched vs single", "written-out step vs stock", "decode at batch 1", "join/evict peak"}
    gpu_only = {"bandwidth", "decode step: flash", "narrow fp32", "weight formats", "prefill"}
    assert set(skipped) == budget | gpu_only  # GPU figures: not on CPU, whatever the budget
    assert all(skipped[name].startswith("time budget: ") for name in budget), skipped
    assert [(r["mode"], r["concurrency"]) for r in report["runs"]] == [
        ("unbatched", 1),
        ("continuous", 1),
        ("unbatched", 3),
        ("dynamic", 3),
        ("continuous", 3),
    ]
    assert all(r["skipped"].startswith("time budget: ") for r in report["runs"]), report["runs"]
    assert "peak_run" not in report and "build model" in report["stage_s"]


def test_a_stage_starts_only_with_the_time_it_needs_left(tmp_path) -> None:
    report = gpucheck.Report(str(tmp_path / "r.json"))
    stages = gpucheck.Stages(report, gpucheck.Clock(budget_s=30.0))
    assert stages.run("fits", lambda: "ran", need_s=20.0) == "ran"
    assert stages.run("too long", lambda: "ran", need_s=45.0) is None
    assert stages.run("required", lambda: "ran") == "ran"  # no need_s: runs whatever is left
    assert list(report["skipped"]) == ["too long"] and report["skipped"]["too long"].startswith("time budget: needs")
    assert json.loads((tmp_path / "r.json").read_text())["skipped"] == report["skipped"]  # written at once


def test_on_a_gpu_without_fp8_the_weight_format_stage_skips_fp8_with_the_loaders_reason(tmp_path, monkeypatch) -> None:
    """The stage's choices on an A10G (a faked compute capability and memory: fault injection, this box has no
    GPU); the measurements themselves are the CPU-tested functions above, recorded here instead of run."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * 10**9, 80 * 10**9))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    measured = []
    monkeypatch.setattr(
        gpu_measure, "format_figures", lambda worker, ref: measured.append("bf16") or figures(90, 900, 18.6)
    )
    monkeypatch.setattr(
        gpu_measure, "quantized_figures", lambda *args: measured.append(args[3]) or figures(95, 950, 10)
    )
    report = gpucheck.Report(str(tmp_path / "r.json"))
    report.update(gpu="NVIDIA A10G", weight_bytes=21.3e9)
    stages = gpucheck.Stages(report, gpucheck.Clock(budget_s=300.0))
    worker = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16)
    gpucheck.weight_formats(stages, worker, None, "full")
    assert measured == ["bf16", "int8", "int4"] and set(report["weight_formats"]) == {"bf16", "int8", "int4"}
    assert "compute capability 8.6" in report["skipped"]["weights: fp8"] and report["failed"] == []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * 10**9, 80 * 10**9))
    gpucheck.weight_formats(stages, worker, None, "full")  # no room for a second bf16 copy: skipped, not failed
    assert "rebuilt in bf16" in report["skipped"]["weights: int8"] and report["failed"] == []


def figures(batch1: float, rows: float, read_gb: float, kernel: float = 0.0) -> dict:
    return {"batch1_tokens_per_s": batch1, "rows_tokens_per_s": rows, "rows": 32, "decode_weight_bytes": read_gb * 1e9,
            "errors": 0, "greedy": [[1]], "kernel_vs_torch": kernel}  # fmt: skip


def test_a_format_that_reads_fewer_bytes_but_decodes_slower_than_bf16_fails_the_check(tmp_path, monkeypatch) -> None:
    """The stage's verdict on an H200 (faked, as above): int8 reads half the bytes and is faster at batch 1 but
    slower at 32 rows — flagged; fp8 is faster at both — fine; a format reading no fewer bytes is not judged; a
    packed kernel that differs from torch's product fails too."""
    assert gpu_measure.slower_than_bf16({"bf16": figures(140, 3000, 18.6), "fp8": figures(230, 3600, 10.0)}) == []
    slower = gpu_measure.slower_than_bf16({"bf16": figures(140, 3000, 18.6), "int8": figures(200, 2500, 10.0),
                                           "int4": None, "odd": figures(100, 100, 19.0)})  # fmt: skip
    assert slower == ["int8 decodes slower than bf16 at 32 rows (2500.0 against 3000.0 tokens/s) though its step "
                      "reads 10.0 GB of weights against 18.6"]  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 10**9, 140 * 10**9))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gpu_measure, "format_figures", lambda worker, ref: figures(140, 3000, 18.6))
    measured = {"fp8": figures(230, 3600, 10.0), "int8": figures(120, 3100, 10.0), "int4": figures(300, 3900, 5.9, 0.3)}
    monkeypatch.setattr(gpu_measure, "quantized_figures", lambda *args: measured[args[3]])
    report = gpucheck.Report(str(tmp_path / "r.json"))
    report.update(gpu="NVIDIA H200", weight_bytes=21.3e9)
    stages = gpucheck.Stages(report, gpucheck.Clock(budget_s=300.0))
    gpucheck.weight_formats(stages, SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16), None,
                            "full")  # fmt: skip
    assert set(report["weight_formats"]) == {"bf16", "fp8", "int8", "int4"}
    assert report["failed"][0] == "weights: int4: the packed kernel differs from torch's product by 0.3"
    assert report["failed"][1:] == report["weight_formats_slower"] and len(report["failed"]) == 2
    assert report["failed"][1].startswith("int8 decodes slower than bf16 at batch 1 (120.0 against 140.0")


def test_benchmark_runs_that_would_end_past_the_budget_are_skipped() -> None:
    """Estimated at the rate of batch-1 decode (the first run of a mode) or of the mode's last level."""
    runs: list[dict] = []
    # 1 token/s: every run needs far more than the 30 s left, so none starts (the worker is never touched)
    gpu_measure.benchmark(None, (1, 4), lambda level: 4, lambda: 30.0, runs.append, rate_floor=1.0)  # type: ignore[arg-type]
    assert [(r["mode"], r["concurrency"]) for r in runs] == [
        ("unbatched", 1),
        ("continuous", 1),
        ("unbatched", 4),
        ("dynamic", 4),
        ("continuous", 4),
    ]
    assert all(r["skipped"].startswith("time budget: needs ~") and r["skipped"].endswith("30 s left") for r in runs)


def test_the_peak_run_shrinks_to_the_rows_that_fit_the_time_left() -> None:
    # answers of 32-96 tokens, log-uniform: 58.3 tokens a row on average
    assert gpu_measure.peak_rows_that_fit(210, 120.0, 5000.0) == 210  # ~2.5 s of answers: all of them
    assert gpu_measure.peak_rows_that_fit(210, 15.0, 500.0) == 85  # 10 s past the overhead x 500 tok/s
    assert gpu_measure.peak_rows_that_fit(210, 4.0, 5000.0) == 0  # not even the run's overhead fits


def test_a_first_row_that_never_writes_fails_the_join_check_instead_of_hanging(worker, monkeypatch) -> None:
    stuck = SimpleNamespace(token_ids=[7], done=False)
    started = time.monotonic()
    assert not gpu_measure._wait_for_tokens(stuck, 2, timeout=0.2)
    assert time.monotonic() - started < 2
    assert gpu_measure._wait_for_tokens(SimpleNamespace(token_ids=[7], done=True), 2, timeout=0.2)
    monkeypatch.setattr(gpu_measure, "_wait_for_tokens", lambda handle, count, timeout: False)
    comparison = gpu_measure.batched_vs_single(worker, tokens=4)
    assert comparison.errors == ["continuous: the first row wrote no 2 tokens in 60 s"]
    assert not comparison.equal and set(comparison.first_diff) == {"dynamic"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    done = run_check(timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_narrow_dry_run_compares_each_engine_with_its_own_single_runs(tmp_path) -> None:
    """``--device cpu --model narrow`` (the real structure at narrow widths, fp32) exits 0: the dynamic engine's
    seeded sampled row is compared with the dynamic engine's own single run (it was compared with the continuous
    engine's, which runs another path — the real tiles against the stock forward over every tile — and differed from
    token 10). The kernel stages run before the checks; Triton is left out (no interpreter: its narrow steps take
    a minute)."""
    out = tmp_path / "gpucheck.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--device", "cpu", "--model", "narrow", "--stages", "attention,linear,checks", "--json", str(out)]
    done = run_check(*args, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == [] and set(report["sampled_first_diff"].values()) == {None}
    assert all(d is None for rows in report["first_diff"].values() for d in rows)
    assert list(report["stage_s"]) == ["build model", "memory plan", "kernel: decode attention",
                                       "kernel: weight-only linear", "batched vs single", "written-out step vs stock"]  # fmt: skip
    assert report["attention_op"]["geometry"]["heads"] == 32 and report["attention_op"]["geometry"]["kv_heads"] == 8
    assert "set TRITON_INTERPRET=1" in report["attention_op"]["kernels"]["triton"]["skipped"]


@pytest.mark.slow
def test_a_run_stopped_part_way_has_already_written_its_report(tmp_path) -> None:
    """A device time-out kills the process: what was measured until then is on disk."""
    out = tmp_path / "gpucheck.json"
    cmd = [sys.executable, "-m", "vlm_demo.gpucheck", "--device", "cpu", "--model", "narrow", "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        built = lambda: out.exists() and "build model" in json.loads(out.read_text()).get("stage_s", {})  # noqa: E731
        wait_until(built, 120, every=0.2, fail=False)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["transformers"]
    assert report["parameters"] > 0 and "build model" in report["stage_s"]


@pytest.mark.slow
def test_the_watchdog_writes_the_report_and_stops_before_the_device_limit(tiny_dir, tmp_path) -> None:
    out = tmp_path / "gpucheck.json"
    args = ["--device", "cpu", "--model", "narrow", "--budget-s", "6", "--deadline-s", "6", "--json", str(out)]
    started = time.monotonic()
    done = run_check(*args, env=dict(os.environ, VLM_TINY_DIR=tiny_dir), timeout=120)
    assert done.returncode == gpucheck.WATCHDOG_EXIT, done.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert "watchdog" in done.stderr and "Thread" in done.stderr  # every thread's traceback, for a hang
    report = json.loads(out.read_text())
    assert any(f.startswith("watchdog: stopped after 6 s") for f in report["failed"]), report["failed"]


def test_prepare_counts_the_wheels_and_the_working_tree_against_the_64_mib_that_travel(tmp_path) -> None:
    wheels = [tmp_path / "a.whl", tmp_path / "b.whl"]
    for wheel, size in zip(wheels, (12 * 2**20, 8 * 2**20), strict=True):
        wheel.write_bytes(b"\0" * size)
    line, fits = device.travel_summary([str(w) for w in wheels], tree=2 * 2**20)
    assert fits and line.startswith("2 wheels (20.0 MiB) in .device/wheels + the working tree (2.0 MiB) = 22.0 MiB")
    assert line.endswith("of the 64 MiB that travel; carry exactly ['.device/wheels']")
    assert not device.travel_summary([str(w) for w in wheels], tree=45 * 2**20)[1]
    assert 0 < device.tree_bytes() < device.TRAVEL_CAP  # git's tracked and untracked-not-ignored files


def test_the_working_tree_that_travels_leaves_out_what_git_ignores(tmp_path) -> None:
    """A virtual environment in the clone (the README makes ``.venv`` there) is ignored by git and so does not
    travel; a file git would pick up does."""
    quiet = {"cwd": tmp_path, "check": True, "stdout": subprocess.DEVNULL}
    subprocess.run(["git", "init", "-q"], **quiet)
    (tmp_path / ".gitignore").write_text("/.venv/\n")
    (tmp_path / "tracked.py").write_bytes(b"x" * 1000)
    subprocess.run(["git", "add", "-A"], **quiet)
    (tmp_path / "new.py").write_bytes(b"y" * 500)  # untracked, not ignored: it travels
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "big.so").write_bytes(b"\0" * 2**20)
    assert device.tree_bytes(str(tmp_path)) == len("/.venv/\n") + 1000 + 500


def _download(spec: str, folder: Path, python: str | None = None) -> list[str]:
    """Real wheels from the package registry (skips when the registry cannot be reached)."""
    try:
        return device.prepare(str(folder), python or f"{sys.version_info.major}.{sys.version_info.minor}", [spec])
    except subprocess.CalledProcessError as err:
        pytest.skip(f"the package registry is not reachable: {err}")


# Loaded by the check's interpreter at start-up (``sitecustomize``): its package metadata reports
# transformers 5.17.0, as on the device's image, and at exit it lists which modules were imported.
FAKE_TRANSFORMERS = textwrap.dedent(
    """
    import atexit, importlib.metadata, os, sys

    _version = importlib.metadata.version
    importlib.metadata.version = lambda name: "5.17.0" if name == "transformers" else _version(name)

    @atexit.register
    def _imported():
        with open(os.environ["IMPORTED_LIST"], "w") as fh:
            fh.write("\\n".join(sorted(sys.modules)))
    """
)


def test_a_transformers_other_than_the_pin_stops_the_check_in_one_line_before_torch(tmp_path) -> None:
    """Offline: the check's interpreter reads another transformers version from the package metadata (a
    ``sitecustomize`` on its path, nothing installed). One line names both versions and the fix; exit 2,
    in well under 10 s, with neither torch nor transformers imported (so nothing was built)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAKE_TRANSFORMERS)
    out, imported = tmp_path / "gpucheck.json", tmp_path / "imported.txt"
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, IMPORTED_LIST=str(imported))
    started = time.monotonic()
    done = run_check("--device", "cpu", "--model", "narrow", "--json", str(out), env=env, timeout=60)
    assert time.monotonic() - started < 10
    assert done.returncode == 2
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert f"needs transformers=={PINNED_TRANSFORMERS}" in lines[0] and "finds transformers 5.17.0" in lines[0]
    assert "python -m vlm_demo.tools.device gpucheck" in lines[0]  # the fix
    modules = set(imported.read_text().split())
    assert "vlm_demo.tools.gpucheck" in modules and not {"torch", "transformers"} & modules
    report = json.loads(out.read_text())
    assert report["versions"]["transformers"] == "5.17.0" and report["failed"] == [lines[0]]
    assert "stage_s" not in report and "parameters" not in report


@pytest.mark.slow
def test_another_transformers_stops_the_check_in_one_line_before_building(tmp_path) -> None:
    """The same with transformers 5.17 really installed (from the package registry; skipped without one):
    the device's image has it, and under it the continuous engine cannot run."""
    _download("transformers==5.17.0", tmp_path)
    site = device.install(str(tmp_path))
    out = tmp_path / "gpucheck.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(ROOT)]))
    started = time.monotonic()
    done = run_check("--device", "cpu", "--model", "narrow", "--json", str(out), env=env, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"transformers=={PINNED_TRANSFORMERS}" in lines[0] and "5.17.0" in lines[0]
    assert time.monotonic() - started < 30  # nothing was built
    report = json.loads(out.read_text())
    assert report["versions"]["transformers"] == "5.17.0" and report["failed"] == [lines[0]]


@pytest.mark.slow
def test_the_device_runner_installs_the_carried_wheels_and_runs_the_check(tiny_dir, tmp_path) -> None:
    """``prepare`` here (for this Python), then ``gpucheck`` as on the device: our copies first on the path,
    the report and the log in the output folder."""
    files = _download(f"transformers=={PINNED_TRANSFORMERS}", tmp_path / "carry")
    assert [Path(f).name.split("-")[0] for f in files] == ["transformers"]
    assert "torchao==" + gpucheck.pinned_versions()["torchao"] in device.wanted_wheels()  # --quantize travels too
    out = tmp_path / "out"
    argv = ["--dir", str(tmp_path / "carry"), "gpucheck", "--out", str(out), "--deadline-s", "240"]
    argv += ["--", "--device", "cpu", "--model", "tiny", "--levels", "2", "--requests", "2"]
    env = dict(os.environ, VLM_TINY_DIR=tiny_dir)
    done = subprocess.run([sys.executable, "-m", "vlm_demo.tools.device", *argv], cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0
    report = json.loads((out / "gpucheck.json").read_text())
    assert report["failed"] == [] and [r["mode"] for r in report["runs"]] == ["unbatched", "dynamic", "continuous"]
    assert report["versions"]["transformers_from"] == str(tmp_path / "carry" / "site" / "transformers")
    assert "device: gpucheck exited 0" not in (out / "gpucheck.log").read_text()  # the log is gpucheck's own


def test_the_prefill_stage_skips_on_a_cpu_and_its_figures_are_measured(tmp_path, worker) -> None:
    """The stage needs CUDA (skipped here, saying why); what it runs on a GPU runs here on the tiny model."""
    report = gpucheck.Report(str(tmp_path / "r.json"))
    stages = gpucheck.Stages(report, gpucheck.Clock(budget_s=300.0))
    gpucheck.prefill(stages, worker)
    assert "CUDA" in report["skipped"]["prefill"] and "prefill_stall" not in report
    towers = gpu_measure.tower_seconds(worker, repeats=1)
    assert set(towers) == {"1_tiles_real", "2_tiles_real", "3_tiles_real", "4_tiles_real", "1_tiles_all"}
    assert all(seconds > 0 for seconds in towers.values()) and worker.vision_tiles == "real"
    stall = gpu_measure.prefill_stall(worker, rows=2, newcomers=2)
    before, after = stall["before: at once, every tile"], stall["after: paced, real tiles"]
    assert before["admission_steps"] == 1 and before["vision_tiles"] == 2 * 4 + 2 * 4  # everything at once
    assert after["admission_steps"] >= 2 and after["vision_tiles"] == 2 * 1 + 2 * 4  # paced; real tiles only
    assert after["longest_decode_pause_s"] > 0 and after["median_decode_step_s"] > 0


def op_entry(us: float, nbytes: int, error: float = 1e-3) -> dict:
    return {"us": us, "bytes": nbytes, "gb_s": nbytes / us / 1e3, "rel_error": error}


def test_a_packed_format_slower_than_bf16_where_it_reads_fewer_bytes_fails() -> None:
    """The weight-only op's verdict on an H100 (made-up figures): int8 at 256 rows is slower than bf16 though it reads
    half the bytes — flagged, once, naming the shape, rows and both times; int4 is faster everywhere — fine; a
    format that reads no fewer bytes is not judged."""
    figures = {"dtype": "bfloat16", "shapes": {"o": {"rows": {
        "1": {"bfloat16": op_entry(14.0, 33_554_432), "int8": op_entry(8.0, 16_793_600), "int4": op_entry(5.0, 8_650_752)},
        "256": {"bfloat16": op_entry(20.0, 33_554_432), "int8": op_entry(26.5, 16_793_600), "int4": op_entry(19.0, 8_650_752),
                "odd": op_entry(30.0, 40_000_000)},
    }}}}  # fmt: skip
    assert gpu_kernels.packed_slower(figures) == [
        "weight-only int8 is slower than bfloat16 on o at 256 rows (26.5 against 20.0 µs) though it reads 16.8 MB "
        "against 33.6"
    ]
    assert gpu_kernels.packed_slower({"dtype": "bfloat16", "shapes": {}}) == []


def test_an_op_that_differs_from_its_reference_fails() -> None:
    """The attention kernels against the reference (absolute, the probe's tolerance: 2e-2 in bf16), the weight-only
    op against the exact product (relative, 2e-2), the Triton kernel under the interpreter likewise; NaN fails too."""
    attention = {"kernels": {
        "reference": {"rows": {"1": {"self": {"us": 5.0}}}},
        "triton": {"rows": {"1": {"self": {"max_error": 0.004}, "cross_4_tiles": {"max_error": 0.5}},
                            "8": {"self": {"max_error": float("nan")}}}},
        "flash": {"skipped": "torch 2.11.0 has no paged call"},
        "odd": {"rows": {}, "failure": "RuntimeError: boom"},
    }}  # fmt: skip
    weights = {"shapes": {"down": {"rows": {"16": {
        "bfloat16": op_entry(10.0, 100), "int4": op_entry(5.0, 30, error=0.03),
        "int8": {**op_entry(5.0, 50), "triton_rel_error": 0.5},
    }}}}}  # fmt: skip
    problems = gpu_kernels.op_errors(attention, weights, torch.bfloat16)
    assert problems == [
        "decode attention triton at 1 rows (cross_4_tiles) differs from the reference by 0.5 (more than 0.02)",
        "decode attention triton at 8 rows (self) differs from the reference by nan (more than 0.02)",
        "decode attention odd failed: RuntimeError: boom",
        "weight-only int4 on down at 16 rows: rel_error 0.03 (more than 0.02)",
        "weight-only int8 on down at 16 rows: triton_rel_error 0.5 (more than 0.02)",
    ]
    assert gpu_kernels.op_errors(None, None, torch.float32) == []


def test_a_decode_step_without_graphs_on_cuda_fails() -> None:
    """On CUDA a block-table kernel that captured no graph fails, and so do replayed logits that differ from the
    eager step's; the reference (no graphs) and a CPU are not judged on graphs; NaN steps fail anywhere."""
    fine = {"decode_attention": "triton", "captured": 12, "nan_steps": 0, "steps": 44,
            "rows": {"1": {"graphs_vs_eager": 0.0}, "128": {"graphs_vs_eager": 0.004}}}  # fmt: skip
    assert gpu_kernels.graphs_problems(fine, cuda=True, graphable=True) == []
    none = {**fine, "captured": 0, "rows": {"1": {}, "128": {}}}
    assert gpu_kernels.graphs_problems(none, cuda=True, graphable=True) == ["CUDA captured no decode graph"]
    assert gpu_kernels.graphs_problems(none, cuda=False, graphable=True) == []
    assert gpu_kernels.graphs_problems({**none, "decode_attention": "reference"}, cuda=True, graphable=False) == []
    off = {**fine, "nan_steps": 3, "rows": {"128": {"graphs_vs_eager": 0.25}}}
    assert gpu_kernels.graphs_problems(off, cuda=True, graphable=True) == [
        "3 of 44 decode steps gave NaN logits",
        "logits replayed from the graph at 128 rows differ from the eager step's by 0.25 of their largest (more "
        "than 0.02)",
    ]


def test_batch_1_decode_below_40_percent_of_the_measured_bound_fails() -> None:
    """The bound: measured copy bandwidth ÷ the bytes a step reads (18.6 GB at 2.9 TB/s: ~156 tokens/s on an H100)."""
    bound = gpu_measure.bandwidth_bound(18.6e9, 2.9e12)
    assert 155 < bound < 157
    assert gpu_kernels.below_bound(70.0, bound) is None  # 45 %
    assert gpu_kernels.below_bound(55.0, bound) == (
        "decode at batch 1 reaches 55.0 tokens/s, 35% of the 155.9 tokens/s its bytes allow at the measured "
        "bandwidth (at least 40% expected)"
    )
    assert gpu_kernels.below_bound(None, bound) is None and gpu_kernels.below_bound(55.0, None) is None


def test_the_gpu_stages_fail_the_check_on_cuda_only(tmp_path, monkeypatch) -> None:
    """The decisions wired into their stages (the measurements faked: this box has no GPU): on a CUDA worker a
    slower packed format and a batch-1 decode under 40 % of the bound fail the check; on a CPU worker neither is
    judged (CPU timings say nothing about a GPU)."""
    slow = {"dtype": "bfloat16", "shapes": {"o": {"rows": {"1": {"bfloat16": op_entry(14.0, 100), "int8": op_entry(20.0, 50)}}}}}  # fmt: skip
    monkeypatch.setattr(gpu_kernels, "weights_op", lambda *args, **kwargs: slow)
    monkeypatch.setattr(gpu_measure, "batch1_decode", lambda worker: 40.0)
    for kind, failures in (("cuda", 2), ("cpu", 0)):
        report = gpucheck.Report(str(tmp_path / "r.json"))
        report["batch1_bound_measured"] = 156.0
        stages = gpucheck.Stages(report, gpucheck.Clock(budget_s=300.0))
        worker = SimpleNamespace(
            device=SimpleNamespace(type=kind), dtype=torch.bfloat16, model=SimpleNamespace(config=None)
        )
        gpucheck.weights_op(stages, worker)
        gpucheck.batch1(stages, worker)
        assert len(report["failed"]) == failures, report["failed"]
        assert report["weights_op"] == slow and report["batch1_over_bound"] == 40.0 / 156.0
    assert report["failed"] == []


def test_the_kernel_stages_on_cuda_record_their_figures_and_fail_what_they_should(tmp_path, monkeypatch) -> None:
    """The kernel stages' wiring on an H100 (every measurement faked: this box has no GPU): bandwidth first, the
    ops alone, the decode step per kernel — Triton captured no graph: failed; the reference is not judged on
    graphs —, batch-1 decode under 40 % of the measured bound: failed; each figure lands in the JSON."""
    from vlm_demo.engine.executor import attention, decode_step
    from vlm_demo.engine.executor.attention import TritonAttention

    monkeypatch.setattr(gpu_kernels, "measure_bandwidth", lambda device: 2.8e12)
    monkeypatch.setattr(
        gpu_kernels,
        "attention_op",
        lambda *args: {"kernels": {"triton": {"rows": {"1": {"self": {"max_error": 0.001}}}}}},
    )
    monkeypatch.setattr(gpu_kernels, "weights_op", lambda *args: {"dtype": "bfloat16", "shapes": {}})
    monkeypatch.setattr(decode_step, "attention_geometry", lambda model, dtype: (None, 32, torch.device("cuda")))
    monkeypatch.setattr(attention, "decide", lambda *args: (TritonAttention, ["flash: torch 2.11.0 has no paged call"]))
    monkeypatch.setattr(attention, "check", lambda name, *args, **kwargs: (
        ("torch 2.11.0 has no paged call", None) if name == "flash" else (None, None)))  # fmt: skip
    figures = {"triton": {"decode_attention": "triton", "captured": 0, "nan_steps": 0, "steps": 22, "rows": {}},
               "reference": {"decode_attention": "reference", "captured": 0, "nan_steps": 0, "steps": 22, "rows": {}}}  # fmt: skip
    monkeypatch.setattr(gpu_measure, "attention_figures", lambda worker, name, *args: figures[name])
    monkeypatch.setattr(gpu_measure, "batch1_decode", lambda worker: 50.0)
    report = gpucheck.Report(str(tmp_path / "r.json"))
    report.update(gpu="NVIDIA H100 80GB HBM3", decode_reads={"total_at_256_tokens": 18.6e9})
    stages = gpucheck.Stages(report, gpucheck.Clock(budget_s=300.0))
    worker = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, model=SimpleNamespace(config=None))
    gpucheck.bandwidth(stages, worker)
    gpucheck.attention_op(stages, worker)
    gpucheck.weights_op(stages, worker)
    gpucheck.decode_attention(stages, worker)
    gpucheck.batch1(stages, worker)
    assert list(report["stage_s"]) == ["bandwidth", "kernel: decode attention", "kernel: weight-only linear",
                                       "decode attention: auto", "decode step: triton", "decode step: reference",
                                       "decode at batch 1"]  # fmt: skip
    assert report["bandwidth_measured"] == 2.8e12 and 150 < report["batch1_bound_measured"] < 151
    assert report["skipped"] == {"decode step: flash": "torch 2.11.0 has no paged call"}
    assert report["decode_graphs"] is figures["triton"] and report["decode_attention_auto"]["kernel"] == "triton"
    assert report["failed"] == [
        "decode step: triton: CUDA captured no decode graph",
        "decode at batch 1 reaches 50.0 tokens/s, 33% of the 150.5 tokens/s its bytes allow at the measured "
        "bandwidth (at least 40% expected)",
    ]
    assert json.loads((tmp_path / "r.json").read_text())["failed"] == report["failed"]  # written as it goes
