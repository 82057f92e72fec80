"""Continuous batching on the real tiny Mllama: rows join mid-flight and still equal their single runs."""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
from support import Stepper, door

from vlm_demo.config import Config, load_config
from vlm_demo.engine import make_engine as build_engine
from vlm_demo.engine.batching.base import Engine as BaseEngine
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.kv.pages import PageShape, page_tokens_for
from vlm_demo.engine.weights.loader import load
from vlm_demo.errors import RequestCancelledError
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.request import SamplingParams
from vlm_demo.tools.bench import BatchCounter

GREEDY = SamplingParams(max_new_tokens=200, temperature=0.0)
LONG = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)


def conclusion(text: str) -> str:
    match = re.search(r"<CONCLUSION>(.*?)</CONCLUSION>", text, re.S)
    assert match, f"no CONCLUSION in {text!r}"
    return match.group(1)


@pytest.fixture
def make_engine(worker) -> Iterator:
    engines: list[BaseEngine] = []

    def make(**kwargs) -> ContinuousEngine:
        engine = ContinuousEngine(
            worker, Config(**{"batching": "continuous", "max_batch_size": 4, "batch_window_ms": 0.0, **kwargs})
        ).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def single(worker, image, question, params) -> str:
    engine = DynamicEngine(worker, Config(max_batch_size=1, batch_window_ms=0.0)).start()
    try:
        return engine.generate(door(image, question, params)).text
    finally:
        engine.shutdown()


@pytest.fixture
def by_hand(worker) -> Iterator:
    """``by_hand(**config)``: a continuous engine over the tiny worker driven by the test (``support.Stepper``)."""
    engines: list[BaseEngine] = []

    def make(**kwargs) -> Stepper:
        config = Config(**{"batching": "continuous", "max_batch_size": 4, "batch_window_ms": 0.0, **kwargs})
        engines.append(ContinuousEngine(worker, config))
        return Stepper(engines[-1])

    yield make
    for engine in engines:
        engine.shutdown()


def test_rows_joining_mid_flight_equal_their_single_runs(by_hand, worker) -> None:
    jobs = {
        "first": (solid_image("red", 300, 80), "What colour is this image?", LONG),
        "second": (solid_image("green", 16, 16), "Colour?", GREEDY),
        "sampled": (solid_image("blue", 500, 500), "Describe it", SamplingParams(150, 0.9, 0.9, seed=5)),
        "third": (solid_image("yellow", 1024, 16), "Tell me about the colour of this picture, please", GREEDY),
        "late": (solid_image("white", 90, 700), "what color", GREEDY),
    }
    expected = {name: single(worker, *job) for name, job in jobs.items()}
    sizes = BatchCounter()
    run = by_hand(max_batch_size=4)
    run.engine.add_listener(sizes)
    handles = {"first": run.submit(door(*jobs["first"]))}
    grown = lambda handle, n: lambda: len(handle.token_ids) >= n or handle.done  # noqa: E731
    run.until(grown(handles["first"], 5))
    handles["second"] = run.submit(door(*jobs["second"]))
    victim = run.submit(door(solid_image("black", 64, 64), "q", SamplingParams(4000, 0.0, ignore_eos=True)))
    run.until(grown(handles["second"], 3))
    handles["sampled"] = run.submit(door(*jobs["sampled"]))
    run.until(grown(victim, 10))
    victim.cancel()  # leaves mid-flight; its neighbours must not notice
    handles["third"] = run.submit(door(*jobs["third"]))
    run.until(grown(handles["third"], 20))
    handles["late"] = run.submit(door(*jobs["late"]))
    run.until(lambda: all(h.done for h in handles.values()) and victim.done)
    results = {name: h.result(timeout=1) for name, h in handles.items()}
    for name, result in results.items():
        assert result.text == expected[name], name
    assert max(sizes.sizes) > 1 and max(sizes.sizes) <= 4
    assert all(r.batch_size > 1 for r in results.values())
    with pytest.raises(RequestCancelledError):
        victim.result()
    assert len(victim.token_ids) < 4000
    for name in ("second", "third", "late"):
        assert jobs[name][0].getpixel((0, 0)) == COLOURS[conclusion_colour(results[name].text)]


def conclusion_colour(text: str) -> str:
    said = conclusion(text)
    found = [c for c in COLOURS if c in said]
    assert len(found) == 1, said
    return found[0]


def test_colours_never_cross_under_staggered_load(by_hand) -> None:
    run = by_hand(max_batch_size=3)
    handles = []
    for i, colour in enumerate(COLOURS):
        image = solid_image(colour, 40 + 90 * i, 200, noise=6, seed=i)
        handles.append((colour, run.submit(door(image, "Which colour?", GREEDY))))
        run.step(i)  # each arrives i steps after the one before
    run.until(lambda: all(handle.done for _, handle in handles))
    for colour, handle in handles:
        assert conclusion_colour(handle.result(timeout=1).text) == colour


