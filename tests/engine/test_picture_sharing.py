"""One copy of a picture's cross-attention states for every row that shows it (the page table's picture registry),
on the real tiny Mllama: the pool holds a shared picture once, the answers stay their single runs, and the pages go
when the last row lets go."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from PIL import Image
from support import Stepper, door

from vlm_demo.config import Config
from vlm_demo.engine.batching.base import Engine as BaseEngine
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.kv.page_table import PageTable
from vlm_demo.engine.kv.pages import PagePool, PageShape
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.request import SamplingParams

ROWS = 8
FORCED = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
QUESTIONS = [f"{w} colour is this picture?" for w in ("What", "Which", "Say what", "Tell me what")] * 2


@pytest.fixture
def by_hand(worker) -> Iterator:
    engines: list[BaseEngine] = []

    def make(**kwargs) -> Stepper:
        config = Config(**{"batching": "continuous", "max_batch_size": ROWS, "batch_window_ms": 0.0, **kwargs})
        engines.append(ContinuousEngine(worker, config))
        return Stepper(engines[-1])

    yield make
    for engine in engines:
        engine.shutdown()


def distinct_pictures(count: int) -> list[Image.Image]:
    """``count`` different pictures of one size (so one tile count): solid colours, each with its own mark."""
    pictures = []
    for i in range(count):
        picture = solid_image(list(COLOURS)[i % len(COLOURS)], 320, 240)
        picture.putpixel((i, 0), (i * 20 % 256, 7, 7))
        pictures.append(picture)
    return pictures


def one_picture_bytes(engine: ContinuousEngine) -> int:
    """What one row's picture takes in the pool (its image pages)."""
    place = engine.rows.rows[0].place
    return len(place.image_pages) * engine.rows.shape.page_bytes


def test_eight_answers_about_one_picture_hold_it_once(by_hand, worker) -> None:
    picture = solid_image("green", 320, 240)
    run = by_hand()
    handles = [run.submit(door(picture, q, FORCED)) for q in QUESTIONS]
    run.until(lambda: len(run.engine.rows) == ROWS)
    engine = run.engine
    one = one_picture_bytes(engine)
    held = engine.stats().picture_states_bytes
    assert 0 < one and held <= 1.5 * one, (held, one)
    pages = {tuple(r.place.image_pages) for r in engine.rows.rows}
    assert len(pages) == 1, "every row points at the same image pages"
    assert engine.stats().pictures_shared >= ROWS - 1
    run.until(lambda: all(h.done for h in handles))
    texts = [h.result(timeout=1).text for h in handles]
    alone = DynamicEngine(worker, Config(max_batch_size=1, batch_window_ms=0.0)).start()
    try:
        for question, text in zip(QUESTIONS[:4], texts[:4], strict=True):  # the other four ask the same again
            assert text == alone.generate(door(picture, question, FORCED)).text, question
    finally:
        alone.shutdown()
    assert texts[4:] == texts[:4]
    assert engine.stats().picture_states_bytes == 0 and not engine.rows.table.pictures


def test_eight_distinct_pictures_hold_eight_copies(by_hand) -> None:
    run = by_hand()
    handles = [run.submit(door(p, "What colour is this picture?", FORCED)) for p in distinct_pictures(ROWS)]
    run.until(lambda: len(run.engine.rows) == ROWS)
    one = one_picture_bytes(run.engine)
    held = run.engine.stats().picture_states_bytes
    assert held >= 6 * one, (held, one)
    assert run.engine.stats().pictures_shared == 0
    run.until(lambda: all(h.done for h in handles))
    assert run.engine.stats().picture_states_bytes == 0


def test_a_newcomer_shares_a_running_rows_picture_and_keeps_it_after_that_row_leaves(by_hand) -> None:
    """The second visitor joins mid-flight on the first one's pages, and the picture outlives the first row."""
    picture = solid_image("blue", 320, 240)
    run = by_hand()
    first = run.submit(door(picture, "What colour is this picture?", SamplingParams(6, 0.0, ignore_eos=True)))
    run.until(lambda: len(first.token_ids) >= 2)
    table = run.engine.rows.table
    before = run.engine.rows.pool.free_pages
    second = run.submit(door(picture, "Which colour is it?", SamplingParams(40, 0.0, ignore_eos=True)))
    run.until(lambda: len(run.engine.rows) == 2 or first.done)
    assert run.engine.stats().pictures_shared == 1
    text_pages = len(run.engine.rows.rows[-1].place.pages)
    assert before - run.engine.rows.pool.free_pages <= text_pages + 1, "the newcomer took no image pages"
    run.until(lambda: first.done)
    run.step(2)
    assert len(table.pictures) == 1 and run.engine.stats().picture_states_bytes > 0, "the second row still holds it"
    run.until(lambda: second.done)
    assert not table.pictures and run.engine.stats().picture_states_bytes == 0


def tiny_table(pages: int = 64) -> PageTable:
    """A page table over a small fp32 pool with Mllama's layer split (no model needed)."""
    shape = PageShape(4, 8, (0, 2), (1,), 2, 8, 10, 4, torch.float32)
    return PageTable(PagePool(shape, pages, {0: torch.device("cpu"), 1: torch.device("cpu"), 2: torch.device("cpu")}))


def test_the_table_shares_a_held_picture_and_frees_it_with_its_last_holder() -> None:
    table = tiny_table()
    pool, key = table.pool, ("digest", 2, (0, 1))
    free = pool.free_pages
    image = table.shape.image_pages(2 * table.shape.patches)
    a, b = table.allocate([5, 9], [2, 2], [True, True], [key, key])
    assert a.image_pages == b.image_pages and b.shared_picture and not a.shared_picture
    assert free - pool.free_pages == table.shape.text_pages(5) + table.shape.text_pages(9) + image
    assert table.picture_bytes == image * table.shape.page_bytes
    other = table.allocate([5], [2], [True], [("digest", 2, (0,))])  # sees other tiles: other states
    assert other is not None and other[0].image_pages != a.image_pages
    fork = table.fork(table.snapshot(b, 9, torch.zeros(1, dtype=torch.long)), 1)
    assert fork is not None and fork[0].picture == key
    for place in (a, b, fork[0]):
        assert key in table.pictures
        table.release(place)
    assert key in table.pictures, "the snapshot still holds it"


def test_admission_counts_a_held_picture_as_text_pages_only(worker) -> None:
    table = tiny_table()
    request = type("R", (), {"input_tokens": 6, "tiles": 2, "image_key": "digest"})()
    alone = table.newcomer_pages(request)
    assert alone == table.shape.row_pages(7, 2)
    assert table.cache_reserve([request, request], 0) == alone + table.shape.text_pages(7) + 2
    table.allocate([7], [2], [True], [("digest", 2, (0, 1))])
    assert table.newcomer_pages(request) == table.shape.text_pages(7)
