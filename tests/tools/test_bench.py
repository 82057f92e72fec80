"""The benchmark's through-the-app path: real servers, real clients, answers checked (figures are not asserted)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from vlm_demo.tools import bench


@pytest.mark.slow
def test_through_app_runs_every_mode_side_by_side_and_checks_answers(tiny_dir, tmp_path) -> None:
    out = tmp_path / "runs.json"
    results = bench.main(
        [
            "--through-app",
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--modes",
            "engine,app-ask,app-sse,app-openai,static",
            "--json",
            str(out),
        ]
    )
    by_mode = {r.mode: r for r in results}
    assert set(by_mode) == {"engine", "app-ask", "app-sse", "app-openai", "static"}
    for result in results:
        assert result.requests == 6 and result.errors == 0 and result.wrong == 0, result
        assert result.throughput_rps > 0
    assert "web" in by_mode["app-ask"].cpu_ms_per_request and "engine" in by_mode["app-ask"].cpu_ms_per_request
    assert "web" in by_mode["app-sse"].cpu_ms_per_request and "web" in by_mode["app-openai"].cpu_ms_per_request
    assert [r["mode"] for r in json.loads(out.read_text())] == ["engine", "app-ask", "app-sse", "app-openai", "static"]


def test_the_output_reads_as_sentences_and_the_plot_is_where_it_says_with_whole_client_counts(
    tiny_dir, tmp_path, capsys, caplog
) -> None:
    picture = tmp_path / "bench.png"
    args = [
        "--modes",
        "dynamic",
        "--concurrency",
        "1,3",
        "--requests",
        "3",
        "--max-new-tokens",
        "8",
        "--plot",
        str(picture),
    ]
    with caplog.at_level("INFO", logger="vlm_demo.tools.bench"):
        results = bench.main(args)
    out = capsys.readouterr().out
    assert f"plot saved to {picture}" in out and picture.stat().st_size > 0
    assert "RunResult(" not in out + caplog.text
    assert "dynamic · 3 clients · " in caplog.text
    figure = bench.plot(results, str(tmp_path / "again.png"), bench.describe_run(bench.build_parser().parse_args(args)))
    for axes in figure.axes:
        ticks = [t for t in axes.get_xticks() if axes.get_xlim()[0] <= t <= axes.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    title = figure.texts[0].get_text()
    assert "tiny on auto" in title and "max 8 new tokens" in title and "median of 1" in title, title


def test_mixed_workload_checks_the_colour_in_the_conclusion() -> None:
    items, colours = bench.mixed_workload(12)
    assert [i.question for i in items[:2]] == list(bench.MIX_QUESTIONS)
    assert len(set(colours)) == 6 and len({i.image.size for i in items}) >= 2
    check = bench.names_colour(colours)
    assert check(0, f"<SUMMARY>x</SUMMARY><CONCLUSION> The image is {colours[0]}. </CONCLUSION>")
    assert not check(0, f"<CONCLUSION> The image is {colours[1]}. </CONCLUSION>")
    assert not check(0, f"The image is {colours[0]}.")  # no CONCLUSION, not right


def test_stage_beam_bench_runs_batched_and_serial_on_the_same_seeds(tiny_dir, tmp_path) -> None:
    from vlm_demo.tools import bench_beam

    out = tmp_path / "beam.json"
    runs = bench_beam.main(["--beams", "1,2", "--answers", "3", "--json", str(out)])
    by = {(r.mode, r.beams): r for r in runs}
    assert set(by) == {("normal", 1), ("batched", 1), ("serial", 1), ("batched", 2), ("serial", 2)}
    assert all(r.answers == 3 and r.s_per_answer > 0 for r in runs)
    # the same seeds: serial runs the same search, so the same answers and judge calls
    assert by[("batched", 2)].judge_calls == by[("serial", 2)].judge_calls
    assert by[("batched", 2)].tokens == by[("serial", 2)].tokens
    assert by[("batched", 1)].vs_k1 == 1.0 and all(r.vs_k1 > 0 for r in runs)  # costs over K=1, pair by pair
    assert len(json.loads(out.read_text())) == 5


@pytest.mark.slow
def test_page_load_streams_to_more_visitors_at_once_than_gradios_default_40(tiny_dir) -> None:
    """48 light visitors upload and ask at once through the page's own event, as browsers do: all of them
    stream at the same time (Gradio runs 40 events at once unless told otherwise, so before the page set its
    limit, 8 waited for a free slot), every answer arrives, and the report holds what the bench prints."""
    from support import free_port, start_app, stop_app, wait_ready

    from vlm_demo.tools.benchmarks import page_load

    port = free_port()
    proc = start_app(port, "--max-batch-size", "48", "--response-cache-mb", "0", "--max-per-client", "0")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        result = asyncio.run(page_load.run_visitors(url, proc.pid, 48, max_new_tokens=300))
    finally:
        log = stop_app(proc)
    assert "Traceback" not in log.split("Shutting down")[0], log[-3000:]
    assert result.errors == 0 and result.health_errors == 0, result.error_examples
    assert result.peak_running > 40, f"at most {result.peak_running} answers ran at once"
    assert result.updates >= 2 * 48 and result.cpu_ms_per_update > 0 and result.ttft_p50_s > 0
    assert result.health_p95_s > 0 and 0 <= result.idle_cpu_pct < 100
    assert set(dataclasses.asdict(result)) >= {"cpu_ms_per_update", "gap_p95_s", "worst_visitor_gap_p95_s"}


def test_kv_closeness_compares_the_fp8_cache_with_the_models_dtype_step_by_step(worker) -> None:
    """``bench --kv-closeness``'s parts at a small width: the teacher-forced logits differ a little and not at all
    in shape, the fp8 pool takes fewer bytes a token, and the tiny model's held-out answers are counted per cache."""
    from vlm_demo.tools.benchmarks import kv_closeness

    logits = kv_closeness.logit_closeness(steps=2, rows=2, hidden=256)
    assert logits["steps"] == 2 and logits["rows"] == 2
    for figures in (*logits["against_exact_cache"].values(), logits["fp8_against_bf16"]):
        assert 0 < figures["mean_abs_logit_difference"] <= figures["max_abs_logit_difference"] < float("inf")
        assert 0 <= figures["argmax_agreement"] <= 1 and figures["mean_kl_divergence"] >= 0
    bf16, fp8 = logits["against_exact_cache"]["bf16"], logits["against_exact_cache"]["fp8"]
    assert bf16["mean_abs_logit_difference"] < fp8["mean_abs_logit_difference"], "8 bits round more than 16"
    assert logits["pool_bytes_per_token"]["fp8"] < logits["pool_bytes_per_token"]["bf16"]
    answers = kv_closeness.tiny_answers(worker, 2)
    assert answers["auto"] == answers["fp8"] == {"four_staged": 2, "right_colour": 2}
    assert answers["fp8_same_text_as_auto"] == 2