def test_limits_hold_and_memory_returns_to_baseline(by_hand) -> None:
    budget = 600
    run = by_hand(max_batch_size=3, kv_token_budget=budget)
    engine = run.engine
    sizes = BatchCounter()
    engine.add_listener(sizes)
    peaks = []
    handles = [
        run.submit(door(solid_image(c, 64, 64), "Colour?", SamplingParams(60, 0.0, ignore_eos=True)))
        for c in list(COLOURS) * 2
    ]
    while not all(h.done for h in handles):
        run.step()
        stats = engine.stats()
        peaks.append((stats.running, stats.cached_token_slots))
    assert all(h.result().completion_tokens == 60 for h in handles)
    assert max(sizes.sizes) <= 3 and max(r for r, _ in peaks) <= 3
    # Admission keeps padded slots within the budget; running rows then grow by their decoded tokens.
    assert max(slots for _, slots in peaks) <= budget + 3 * 60
    # A row leaves in the step that fed its last token: nothing is left once the last answer ended.
    stats = engine.stats()
    assert stats.cached_token_slots == 0 and stats.running == 0
    assert stats.kv_pages_free + engine.images.pages == stats.kv_pages  # every page back, or a remembered picture


class FakeOOMWorker:
    """A fake: injects CUDA out-of-memory (impossible on this CPU box) into decode steps with many rows."""

    def __init__(self, worker, max_rows: int) -> None:
        self.inner = worker
        self.max_rows = max_rows
        self.failures = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, step, inputs):
        if inputs.input_ids.shape[0] > self.max_rows:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.inner.decode(step, inputs)


def test_out_of_memory_step_requeues_rows_and_everyone_finishes(worker) -> None:
    fake = FakeOOMWorker(worker, max_rows=2)
    engine = ContinuousEngine(fake, Config(batching="continuous", max_batch_size=4, batch_window_ms=0.0)).start()
    try:
        jobs = [(solid_image(c, 70, 70), "Colour?", GREEDY) for c in ("red", "green", "blue", "yellow")]
        expected = [single(worker, *job) for job in jobs]
        handles = [engine.submit(door(*job)) for job in jobs]
        streamed = [list(h.stream(timeout=120)) for h in handles]
        for job_expected, handle, deltas in zip(expected, handles, streamed):
            assert handle.result().text == job_expected
            assert "".join(deltas) == job_expected  # restarted rows sent no text twice
        assert fake.failures >= 1 and engine.row_limit <= 2
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--kv-token-budget", lambda prompt, pages, page_bytes: int(2.5 * prompt)),
        # Two rows' pages, a page of headroom for each running row, and half a row more.
        ("--kv-budget-gb", lambda prompt, pages, page_bytes: (2.5 * pages + 2) * page_bytes / 2**30),
    ],
    ids=["tokens", "bytes"],
)
def test_budget_flags_change_admission_end_to_end(tiny_dir, flag, value) -> None:
    """From the command line to admission: the same load runs 4 rows at once without a budget, at
    most 2 with a budget of two and a half rows' cache (prompt tokens, or the page pool's bytes: a row's
    prompt and the image states of the tiles it sees, plus a page of headroom per running row)."""

    def peak_rows(extra: list[str]) -> tuple[int, dict]:
        argv = ["--model", "tiny", "--tiny-dir", tiny_dir, "--device", "cpu", "--batching", "continuous"]
        config = load_config([*argv, "--max-batch-size", "4", "--batch-window-ms", "0", *extra])
        engine = build_engine(config)
        sizes = BatchCounter()
        engine.add_listener(sizes)
        try:
            jobs = [(solid_image(c, 64, 64), "Colour?", SamplingParams(40, 0.0, ignore_eos=True)) for c in COLOURS]
            with engine.scheduler._cond:  # hold the queue: all six arrive at the same step boundary
                handles = [engine.submit(door(*job)) for job in jobs]
            assert all(h.result(timeout=120).completion_tokens == 40 for h in handles)
            return max(sizes.sizes), engine.stats()
        finally:
            engine.shutdown()

    rows, stats = peak_rows([])
    assert rows == 4 and stats.max_batch_size == 4
    worker = load(tiny_dir, device="cpu")
    inputs = worker.prepare(solid_image("red", 64, 64), "Colour?")
    prompt, tiles = inputs["input_ids"].shape[1], int(inputs["cross_attention_mask"][0, -1].sum())
    shape = PageShape.of(worker.model.config, worker.dtype, page_tokens_for("cpu"))
    pages = shape.row_pages(prompt + 1, tiles)
    limited, stats = peak_rows([flag, str(value(prompt, pages, shape.page_bytes)), "--image-cache-mb", "0"])
    assert limited == 2, (flag, stats)


