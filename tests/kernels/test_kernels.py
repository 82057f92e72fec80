"""``bench --count-kernels``: the decode step's operations at the real 11B structure, and a second count by
torch's profiler that does not share the counter's code."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from vlm_demo.engine.executor.decode_step import TextDecodeStep
from vlm_demo.tools.benchmarks import kernel_count as kernels

# Operations whose output aliases their input (no kernel of their own), by name: the profiler's view of what
# the counter decides from each operation's schema.
ALIASING = {"view", "slice", "transpose", "reshape", "chunk", "unsqueeze", "to", "t", "permute", "expand", "select",
            "as_strided", "detach", "alias", "split", "squeeze", "narrow", "_reshape_alias", "unflatten"}  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return kernels.narrow_model("cpu")


@pytest.fixture(scope="module")
def report() -> dict:
    return kernels.report()


@pytest.fixture(scope="module")
def quantized() -> dict[str, dict]:
    """``bench --count-kernels --quantize KIND``'s report per 8-bit format."""
    return {kind: kernels.report(kind) for kind in ("fp8", "int8")}


def test_the_step_launches_at_most_800_kernels_at_one_and_eight_rows(report) -> None:
    for step in (report, report["cpu"]):
        assert set(step["kernels_per_decode_step"]) == {"1", "8"}
        assert all(0 < n <= 800 for n in step["kernels_per_decode_step"].values()), step["kernels_per_decode_step"]
    assert report["stock_forward"]["kernels_per_decode_step"]["1"] > 2 * report["kernels_per_decode_step"]["1"]
    by_op = report["by_op"]  # the kernel auto takes on CUDA with this torch: one attention call per layer, 40 layers
    if report["decode_attention"] == "flash":
        assert by_op["_flash_attention_forward"] == 40
    else:  # a torch without the paged flash call (2.11): Triton's, split and merged over a tile's 1601 states
        assert report["decode_attention"] == "triton" and "flash" in report["unavailable"]
        assert by_op["paged_decode_attention"] + by_op["paged_decode_attention_split"] == 40
        assert by_op["merge_decode_splits"] == by_op["paged_decode_attention_split"] == 8
    assert by_op["rms_norm"] == 89  # 2 per layer, a query norm per cross layer, the final one


def test_every_decode_attention_is_counted_and_triton_stays_within_450(report) -> None:
    by_kernel = report["by_decode_attention"]
    assert set(by_kernel) == {"flash", "triton", "reference"}
    assert by_kernel[report["decode_attention"]] == report["kernels_per_decode_step"]
    assert set(by_kernel["triton"]) == {"1", "8"} and all(0 < n <= 450 for n in by_kernel["triton"].values())
    assert by_kernel["reference"] == report["cpu"]["kernels_per_decode_step"]
    flash = by_kernel["flash"]
    assert (flash is None) == ("flash" in report["unavailable"])
    if flash is not None:  # the Triton step is flash's, with its attention split in two where a tile is long, and
        # each cross layer's query heads placed in their picture rows and taken back (the cascade: two kernels)
        assert by_kernel["triton"]["1"] == flash["1"] + 8 + 2 * 8


@pytest.mark.parametrize("rows", [1, 8])
def test_torchs_profiler_counts_the_same_operations(model, rows) -> None:
    """The CPU step counted twice: by the dispatch-mode counter, and from the profiler's top-level operations
    (kernels: those that neither alias nor write in place, judged by name)."""
    decoder = TextDecodeStep.over_pool(model, torch.float32, 8 + rows * 80, kernel="reference")
    running = kernels.synthetic_rows(decoder, rows, torch.device("cpu"))
    with torch.inference_mode():
        inputs = running.step_inputs()
        decoder(inputs)  # the step before: the reference's lines are kept from here on
        with profile(activities=[ProfilerActivity.CPU]) as traced:
            decoder(inputs)
    top = []
    for event in traced.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and parent is None:
            top.append(event.name.removeprefix("aten::"))
    names = collections.Counter(top)
    launched = sum(n for name, n in names.items() if name not in ALIASING and not name.endswith("_"))
    counted = kernels.count(lambda: decoder(inputs))
    assert len(top) == counted.aten_ops
    assert launched == counted.kernels, names
    assert names["scaled_dot_product_attention"] == 40 and "index_select" not in names  # lines kept, no gather


