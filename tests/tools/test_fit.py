"""``python -m vlm_demo.tools.fit``: the 11B model against a GPU's memory, per ``--quantize`` choice, by the
engine's own memory plan; the README's "Which GPU?" table is its output."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from support import ROOT

from vlm_demo.engine.kv.memory import MAX_AUTO_BATCH_SIZE
from vlm_demo.tools import fit
from vlm_demo.tools.gpu import cards as gpus

GiB = 1024**3


def test_24_gib_fits_the_11b_with_int8_and_not_in_bf16() -> None:
    """The issue's own check, through the command line."""
    done = subprocess.run(
        [sys.executable, "-m", "vlm_demo.tools.fit", "--gpu-memory", "24GiB", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    bf16, int8 = report["results"]["none"], report["results"]["int8"]
    assert not bf16["fits"] and bf16["rows"] == 0 and "not enough for even one answer" in bf16["why"]
    # rows: answers with four-tile pictures that fit at once; the engine's batch is sized for one-tile ones
    assert int8["fits"] and 10 <= int8["rows"] <= 20 and int8["rows"] <= int8["max_batch_size"], int8
    assert 11.8e9 < int8["weight_bytes"] < 11.9e9 and 21.3e9 < bf16["weight_bytes"] < 21.4e9
    assert report["results"]["int4"]["rows"] > int8["rows"]  # fewer bytes, more rows
    assert report["max_new_tokens"] == 2048 and report["gpu_memory_bytes"] == 24 * GiB


def test_the_rows_are_the_memory_plans_and_the_bound_is_bandwidth_over_bytes_read() -> None:
    """H200: bf16 leaves ~240 rows of 2k tokens with four-tile pictures (the plan caps the batch at 256, sized
    for one-tile ones); the batch-1 decode bound is
    4.8 TB/s over the ~18.6 GB a step reads (258 tokens/s), about 1.9x with 8-bit weights."""
    report = fit.spec_report(gpus.by_key("h200"))
    bf16, fp8 = report["results"]["none"], report["results"]["fp8"]
    assert 230 <= bf16["rows"] <= 250 and bf16["max_batch_size"] == MAX_AUTO_BATCH_SIZE
    assert 255 < bf16["batch1_bound_tokens_per_s"] < 261
    assert 1.8 < fp8["batch1_bound_tokens_per_s"] / bf16["batch1_bound_tokens_per_s"] < 1.95
    assert report["auto"] == "none"  # plenty of room: the most precise
    longer = fit.fit_report(gpus.by_key("h200").memory, ("none",), max_new_tokens=512)["results"]["none"]
    assert longer["rows"] > MAX_AUTO_BATCH_SIZE == longer["max_batch_size"]  # what fits vs what the server batches


def test_a_gpu_without_fp8_or_int4_kernels_says_so() -> None:
    a10g = fit.spec_report(gpus.by_key("A10G"))["results"]
    assert not a10g["fp8"]["runs"] and "compute capability 8.9" in a10g["fp8"]["why"]
    assert a10g["int8"]["fits"] and a10g["int4"]["fits"] and not a10g["none"]["fits"]
    t4 = fit.spec_report(gpus.by_key("t4"))
    assert not t4["results"]["int4"]["runs"] and not t4["results"]["int8"]["fits"] and t4["auto"] is None


def test_sizes_bandwidths_and_bad_input(capsys) -> None:
    assert fit.parse_size("24GiB") == 24 * GiB and fit.parse_size("24 GB") == 24 * 10**9
    assert fit.parse_size("23028MiB") == 23028 * 1024**2 and fit.parse_size("1000") == 1000
    assert fit.parse_bandwidth("600GB/s") == fit.parse_bandwidth("600") == 600e9
    assert fit.parse_bandwidth("3.35TB/s") == pytest.approx(3.35e12)
    for argv, said in [
        (["--gpu-memory", "lots"], "not a size"),
        ([], "--gpu-memory 24GiB"),
        (["--gpu", "voodoo"], "unknown GPU"),
        (["--gpu-memory", "24GiB", "--quantize", "int3"], "--quantize: choose from"),
        (["--gpu", "l4", "--compute-capability", "eight"], "MAJOR.MINOR"),
    ]:
        with pytest.raises(SystemExit):
            fit.main(argv)
        assert said in capsys.readouterr().err, argv
    assert gpus.by_device_name("NVIDIA A100-SXM4-40GB").key == "a100-40gb"  # not the A10
    assert gpus.by_device_name("NVIDIA L40S").key == "l40s" and gpus.by_device_name("NVIDIA GH200 480GB").key == "gh200"


def test_auto_in_words_and_only_the_asked_choices(capsys) -> None:
    assert fit.main(["--gpu", "l4", "--quantize", "auto"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("L4: 22.5 GiB, compute capability 8.9, 300 GB/s")
    assert re.search(r"^ +fp8: weights +11\.0 GiB \(11\.8 GB\), fits: \d+ rows; batch-1 decode at most \d+", said, re.M)
    assert "int8:" not in said and "--quantize auto loads fp8" in said


def test_why_a_choice_does_not_fit_reads_as_a_clause_about_the_card_asked_about(capsys) -> None:
    """Not a server's start-up error pasted in: no "GPU 0 (GPU)", no sentence ended in the middle of the line
    (".;"), no advice to run the tool being run."""
    for argv in (["--gpu", "a10g"], ["--gpu", "t4"], ["--gpu-memory", "24GiB", "--max-new-tokens", "200000"]):
        assert fit.main(argv) == 0
        said = capsys.readouterr().out
        assert "does not fit" in said, argv
        for words in ("GPU 0", "(GPU)", ".;", ". ;", "vlm_demo.tools.fit"):
            assert words not in said, (argv, words, said)


def test_the_readme_table_is_the_tools_output() -> None:
    """README.md holds the table between its markers exactly as ``--readme-table`` prints it (regenerate it
    with ``python -m vlm_demo.tools.fit --readme-table`` after changing the memory plan or the formats)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- fit-table:start -->\n(.*?)\n<!-- fit-table:end -->", text, re.S)
    assert match, "README.md has no <!-- fit-table:start --> … <!-- fit-table:end --> block"
    assert match.group(1) == fit.readme_table()


def test_the_bound_takes_the_packed_bytes_at_the_kernels_compiled_ceiling_where_it_is_below_the_memory() -> None:
    """On an H200 int4's compiled loop reads at most ~4.3 TB/s (``kernel_sass.PACKED_CEILINGS``, below its 4.8): the
    packed layers' bytes at that rate, the rest (LM head, keys/values) at the memory's; where the ceiling is above
    the memory (int8 there, every format on an H100) the bound is bandwidth over bytes, as before."""
    from vlm_demo.tools.benchmarks import kernel_sass

    h200 = fit.spec_report(gpus.by_key("h200"))["results"]
    int4, int8 = h200["int4"], h200["int8"]
    ceiling = kernel_sass.card_bandwidth("int4", 90, 132, 1.83, 4.8, 1) * 1e12
    assert int4["kernel_bytes_per_s"] == pytest.approx(ceiling) and ceiling < 4.8e12
    other = int4["decode_read_bytes"] - int4["packed_read_bytes"]
    expected = 1 / (other / 4.8e12 + int4["packed_read_bytes"] / ceiling)
    assert int4["batch1_bound_tokens_per_s"] == pytest.approx(expected)
    assert int4["batch1_bound_tokens_per_s"] < 4.8e12 / int4["decode_read_bytes"]
    assert 0 < int4["packed_read_bytes"] < int4["decode_read_bytes"] and h200["none"]["packed_read_bytes"] == 0
    assert int8["kernel_bytes_per_s"] is None
    assert int8["batch1_bound_tokens_per_s"] == pytest.approx(4.8e12 / int8["decode_read_bytes"])
    h100 = fit.spec_report(gpus.by_key("h100"))["results"]
    assert all(h100[k]["kernel_bytes_per_s"] is None for k in ("fp8", "int8", "int4"))


def test_an_fp8_cache_fits_about_twice_the_rows_and_says_so(capsys) -> None:
    """``--kv-cache-dtype fp8``: the same card holds more rows (each row's keys/values and picture states in 8 bits
    with their scales: 132 bytes where bf16 takes 256), and the report names the cache."""
    assert fit.main(["--gpu-memory", "80GiB", "--json", "--quantize", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert fit.main(["--gpu-memory", "80GiB", "--json", "--quantize", "none", "--kv-cache-dtype", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert (plain["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("auto", "fp8")
    rows, more = plain["results"]["none"]["rows"], fp8["results"]["none"]["rows"]
    assert 1.8 * rows <= more <= 2.0 * rows, (rows, more)
    assert fit.main(["--gpu-memory", "80GiB", "--kv-cache-dtype", "fp8"]) == 0
    assert "an fp8 key/value cache" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        fit.main(["--gpu-memory", "80GiB", "--kv-cache-dtype", "int4"])
