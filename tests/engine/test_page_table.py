"""The page table on a small real pool (no model): pages taken, shared and given back, and the plan's answers."""

from __future__ import annotations

import pytest
import torch
from support import checked

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.kv.page_table import PageTable
from vlm_demo.engine.kv.pages import PagePool, PageShape
from vlm_demo.request import SamplingParams

SHAPE = PageShape(page_tokens=4, image_page_tokens=8, self_layers=(0, 1), cross_layers=(2,), kv_heads=1,
                  head_dim=2, patches=5, max_tiles=4, dtype=torch.float32)  # fmt: skip


@pytest.fixture
def table() -> PageTable:
    cpu = torch.device("cpu")
    return PageTable(PagePool(SHAPE, 32, {0: cpu, 1: cpu, 2: cpu}))


def test_allocate_takes_text_and_image_pages_or_nothing(table) -> None:
    (place,) = table.allocate([9], [2], [True])
    assert len(place.pages) == 3 and len(place.image_pages) == 2  # 9 tokens / 4; 2 tiles x 5 states / 8
    assert table.pool.free_pages == 32 - 5
    assert table.allocate([9] * 6, [2] * 6, [True] * 6) is None  # 30 pages wanted, 27 free
    assert table.pool.free_pages == 27  # a refusal takes nothing


def test_a_row_opens_a_page_only_when_its_pages_are_full(table) -> None:
    (place,) = table.allocate([8], [1], [True])
    assert table.opens_page(place) and table.growth([place, None]) == 1
    table.grow([place])
    assert len(place.pages) == 3 and not table.opens_page(place)
    place.length = 9
    table.grow([place])  # nothing to take
    assert len(place.pages) == 3


def test_forks_share_full_pages_and_copy_only_the_partial_one(table) -> None:
    (place,) = table.allocate([6], [1], [True])  # one full page, one with 2 tokens
    table.pool.keys[0][place.pages[1], :2] = 7.0
    start = table.keep_aside(place, None)
    forks = table.fork(start, 3)
    assert all(f.pages[0] == place.pages[0] and f.image_pages == place.image_pages for f in forks)
    assert len({f.pages[1] for f in forks} | {place.pages[1]}) == 4  # each its own last page
    assert all(bool((table.pool.keys[0][f.pages[1], :2] == 7.0).all()) for f in forks)
    assert table.copied_bytes == 3 * 2 * SHAPE.text_bytes_per_token
    assert table.pool.owners(place.pages[0]) == 4 and table.owned(forks[0]) == 1  # only its copied page
    free = table.pool.free_pages
    for fork in forks:
        table.release(fork)
    start.release()
    start.release()  # a second release changes nothing
    assert table.pool.free_pages == free + 3 + 3  # the forks' own pages, then the start's three
    assert table.pool.free_pages == 32


def test_a_snapshot_keeps_the_first_tokens_without_a_copy(table) -> None:
    (place,) = table.allocate([11], [1], [True])
    snap = table.snapshot(place, 5, torch.tensor([3]))
    assert snap.place.pages == place.pages[:2] and snap.length == 5 and table.copied_bytes == 0
    table.release(place)
    assert table.pool.free_pages == 32 - 2 - 1  # the snapshot still holds two text pages and the image page
    snap.release()
    assert table.pool.free_pages == 32


def test_the_image_cache_leaves_room_for_newcomers_and_one_page_per_row(table) -> None:
    request = Request(image=None, question="", params=checked(SamplingParams()))
    request.inputs = {"input_ids": torch.zeros(1, 7, dtype=torch.long)}
    assert table.newcomer_pages(request) == SHAPE.row_pages(8, 0)  # its prompt and first token; no picture
    assert table.cache_reserve([request, request], running=3) == 2 * SHAPE.row_pages(8, 0) + 3 + 2


def test_inert_rows_use_the_null_pages(table) -> None:
    rows = table.inert(2)
    null = table.pool.null_pages()
    assert all(r.pages == null[:1] and r.image_pages == null[1:] and r.length == 0 for r in rows)