def test_the_unquantized_step_reads_each_weight_once_in_bf16(report) -> None:
    """At the 11B shapes in bf16: the linear layers' weights a step multiplies by (the text projections but the
    cross-attention keys/values, and the LM head) are 18.4 GB, and the step's kernels read exactly those bytes."""
    assert report["quantize"] == "none" and 18.3e9 < report["weight_bytes"] < 18.4e9
    assert report["weight_bytes_read_per_step"] == {"1": report["weight_bytes"], "8": report["weight_bytes"]}


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_an_8_bit_step_launches_as_few_kernels_as_bf16s_and_reads_one_byte_per_weight(quantized, kind) -> None:
    """The issue's bar: at 1 and 8 rows at most 1.2× the unquantized step's kernels (it is 1.0×: one packed product
    where bf16 has a matrix product or an ``addmm``, q/k/v and gate/up merged) and the weights read once as stored
    (≤ 1.1× their bytes; they are 9.7 GB, LM head included, against bf16's 18.4)."""
    counted = quantized[kind]
    plain = counted["unquantized"]
    assert counted["quantize"] == kind and set(counted["kernels_per_decode_step"]) == {"1", "8"}
    for rows in ("1", "8"):
        assert counted["kernels_per_decode_step"][rows] <= 1.2 * plain["kernels_per_decode_step"][rows]
        assert counted["kernels_over_unquantized"][rows] <= 1.2
        assert counted["weight_bytes_read_per_step"][rows] <= 1.1 * counted["weight_bytes"]
    assert 9.6e9 < counted["weight_bytes"] < 9.8e9 and plain["weight_bytes"] > 1.8 * counted["weight_bytes"]
    by_op = counted["by_op"]  # 4 per self layer (q/k/v, output, gate/up, down), 4 per cross layer (query for q/k/v)
    assert by_op["weight_only_linear"] == 32 * 4 + 8 * 4 and "addmm" not in by_op


def test_int4_is_counted_alike_and_reads_its_half_byte_per_weight() -> None:
    """int4 (two codes a byte, a scale and a zero per 128 inputs): the unquantized step's kernels, and its weights'
    5.6 GB (LM head included) read once."""
    meta = kernels.narrow_model("meta", "int4")
    plain = kernels.narrow_model("meta")
    for rows in (1, 8):
        assert kernels.engine_step(meta, rows, "triton").kernels == kernels.engine_step(plain, rows, "triton").kernels
    weights = kernels.weight_figures("int4", "triton")
    assert 5.6e9 < weights["weight_bytes"] < 5.7e9
    assert weights["weight_bytes_read_per_step"] == {"1": weights["weight_bytes"], "8": weights["weight_bytes"]}


def test_the_counter_counts_a_per_call_widened_copy_as_weight_bytes_read() -> None:
    """What torchao's int8 weight-only path does (widen the weight, then multiply): the cast reads the int8 values (1
    byte each), the product reads the float32 copy made from them alone (4 more), so the bar above would fail it."""
    values = torch.randint(-128, 127, (64, 32), dtype=torch.int8)
    scale = torch.rand(64)
    x = torch.randn(3, 32)
    counted = kernels.count(lambda: torch.nn.functional.linear(x, values.to(torch.float32)) * scale, [values, scale])
    assert counted.weight_bytes_read == 64 * 32 * (1 + 4) + 64 * 4
    assert kernels.count(lambda: x @ x.t(), [values]).weight_bytes_read == 0


def test_attention_bytes_per_step_count_a_shared_picture_once_per_picture_row_and_fp8_at_half(report) -> None:
    """``attention_bytes_per_step``, from the engine's own Triton layout at the 11B shapes: a row's text (its new
    token included) and its 4-tile picture, distinct pictures per row; rows about one picture read it once per 8 rows; fp8 pages (with their
    scales) about half of bf16's."""
    from vlm_demo.engine.kv.pages import CUDA_PAGE_TOKENS, FP8, PageShape
    from vlm_demo.models import realshape

    figures = report["attention_bytes_per_step"]
    for label, kv in (("bf16", None), ("fp8", FP8)):
        shape = PageShape.of(realshape.full_config(), torch.bfloat16, CUDA_PAGE_TOKENS, kv)
        text, picture = (kernels.TEXT_TOKENS + 1) * shape.text_bytes_per_token, 4 * 1601 * shape.image_bytes_per_token
        for rows in kernels.ATTENTION_ROWS:
            assert figures[label]["distinct"][str(rows)] == rows * (text + picture), (label, rows)
            assert figures[label]["shared"][str(rows)] == rows * text + -(-rows // 8) * picture, (label, rows)
    assert 1.9 < figures["bf16"]["distinct"]["128"] / figures["fp8"]["distinct"]["128"] < 2.0
    assert (
        figures["bf16"]["distinct"]["1"] == 288_620_544
    )  # 601 × 128 KiB of text (the new token's too), 6,404 × 32 KiB
