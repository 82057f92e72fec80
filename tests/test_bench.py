"""The benchmark's through-the-app path: real servers, real clients, answers checked (figures are not asserted)."""

from __future__ import annotations

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
