"""``bench --count-kernels``: the decode step's operations at the real 11B structure, and a second count by
torch's profiler that does not share the counter's code."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from vlm_demo.engine.decode_step import TextDecodeStep
from vlm_demo.tools import kernels

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
    if flash is not None:  # the Triton step is flash's, with its attention split in two where a tile is long
        assert by_kernel["triton"]["1"] == flash["1"] + 8


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
