"""The Triton paged decode attention, run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest): against the reference on random pages, batched == single exactly, the engine and the app answering as
with the reference, the choice of kernel and its refusals."""

from __future__ import annotations

import base64
import io
import logging
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch
from support import ROOT, door, free_port, metric, running_app, server_env

from vlm_demo.config import Config
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.executor.attention import VERSIONS, StepRows, choose, decide, probe
from vlm_demo.engine.executor.attention.probe import _Place
from vlm_demo.engine.executor.attention.reference import ReferenceAttention
from vlm_demo.engine.executor.attention.tiled import SplitPlan, TritonAttention
from vlm_demo.engine.executor.staging import Staging
from vlm_demo.engine.kv.pages import PagePool, PageShape
from vlm_demo.errors import ModelLoadError
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import SamplingParams

# Blocks of 16 keys, splits of at least 2 text blocks or 1 image block, up to 5 a row: most rows take several splits
SMALL_SPLITS = SplitPlan(16, 2, 1, 5)


def shape_of(dtype: torch.dtype) -> PageShape:
    """Pages of 16 text tokens; image pages of 40 tokens, so a tile (17 patches) crosses pages; 8 query heads over
    2 key/value heads (GQA, 4 per group); a head dim that is no power of two."""
    return PageShape(16, 40, (0,), (1,), kv_heads=2, head_dim=24, patches=17, max_tiles=4, dtype=dtype)


