"""The decode step through static buffers, as CUDA graphs replay it: run eagerly on the CPU (only capture and
replay are CUDA's), rows padded to a graph's bucket with inert rows, every per-step value changing."""

from __future__ import annotations

import logging

import pytest
import torch
from support import checked, door, join_running

from vlm_demo.config import Config
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.batching.rows import RunningRows
from vlm_demo.engine.executor.attention.tiled import SplitPlan, TritonAttention
from vlm_demo.engine.executor.decode_step import TextDecodeStep
from vlm_demo.engine.executor.graphs import DecodeGraphs, bucket_for, buckets, decode_graphs
from vlm_demo.errors import ModelLoadError
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.request import SamplingParams

JOBS = [
    (solid_image("red", 300, 80), "What colour is this image? Describe it in detail."),
    (solid_image("green", 16, 16), "Colour?"),
    (solid_image("blue", 500, 500), "Describe it"),
    (solid_image("white", 90, 700), "what color"),
]


def test_buckets_are_nano_vllms() -> None:
    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8]
    assert bucket_for(3, buckets(40)) == 4 and bucket_for(33, buckets(40)) == 40 and bucket_for(41, buckets(40)) is None


def join(worker, rows: RunningRows, jobs) -> None:
    requests = []
    for image, question in jobs:
        request = Request(
            image=image, question=question, params=checked(SamplingParams(max_new_tokens=50, temperature=0))
        )
        request.inputs = worker.prepare(image, question)
        requests.append(request)
    join_running(worker, rows, requests)


@pytest.mark.parametrize(
    ("kernel", "dense"),
    [("reference", True), ("reference", False), ("triton", False)],
    ids=["reference-one-masked-product", "reference-block-by-block", "triton-block-tables"],
)
def test_padded_static_steps_give_each_row_its_unpadded_logits(worker, kernel, dense, monkeypatch) -> None:
    """Two running batches of the same rows: one stepped plainly, one through the static buffers, padded to its
    bucket (inert rows in the null pages). Positions, lengths (past page boundaries), rows leaving and joining
    change between steps; every real row gets the same logits and the same token. With the Triton kernel
    (interpreted) the static buffers hold its block tables and its splits' parts, as a CUDA graph replays them;
    the plain batch is then the reference kernel's (an interpreted step costs a second of Python)."""
    monkeypatch.setattr("vlm_demo.engine.executor.attention.reference.DENSE_ROWS", 16 if dense else 0)
    monkeypatch.setattr(
        "vlm_demo.engine.executor.attention.reference.DENSE_PADDING", float("inf")
    )  # the product whatever the padding
    monkeypatch.setitem(TritonAttention.PLANS, "cpu", SplitPlan(64, 1, 1, 2))  # rows past 64 keys: two splits
    plain_kernel = "reference" if kernel == "triton" else kernel
    plain_step = TextDecodeStep.over_pool(worker.model, worker.dtype, pages=400, kernel=plain_kernel)
    padded_step = TextDecodeStep.over_pool(worker.model, worker.dtype, pages=400, kernel=kernel)
    plain = RunningRows(plain_step.pool, plain_step.attention, worker.device, worker.dtype)
    padded = RunningRows(padded_step.pool, padded_step.attention, worker.device, worker.dtype)
    graphs = DecodeGraphs(
        padded_step, max_rows=8, text_width=16, image_width=4, device=worker.device, dtype=worker.dtype
    )
    for rows in (plain, padded):
        join(worker, rows, JOBS[:3])
    null = padded_step.pool.null_pages()
    for n in range(40):
        if n == 10:  # a row leaves: the batch shrinks within its bucket
            plain.keep([0, 2])
            padded.keep([0, 2])
        if n == 20:  # one joins: past the bucket of 2
            join(worker, plain, JOBS[3:])
            join(worker, padded, JOBS[3:])
        real = len(plain)
        bucket = bucket_for(real, graphs.sizes)
        with torch.inference_mode():
            want = plain_step(plain.step_inputs())
            inputs = padded.step_inputs(pad_to=bucket)
            assert inputs.layout.rows == bucket and inputs.input_ids.shape[0] == bucket
            got = graphs(inputs)
        assert got.shape[0] == bucket
        assert torch.allclose(got[:real], want, atol=1e-5, rtol=1e-5), f"step {n}"
        assert torch.equal(got[:real].argmax(-1), want.argmax(-1)), f"step {n}"
        tokens = want.argmax(-1)
        plain.advance(tokens)
        padded.advance(tokens)
    assert graphs.eager_steps == 40 and graphs.replays == 0  # CPU: the same step, run eagerly
    # The inert rows wrote only into the null pages: no real row's page was touched (checked above) and the
    # null pages were never handed to a row.
    assert all(p not in null for r in padded.rows for p in r.place.pages + r.place.image_pages)


def test_the_engine_pads_to_buckets_and_answers_exactly_as_unpadded(worker, monkeypatch) -> None:
    """The whole engine with every step padded to its bucket (as on a GPU with graphs): greedy and sampled rows
    side by side, the stage structure forcing tags, rows joining and leaving all the time — the same tokens as
    the engine that does not pad."""
    jobs = [
        door(solid_image(colour, 40 + 37 * i, 30 + 23 * i), question, params)
        for i, (colour, question, params) in enumerate(
            [
                (c, q, p)
                for c in COLOURS
                for q, p in (
                    ("What colour is this image?", SamplingParams(200, 0.0)),
                    ("Describe this picture in detail.", SamplingParams(120, 1.1, 0.9, seed=4)),
                )
            ]
        )
    ]

    def answers(pad: bool) -> list[list[int]]:
        engine = ContinuousEngine(worker, Config(batching="continuous", max_batch_size=5, batch_window_ms=0.0))
        if pad:
            monkeypatch.setattr(engine.graphs, "pad_to", lambda rows: bucket_for(rows, engine.graphs.sizes))
        engine.start()
        try:
            handles = [engine.submit(job) for job in jobs]
            for handle in handles:
                handle.result(timeout=120)
            return [h.token_ids for h in handles]
        finally:
            engine.shutdown()

    plain, padded = answers(pad=False), answers(pad=True)
    assert padded == plain


def test_cuda_graphs_on_without_cuda_is_refused_clearly_and_auto_says_why_they_are_off(worker, caplog) -> None:
    step = TextDecodeStep.over_pool(worker.model, worker.dtype, pages=64)
    with pytest.raises(ModelLoadError, match=r"--cuda-graphs on needs CUDA \(this engine runs on cpu\)"):
        decode_graphs(step, 4, Config(cuda_graphs="on"), worker)
    with caplog.at_level(logging.INFO, logger="vlm_demo.engine.executor.graphs"):
        assert not decode_graphs(step, 4, Config(cuda_graphs="auto"), worker).captured  # auto: eager on the CPU
        decode_graphs(step, 4, Config(cuda_graphs="off"), worker)
    assert "decode step: no CUDA graphs: replaying it needs CUDA (this engine runs on cpu)" in caplog.text
    assert "decode step: no CUDA graphs (--cuda-graphs off)" in caplog.text