def test_newcomers_arriving_together_are_prefilled_together(by_hand, worker) -> None:
    """Unpaced (``--prefill-share 0``), newcomers arriving together are prefilled in one forward pass per tile
    count their pictures run (rows of other tile counts would change each other's answers)."""
    jobs = [
        (solid_image("green", 16, 16), "Colour?", GREEDY),
        (solid_image("blue", 500, 90), "What colour is this image, please?", SamplingParams(150, 0.9, 0.9, seed=3)),
        (solid_image("white", 90, 700), "what color", GREEDY),
    ]
    expected = [single(worker, *job) for job in jobs]
    run = by_hand(max_batch_size=4, prefill_share=0.0)
    engine = run.engine
    first = run.submit(door(solid_image("red", 300, 80), "What colour is this image?", LONG))
    run.step(4)
    handles = [run.submit(door(*job)) for job in jobs]  # they arrive at the same step boundary
    run.until(lambda: first.done and all(h.done for h in handles))
    assert [h.result(timeout=1).text for h in handles] == expected
    tiles = {worker.tiles_run(engine.make_request(door(*job)).inputs) for job in jobs}
    assert len(tiles) == 2  # the green and white pictures run one tile, the blue one more
    assert engine.stats().prefills_run == 1 + len(tiles)  # the first request, then one pass per tile count
    assert all(h.result().batch_size == 4 for h in handles)


class FakeOOMPrefillWorker:
    """A fake: prefills of more than one newcomer allocate a stand-in for their cache and hit an
    injected CUDA out-of-memory error (impossible on this CPU box)."""

    def __init__(self, worker) -> None:
        self.inner = worker
        self.caches: list[weakref.ref] = []
        self.alive_at_prefill: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, requests, images=None, reserve=0):
        self.alive_at_prefill.append(sum(ref() is not None for ref in self.caches))
        if len(requests) > 1:
            self._forward(len(requests))
        return self.inner.prefill(requests, images, reserve)

    def _forward(self, rows: int) -> None:
        cache = torch.empty(rows, 256, 1024)
        self.caches.append(weakref.ref(cache))
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def test_out_of_memory_group_prefill_is_split_after_its_memory_is_freed(worker) -> None:
    fake = FakeOOMPrefillWorker(worker)
    engine = ContinuousEngine(fake, Config(batching="continuous", max_batch_size=4, batch_window_ms=0.0)).start()
    try:
        jobs = [(solid_image(c, 70, 70), "Colour?", GREEDY) for c in ("red", "green", "blue", "yellow")]
        expected = [single(worker, *job) for job in jobs]
        with engine.scheduler._cond:  # hold the queue: all four arrive together
            handles = [engine.submit(door(*job)) for job in jobs]
        assert [h.result(timeout=120).text for h in handles] == expected
    finally:
        engine.shutdown()
    assert len(fake.caches) == 3  # four together, then both pairs; the singles go through
    assert fake.alive_at_prefill == [0] * 7, fake.alive_at_prefill


class HostReads:
    """Counts reads of device values into Python (``tolist``, ``item``, ``int()``, ``bool()``, ...)
    made on one thread while ``active``: on a GPU each one waits for the device to catch up."""

    METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self) -> None:
        self.count = 0
        self.active = threading.local()
        self.saved = {name: getattr(torch.Tensor, name) for name in self.METHODS}

    def __enter__(self) -> HostReads:
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, self._counting(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)

    def _counting(self, original):
        def read(tensor, *args, **kwargs):
            if getattr(self.active, "on", False):
                self.count += 1
            return original(tensor, *args, **kwargs)

        return read


class CountingEngine(ContinuousEngine):
    """The real continuous engine, with each decode step's host reads recorded."""

    reads: HostReads

    def _decode(self, sizes) -> None:
        before = self.reads.count
        self.reads.active.on = True
        try:
            super()._decode(sizes)
        finally:
            self.reads.active.on = False
            self.reads_per_step.append(self.reads.count - before)


def test_a_decode_step_reads_the_device_once(worker) -> None:
    """Greedy and sampled rows together: one read per step (the tokens), not one per sampled row,
    and rows leaving cost none."""
    jobs = [
        (solid_image("red", 64, 64), "Colour?", SamplingParams(30, 0.8, 0.9, seed=1, ignore_eos=True)),
        (solid_image("green", 64, 64), "Colour?", SamplingParams(45, 0.0, ignore_eos=True)),
        (solid_image("blue", 64, 64), "Colour?", SamplingParams(60, 1.0, 1.0, seed=2, ignore_eos=True)),
    ]
    with HostReads() as reads:
        CountingEngine.reads = reads
        engine = CountingEngine(worker, Config(batching="continuous", max_batch_size=4, batch_window_ms=0.0)).start()
        engine.reads_per_step = []
        try:
            with engine.scheduler._cond:
                handles = [engine.submit(door(*job)) for job in jobs]
            assert [h.result(timeout=120).completion_tokens for h in handles] == [30, 45, 60]
        finally:
            engine.shutdown()
    assert len(engine.reads_per_step) >= 59
    assert set(engine.reads_per_step) == {1}, engine.reads_per_step