@pytest.mark.parametrize("splits", [None, SMALL_SPLITS], ids=["one-split", "splits-merged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_triton_kernel_matches_the_reference_on_random_pages(dtype, splits, monkeypatch) -> None:
    """The probe's random steps (1-6 rows, 1-64 tokens across page boundaries, 1-4 tiles, pages scattered over the
    pool), self- and cross-attention, each kernel through its own inputs."""
    if splits:
        monkeypatch.setitem(TritonAttention.PLANS, "cpu", splits)
    result = probe(TritonAttention, shape_of(dtype), 8, torch.device("cpu"), steps=4, seed=3)
    assert result.failure == "" and result.steps == 4 and result.nan_steps == 0
    assert result.max_error <= (2e-6 if dtype == torch.float32 else 2e-2), result.max_error
    assert result.max_error > 0 or dtype == torch.float32  # bf16 outputs are rounded: the two differ a little


class _Wrong(ReferenceAttention):
    """A kernel with its scale off by 10%: what a probe must catch."""

    name = "wrong"

    def __init__(self, pool, heads, scale) -> None:
        super().__init__(pool, heads, scale * 1.1)


class _SometimesNaN(ReferenceAttention):
    """A kernel that gives NaN on every third cross-attention call (the fault a one-call probe would miss)."""

    name = "flaky"
    calls = 0

    def cross_attention(self, layer, query, layout):
        out = super().cross_attention(layer, query, layout)
        _SometimesNaN.calls += 1
        return out * float("nan") if _SometimesNaN.calls % 3 == 0 else out


def test_the_probe_catches_a_kernel_that_differs_or_gives_nan_now_and_then() -> None:
    shape = shape_of(torch.float32)
    wrong = probe(_Wrong, shape, 8, torch.device("cpu"), steps=3)
    assert not wrong.passed(1e-4) and wrong.max_error > 1e-3 and "differs from the reference" in wrong.why(1e-4)
    flaky = probe(_SometimesNaN, shape, 8, torch.device("cpu"), steps=9)
    assert flaky.nan_steps == 3 and flaky.why(1e-4) == "gave NaN on 3 of 9 probe steps on random pages"
    fine = probe(ReferenceAttention, shape, 8, torch.device("cpu"), steps=3)
    assert fine.passed(0.0) and fine.why(0.0) == ""


def _attend(kernel: TritonAttention, places: list[_Place], query: torch.Tensor, staging: Staging) -> torch.Tensor:
    lengths = np.asarray([p.length for p in places], dtype=np.int64)
    _, layout = kernel.prepare(StepRows(places, len(places), lengths, next(VERSIONS), staging), [])
    return torch.cat([kernel.self_attention(0, query, layout), kernel.cross_attention(1, query, layout)], dim=-1)


@pytest.mark.parametrize("splits", [None, SMALL_SPLITS], ids=["one-split", "splits-merged"])
def test_a_rows_result_does_not_depend_on_the_other_rows_in_fp32(splits, monkeypatch) -> None:
    """Each row alone, and beside rows much longer than it (more splits, wider tables): the same bits."""
    if splits:
        monkeypatch.setitem(TritonAttention.PLANS, "cpu", splits)
    pool = PagePool(shape_of(torch.float32), 64, {0: torch.device("cpu"), 1: torch.device("cpu")})
    pool.buffers["cpu"].normal_(generator=torch.Generator().manual_seed(0))
    kernel, staging = TritonAttention(pool, 8, 24**-0.5), Staging(torch.device("cpu"))
    places = [_Place([3], 4, [10], 1), _Place([5, 6, 7, 8], 60, [11, 12, 13, 14], 3), _Place([9, 2], 16, [20, 21], 2)]
    query = torch.randn(len(places), 8, 24, generator=torch.Generator().manual_seed(1))
    together = _attend(kernel, places, query, staging)
    for r, place in enumerate(places):
        assert torch.equal(_attend(kernel, [place], query[r : r + 1], staging)[0], together[r]), r


@pytest.mark.parametrize("slots", [8, 2], ids=["one-picture-row", "picture-rows-of-two"])
@pytest.mark.parametrize("splits", [None, SMALL_SPLITS], ids=["one-split", "splits-merged"])
def test_rows_showing_one_picture_read_it_once_and_get_their_own_answers(slots, splits, monkeypatch) -> None:
    """Five rows, three of them on one picture's pages (the page table shares them), one on another picture, one
    alone: cross-attention over picture rows (the cascade) gives each row the reference's result, and the step counts
    each picture once per picture row it read."""
    if splits:
        monkeypatch.setitem(TritonAttention.PLANS, "cpu", splits)
    monkeypatch.setattr(TritonAttention, "cascade_slots", slots)
    shape = shape_of(torch.float32)
    pool = PagePool(shape, 64, {0: torch.device("cpu"), 1: torch.device("cpu")})
    pool.buffers["cpu"].normal_(generator=torch.Generator().manual_seed(0))
    staging = Staging(torch.device("cpu"))
    shared, other = [11, 12, 13], [20, 21]
    places = [_Place([3], 4, shared, 3), _Place([5, 6], 20, other, 2), _Place([7], 9, shared, 3),
              _Place([8], 1, [30], 1), _Place([9, 10], 31, shared, 3)]  # fmt: skip
    query = torch.randn(len(places), 8, 24, generator=torch.Generator().manual_seed(1))
    kernel, reference = TritonAttention(pool, 8, 24**-0.5), ReferenceAttention(pool, 8, 24**-0.5)
    lengths = np.asarray([p.length for p in places], dtype=np.int64)
    _, layout = kernel.prepare(StepRows(places, len(places), lengths, next(VERSIONS), staging), [])
    got = kernel.cross_attention(1, query, layout)
    _, ref_layout = reference.prepare(StepRows(places, len(places), lengths, next(VERSIONS), staging), [])
    want = reference.cross_attention(1, query, ref_layout)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    picture_rows = 3 if slots == 8 else 4  # the shared picture's three rows in one picture row, or in two
    tiles = {8: 3 + 2 + 1, 2: 3 + 2 + 3 + 1}[slots]
    assert layout.read[1] == tiles * shape.patches, "each picture read once per picture row"
    assert int((layout.picture_lengths > 0).sum()) == picture_rows
    monkeypatch.setattr(TritonAttention, "cascade_slots", 0)
    _, per_row = kernel.prepare(StepRows(places, len(places), lengths, next(VERSIONS), staging), [])
    assert per_row.read[1] == (3 * 3 + 2 + 1) * shape.patches and per_row.slots == 0
    torch.testing.assert_close(kernel.cross_attention(1, query, per_row), want, atol=2e-6, rtol=2e-6)


JOBS = [
    (solid_image("red", 300, 80), "What colour is this image?"),  # two tiles
    (solid_image("blue", 500, 500), "Describe it"),  # four tiles
    (solid_image("yellow", 16, 16), "Colour?"),  # one tile
    (solid_image("white", 90, 700), "what color"),
]


def test_the_engine_answers_token_for_token_as_with_the_reference(worker, monkeypatch) -> None:
    """The tiny model in fp32, greedy, four rows of 1-4 tiles decoding together: the same answers; each row's text
    and picture keys in two splits and their merge once past 64 (the CPU's own plan is one split: the app test)."""
    monkeypatch.setitem(TritonAttention.PLANS, "cpu", SplitPlan(64, 1, 1, 2))
    answers = {}
    for kernel in ("reference", "triton"):
        engine = ContinuousEngine(worker, Config(batching="continuous", max_batch_size=4, batch_window_ms=0.0,
                                                 decode_attention=kernel))  # fmt: skip
        engine.start()
        try:
            results = engine.run_batch([door(*job, SamplingParams(48, 0.0)) for job in JOBS])
            assert engine.stats().decode_attention == kernel
        finally:
            engine.shutdown()
        answers[kernel] = [r.text for r in results]
        assert max(r.batch_size for r in results) > 1
    assert answers["triton"] == answers["reference"]


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_app_with_triton_answers_as_the_reference_engine(worker) -> None:
    """``python app.py --decode-attention triton`` (interpreted): /health names the kernel, and held-out pictures
    asked together get the reference engine's greedy answers."""
    pictures = [(solid_image("green", 700, 90, noise=4, seed=2), "Which colour is it?"),
                (solid_image("black", 256, 256), "Tell me the colour")]  # fmt: skip
    engine = ContinuousEngine(worker, Config(batching="continuous", max_batch_size=4, batch_window_ms=0.0,
                                             decode_attention="reference"))  # fmt: skip
    engine.start()
    try:
        expected = [r.text for r in engine.run_batch([door(*job, SamplingParams(400, 0.0)) for job in pictures])]
    finally:
        engine.shutdown()
    with running_app("--decode-attention", "triton", "--response-cache-mb", "0") as url:
        health = requests.get(url + "/health", timeout=10).json()
        assert health["details"]["decode_attention"] == "triton", health
        assert metric(url, 'vlm_decode_attention_info{kernel="triton"}') == 1

        def ask(job) -> str:
            image, question = job
            content = [
                {"type": "text", "text": question},
                {"type": "image_url", "image_url": {"url": _data_url(image)}},
            ]
            body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0,
                    "max_tokens": 400}  # fmt: skip
            reply = requests.post(url + "/v1/chat/completions", json=body, timeout=300).json()
            message = reply["choices"][0]["message"]
            return message["reasoning_content"], message["content"]

        with ThreadPoolExecutor(len(pictures)) as pool:
            got = list(pool.map(ask, pictures))
    for (reasoning, content), text in zip(got, expected, strict=True):
        assert content and content in text and reasoning.split("<SUMMARY>")[-1].split("</SUMMARY>")[0] in text


def test_a_cpu_without_the_interpreter_refuses_triton_at_start_and_auto_says_why(monkeypatch, caplog) -> None:
    shape = shape_of(torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ModelLoadError, match="--decode-attention triton: on cpu it runs only under Triton's "
                                             "interpreter: set TRITON_INTERPRET=1"):  # fmt: skip
        choose(shape, 8, "cpu", "triton")
    with pytest.raises(ModelLoadError, match="--decode-attention flash: needs CUDA"):
        choose(shape, 8, "cpu", "flash")
    with caplog.at_level(logging.INFO, logger="vlm_demo.engine.executor.attention"):
        kind, passed_over = decide(shape, 8, "cpu", "auto")
    assert kind is ReferenceAttention and passed_over[0] == "flash: needs CUDA"
    assert passed_over[1].startswith("triton: on cpu it runs only under Triton's interpreter")
    assert "decode attention: reference (flash: needs CUDA; triton: " in caplog.text
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose(shape, 8, "cpu", "triton") is TritonAttention  # asked for, interpreted: it runs (probe passed)
    assert decide(shape, 8, "cpu", "auto")[0] is ReferenceAttention  # auto never picks the interpreter


def test_the_app_stops_at_start_when_a_cpu_is_asked_for_triton_without_the_interpreter() -> None:
    env = {k: v for k, v in server_env().items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "app.py", "--model", "tiny", "--decode-attention", "triton", "--port", str(free_port())]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("Cannot start the model: --decode-attention triton: on cpu it runs only under Triton's interpreter: set "
            "TRITON_INTERPRET=1") in done.stdout + done.stderr  # fmt: skip
    assert "Traceback" not in done.stdout + done.stderr
