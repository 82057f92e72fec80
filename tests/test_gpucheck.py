"""The device check's CPU-runnable parts: its arithmetic, its checks and benchmark on the tiny model,
and a clear exit without CUDA. (On a GPU it builds the full 11B architecture; see docs/BENCHMARKS.md.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from vlm_demo.engine.placement import weight_bytes
from vlm_demo.models import realshape
from vlm_demo.tools import gpucheck


def test_bandwidth_bound_for_the_11b_model() -> None:
    weights = weight_bytes(realshape.full_config(), torch.bfloat16)
    assert gpucheck.spec_bandwidth("NVIDIA H200") == 4.8e12
    assert gpucheck.spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpucheck.spec_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpucheck.spec_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert gpucheck.spec_bandwidth("Some Future GPU") is None
    # 21.3 GB of weights read once per step: ~225 tokens/s on an H200, ~157 on an H100 SXM, ~28 on an A10.
    assert 220 < gpucheck.bandwidth_bound(weights, 4.8e12) < 230
    assert 150 < gpucheck.bandwidth_bound(weights, 3.35e12) < 160
    assert 27 < gpucheck.bandwidth_bound(weights, 0.6e12) < 29


def test_ratios_per_concurrency_level() -> None:
    runs = [
        {"mode": "unbatched", "concurrency": 8, "tokens_per_s": 100.0},
        {"mode": "dynamic", "concurrency": 8, "tokens_per_s": 500.0},
        {"mode": "continuous", "concurrency": 8, "tokens_per_s": 1250.0},
        {"mode": "continuous", "concurrency": 1, "tokens_per_s": 90.0},
    ]
    assert gpucheck.ratios(runs) == {1: {}, 8: {"dynamic/unbatched": 5.0, "continuous/dynamic": 2.5}}


def test_the_checks_pass_on_an_fp32_model(worker) -> None:
    """The same functions the GPU run calls, on the tiny model in fp32 on CPU (1-4 tile images)."""
    comparison = gpucheck.batched_vs_single(worker, tokens=12)
    assert comparison.equal, comparison.first_diff
    assert set(comparison.first_diff) == {"dynamic", "continuous"}
    assert all(len(rows) == len(gpucheck.CASES) for rows in comparison.first_diff.values())
    step = gpucheck.step_vs_stock(worker)
    assert step == {"max_abs_logit_diff": 0.0, "same_argmax": True, "written_out_step": True}


def test_a_dry_run_on_cpu_goes_through_every_stage(tiny_dir, tmp_path, monkeypatch) -> None:
    """``--device cpu --model tiny``: the script end to end (checks, memory plan, benchmark at two
    levels, report, JSON) minus the GPU-only stages, so a GPU run does not die of a typo."""
    monkeypatch.setenv("VLM_TINY_DIR", tiny_dir)
    out = tmp_path / "gpucheck.json"
    argv = ["--device", "cpu", "--model", "tiny", "--levels", "1,3", "--requests", "3", "--json", str(out)]
    assert gpucheck.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["memory_plan"]["max_batch_size"] == 8
    assert all(d is None for rows in report["first_diff"].values() for d in rows)  # fp32: equal
    assert report["step_vs_stock"]["same_argmax"] and report["batch1_tokens_per_s"] > 0
    runs = report["runs"]
    assert [(r["mode"], r["concurrency"]) for r in runs] == [
        (mode, level) for level in (1, 3) for mode in ("unbatched", "dynamic", "continuous")
    ]
    assert all(r["errors"] == 0 and r["requests"] == 3 and r["tokens_per_s"] > 0 for r in runs)
    assert set(report["ratios"]["3"]) == {"dynamic/unbatched", "continuous/dynamic"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vlm_demo.tools.gpucheck"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr
