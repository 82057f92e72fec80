"""The dynamic-batching engine on the real tiny Mllama: correctness of every row, isolation, cancel."""

from __future__ import annotations

import io
import re
import threading
import time
import weakref
from collections.abc import Iterator

import pytest
import torch
from PIL import Image
from support import checked, door, four_stages, wait_until

from vlm_demo.config import Config
from vlm_demo.engine.batching.base import Engine as BaseEngine
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.decoding.detokenizer import STOP_TEXT, RowStreamer
from vlm_demo.errors import (
    InvalidRequestError,
    OutOfMemoryError,
    QueueFullError,
    RequestCancelledError,
)
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.request import SamplingParams

GREEDY = SamplingParams(max_new_tokens=160, temperature=0.0)

# (colour, width, height, question): prompt lengths, image sizes and aspect ratios all differ.
CASES = [
    ("red", 16, 16, "Colour?"),
    ("green", 1024, 16, "What is the main colour of this picture, please?"),
    ("blue", 300, 700, "Describe it"),
    ("yellow", 1024, 1024, "What colour do you see in the image here?"),
    ("white", 57, 333, "what color is it"),
    ("black", 700, 90, "Tell me the colour of this image and explain your reasoning briefly."),
]


def conclusion(text: str) -> str:
    match = re.search(r"<CONCLUSION>(.*?)</CONCLUSION>", text, re.S)
    assert match, f"no CONCLUSION in {text!r}"
    return match.group(1)


@pytest.fixture
def make_engine(worker) -> Iterator:
    engines: list[BaseEngine] = []

    def make(**kwargs) -> DynamicEngine:
        engine = DynamicEngine(worker, Config(**{"max_batch_size": 8, "batch_window_ms": 300.0, **kwargs})).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def singles(worker) -> dict[tuple, str]:
    """Each case run alone (batch of one): the reference every batched row must equal."""
    engine = DynamicEngine(worker, Config(max_batch_size=1, batch_window_ms=0.0)).start()
    try:
        out = {}
        for colour, w, h, q in CASES:
            out[(colour, w, h, q)] = engine.generate(door(solid_image(colour, w, h), q, GREEDY)).text
        for seed in (11, 12):
            params = SamplingParams(max_new_tokens=160, temperature=0.9, top_p=0.9, seed=seed)
            out[("sampled", seed)] = engine.generate(door(solid_image("red", 64, 64), "Colour?", params)).text
        return out
    finally:
        engine.shutdown()


def submit_all(engine: BaseEngine, jobs: list[tuple]) -> list:
    """Submit together so they land in one batch."""
    return [engine.submit(door(img, q, p)) for img, q, p in jobs]


def test_greedy_batch_rows_equal_single_runs_next_to_sampled_rows(make_engine, singles) -> None:
    engine = make_engine()
    jobs = [(solid_image(c, w, h), q, GREEDY) for c, w, h, q in CASES]
    for seed in (11, 12):
        jobs.insert(seed - 9, (solid_image("red", 64, 64), "Colour?", SamplingParams(160, 0.9, 0.9, seed=seed)))
    handles = submit_all(engine, jobs)
    results = [h.result(timeout=120) for h in handles]
    assert all(r.batch_size == 8 for r in results), [r.batch_size for r in results]
    greedy = [r for r, job in zip(results, jobs, strict=False) if job[2].temperature == 0]
    for (colour, w, h, q), result in zip(CASES, greedy, strict=False):
        assert result.text == singles[(colour, w, h, q)], (colour, w, h)
        assert colour in conclusion(result.text)
        assert four_stages(result.text)
    sampled = [r for r, job in zip(results, jobs, strict=False) if job[2].temperature != 0]
    # A sampled row draws from its own seeded random stream: same seed, same text, whatever its neighbours.
    assert [r.text for r in sampled] == [singles[("sampled", 11)], singles[("sampled", 12)]]


def test_six_colours_in_one_batch_each_get_their_own_colour(make_engine) -> None:
    engine = make_engine(max_batch_size=6)
    colours = list(COLOURS)
    handles = submit_all(
        engine,
        [
            (solid_image(c, 100 + 40 * i, 90, noise=8, seed=i), "What colour is this?", GREEDY)
            for i, c in enumerate(colours)
        ],
    )
    results = [h.result(timeout=120) for h in handles]
    assert [r.batch_size for r in results] == [6] * 6
    for colour, result in zip(colours, results, strict=False):
        said = conclusion(result.text)
        assert colour in said and not any(other in said for other in colours if other != colour)


def test_streamed_deltas_concatenate_to_the_final_text(make_engine) -> None:
    engine = make_engine(max_batch_size=2, batch_window_ms=200, stream_every_ms=0)  # every step's text on its own
    a = engine.submit(door(solid_image("blue", 64, 64), "Give the colour.", GREEDY))
    b = engine.submit(door(solid_image("yellow", 80, 40), "Describe the image.", GREEDY))
    for handle in (a, b):
        deltas = list(handle.stream(timeout=120))
        text = handle.result().text
        assert "".join(deltas) == text
        assert len(deltas) > 10  # it really streamed, token by token
        assert not any("\ufffd" in d for d in deltas)  # no half characters
        assert "→" in text  # the multi-byte character the tiny model writes
        assert text.endswith(STOP_TEXT)


@pytest.mark.parametrize("kind", [DynamicEngine, ContinuousEngine], ids=["dynamic", "continuous"])
def test_clients_get_first_words_and_the_end_at_once_and_the_rest_merged(worker, kind) -> None:
    """Handed over at most every 30 s, an answer still shows its first words at once and all the rest as soon as
    it ends, in one piece; handed over after every step, it streams token by token."""
    for every in (30_000.0, 0.0):
        engine = kind(worker, Config(max_batch_size=2, batch_window_ms=0.0, stream_every_ms=every)).start()
        try:
            began = time.monotonic()
            handle = engine.submit(door(solid_image("blue", 64, 64), "Describe the image.", GREEDY))
            deltas = list(handle.stream(timeout=60))
            took = time.monotonic() - began
            text = handle.result().text
        finally:
            engine.shutdown()
        assert "".join(deltas) == text and text.endswith(STOP_TEXT)
        if every:
            assert len(deltas) == 2 and took < 20, (len(deltas), took)  # the first words; the rest with the end
        else:
            assert len(deltas) > 10, len(deltas)


@pytest.mark.parametrize("native", [True, False], ids=["DecodeStream", "python-window"])
def test_row_streamer_holds_back_partial_utf8_and_split_tags(worker, native: bool) -> None:
    """Feed a real tokenisation one token at a time: every prefix sent is valid text (with the
    native incremental decoder and with the fallback for tokenizers without a Rust backend)."""
    from vlm_demo.engine.batching.job import Request

    text = "<SUMMARY>ok</SUMMARY> 🙂 é → <CONCLUSION>red</CONCLUSION> trailing"
    ids = worker.tokenizer.encode(text, add_special_tokens=False)
    request = Request(image=None, question="q", params=checked(SamplingParams(max_new_tokens=500, temperature=0)))
    row = RowStreamer(worker.tokenizer, request, worker.eos_ids)
    if not native:
        row._stream = None
    sent = [""]  # the text a client has been sent after each token
    for token in ids:
        done = row.feed(token)
        if request.text != sent[-1]:
            assert request.text.startswith(sent[-1])  # text only grows
            sent.append(request.text)
        if done:
            break
    assert sent[-1] == "<SUMMARY>ok</SUMMARY> 🙂 é → <CONCLUSION>red</CONCLUSION>"
    assert not any("\ufffd" in text for text in sent)
    assert len(sent) > 5  # sent piece by piece
    assert request.result is not None and request.result.finish_reason == "stop"


def test_each_row_stops_on_its_own(make_engine) -> None:
    engine = make_engine(max_batch_size=3)
    jobs = [
        (solid_image("red", 50, 50), "Colour?", SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True)),
        (solid_image("green", 50, 50), "Colour?", SamplingParams(max_new_tokens=300, temperature=0)),
        (solid_image("blue", 50, 50), "Colour?", SamplingParams(max_new_tokens=90, temperature=0, ignore_eos=True)),
    ]
    short, natural, forced = [h.result(timeout=120) for h in submit_all(engine, jobs)]
    assert (short.completion_tokens, short.finish_reason) == (7, "length")
    assert natural.finish_reason == "stop" and natural.text.endswith(STOP_TEXT) and natural.completion_tokens < 300
    assert (forced.completion_tokens, forced.finish_reason) == (90, "length")  # ran past end of turn
    assert short.batch_size == natural.batch_size == forced.batch_size == 3


def test_cancel_stops_the_stream_at_once_and_frees_the_batch(make_engine) -> None:
    engine = make_engine(max_batch_size=2, batch_window_ms=200, max_new_tokens=5000)
    long = engine.submit(
        door(solid_image("red", 60, 60), "q", SamplingParams(max_new_tokens=5000, temperature=0, ignore_eos=True))
    )
    short = engine.submit(door(solid_image("blue", 60, 60), "Colour?", GREEDY))
    stream = long.stream(timeout=60)
    next(stream)
    threading.Timer(0.2, long.cancel).start()
    started = time.monotonic()
    with pytest.raises(RequestCancelledError):
        for _ in stream:
            pass
    assert time.monotonic() - started < 5
    assert "blue" in conclusion(short.result(timeout=60).text)
    # The batch ends once every row is done or cancelled, not after 5000 tokens.
    wait_until(lambda: not engine.stats().running, 30, fail=False)
    assert engine.stats().running == 0
    assert len(long.token_ids) < 5000


def test_cancelled_waiting_request_never_runs(make_engine) -> None:
    engine = make_engine(max_batch_size=1, batch_window_ms=0)
    encodes = engine.worker.vision_encodes
    first = engine.submit(door(solid_image("red", 60, 60), "Colour?", GREEDY))
    waiting = engine.submit(door(solid_image("green", 60, 60), "Colour?", GREEDY))
    waiting.cancel()
    first.result(timeout=60)
    # had the cancelled one run after all, the engine would be busy with it (a 200-token answer) or have run it
    wait_until(lambda: engine.scheduler.depth == 0 and engine.running_rows() == 0, 10, what="an idle engine")
    assert waiting.token_ids == [] and engine.worker.vision_encodes == encodes + 1  # only the first's picture
    with pytest.raises(RequestCancelledError):
        waiting.result()


class FakeOOMWorker:
    """A fake: injects CUDA out-of-memory (impossible on this CPU box) into a real worker's batches."""

    def __init__(self, worker, fails) -> None:
        self.inner = worker
        self.fails = fails
        self.failed: list[int] = []
        self.succeeded: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, batch, structured: bool = True, on_step=None) -> None:
        if self.fails(batch):
            self.failed.append(len(batch))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        self.succeeded.append(len(batch))
        self.inner.run(batch, structured, on_step)


def test_oom_batch_is_split_and_retried_until_requests_succeed(worker, singles) -> None:
    fake = FakeOOMWorker(worker, fails=lambda batch: len(batch) > 2)
    engine = DynamicEngine(fake, Config(max_batch_size=6, batch_window_ms=300.0)).start()
    try:
        handles = submit_all(engine, [(solid_image(c, w, h), q, GREEDY) for c, w, h, q in CASES])
        results = [h.result(timeout=120) for h in handles]
        for (colour, w, h, q), result in zip(CASES, results, strict=False):
            assert result.text == singles[(colour, w, h, q)]
        assert fake.failed[0] == 6 and max(fake.succeeded) <= 2 and sum(fake.succeeded) == 6
    finally:
        engine.shutdown()


class FakeOOMAfterAllocWorker:
    """A fake: a real worker whose multi-row batches allocate a stand-in for their KV cache in a
    nested frame (as ``generate`` does) and then hit an injected CUDA out-of-memory error."""

    def __init__(self, worker) -> None:
        self.inner = worker
        self.caches: list[weakref.ref] = []  # each failed attempt's cache
        self.alive_at_run: list[int] = []  # per run: how many failed attempts' caches were still alive

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, batch, structured: bool = True, on_step=None) -> None:
        self.alive_at_run.append(sum(ref() is not None for ref in self.caches))
        if len(batch) > 1:
            self._generate(len(batch))
        self.inner.run(batch, structured, on_step)

    def _generate(self, rows: int) -> None:
        kv_cache = torch.empty(rows, 256, 1024)  # what a real attempt holds when it runs out
        self.caches.append(weakref.ref(kv_cache))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def test_failed_attempts_memory_is_freed_before_the_retry(worker, singles) -> None:
    """Retrying while the failed attempt's cache is alive (e.g. inside the ``except`` block, whose
    traceback holds the attempt's frames) makes one out-of-memory error cascade through every retry."""
    fake = FakeOOMAfterAllocWorker(worker)
    engine = DynamicEngine(fake, Config(max_batch_size=4, batch_window_ms=300.0)).start()
    try:
        handles = submit_all(engine, [(solid_image(c, w, h), q, GREEDY) for c, w, h, q in CASES[:4]])
        results = [h.result(timeout=120) for h in handles]
    finally:
        engine.shutdown()
    for (colour, w, h, q), result in zip(CASES[:4], results, strict=True):
        assert result.text == singles[(colour, w, h, q)]
    assert len(fake.caches) == 3  # 4 rows fail, then both halves of 2
    assert fake.alive_at_run == [0] * 7, fake.alive_at_run  # 1 + 2 + 4 runs, never beside a dead attempt


def test_request_that_fails_alone_gets_a_specific_error_and_others_go_on(worker) -> None:
    fake = FakeOOMWorker(worker, fails=lambda batch: any(r.question == "poison" for r in batch))
    engine = DynamicEngine(fake, Config(max_batch_size=4, batch_window_ms=300.0)).start()
    try:
        handles = submit_all(
            engine,
            [
                (solid_image(c, 64, 64), "poison" if c == "blue" else "Colour?", GREEDY)
                for c in ("red", "green", "blue", "white")
            ],
        )
        for colour, handle in zip(("red", "green", "blue", "white"), handles, strict=False):
            if colour == "blue":
                with pytest.raises(OutOfMemoryError, match="ran out of memory"):
                    handle.result(timeout=120)
            else:
                assert colour in conclusion(handle.result(timeout=120).text)
        # The worker thread survived: the next request is served.
        assert "black" in conclusion(engine.generate(door(solid_image("black", 30, 30), "Colour?", GREEDY)).text)
    finally:
        engine.shutdown()


def test_undecodable_image_fails_before_batching(make_engine) -> None:
    engine = make_engine(max_batch_size=4)
    buf = io.BytesIO()
    solid_image("red", 200, 200).save(buf, format="PNG")
    broken = Image.open(io.BytesIO(buf.getvalue()[:120]))  # header fine, pixel data cut off
    good = engine.submit(door(solid_image("green", 64, 64), "Colour?", GREEDY))
    with pytest.raises(InvalidRequestError, match="image"):
        engine.submit(door(broken, "Colour?", GREEDY))
    assert "green" in conclusion(good.result(timeout=60).text)


@pytest.mark.parametrize(
    ("question", "params", "message"),
    [
        ("   ", GREEDY, "question"),
        ("x" * 5000, GREEDY, "too long"),
        ("ok", SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ("ok", SamplingParams(max_new_tokens=10**6), "max_new_tokens"),
        ("ok", SamplingParams(temperature=-1), "temperature"),
        ("ok", SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_requests_get_specific_errors(make_engine, question, params, message) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit(door(solid_image("red", 20, 20), question, params))


def test_queue_full_refuses_at_once(make_engine) -> None:
    engine = make_engine(max_batch_size=1, batch_window_ms=0, max_queue=1)
    long = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    running = engine.submit(door(solid_image("red", 20, 20), "q", long))
    wait_until(lambda: running.token_ids, 60, every=0.01, what="the first request to run")
    engine.submit(door(solid_image("red", 20, 20), "q", long))
    with pytest.raises(QueueFullError, match="busy"):
        engine.submit(door(solid_image("red", 20, 20), "q", long))
    running.cancel()
