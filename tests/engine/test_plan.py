"""``Scheduler.plan`` on hand-made records, no model: what a step boundary hands back, forks, admits and evicts
(as TGI tests its queue's ``next_batch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from support import checked

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.scheduling.scheduler import PREEMPT_AFTER, Room, RowState, Scheduler
from vlm_demo.request import STAGE_BEAM, SamplingParams

PAGES = 5  # every newcomer's pages in these plans


def waiting(*clients: str, beams: int = 0) -> Scheduler:
    """A scheduler with one waiting request per client named (in that order)."""
    scheduler = Scheduler(max_batch_size=8, batch_window_s=0.0, max_queue=64)
    for client in clients:
        params = SamplingParams(reasoning=STAGE_BEAM, beams=beams) if beams else SamplingParams()
        request = Request(image=None, question=client, params=checked(params))
        request.client = client
        scheduler.add(request)
    return scheduler


def room(rows: int = 0, allowed: int = 4, free: int = 100, cache: int = 0, next_step: int = 0, **kw) -> Room:
    return Room(rows, allowed, free, cache, next_step, lambda request: PAGES, **kw)


def row(client: str, written: int = 50, movable: bool = True, pages: int = 3) -> RowState:
    return RowState(client, written, movable, lambda: pages)


def nobody() -> list[RowState]:
    raise AssertionError("the plan asked for the rows when its decision did not need them")


@dataclass
class FakeSearch:
    """A search as the plan sees it (the real one is ``StageBeam``; the plan reads only these two)."""

    wanted: int
    speculating: bool = False

    def rows_wanted(self, spare: bool = True) -> int:
        return self.wanted if spare or not self.speculating else 0


def test_newcomers_fill_the_free_rows_in_turn_and_no_more() -> None:
    scheduler = waiting("a", "a", "b", "c")
    plan = scheduler.plan(room(rows=1, allowed=4), nobody, [])
    assert [r.question for r in plan.admit] == ["a", "b", "c"]  # clients take turns: a, b, c, then a again
    assert plan.suspend == [] and plan.evict_pages == 0 and scheduler.depth == 1


def test_each_running_row_keeps_a_page_to_grow_into() -> None:
    """Two running rows and 13 free pages: one newcomer (5 pages) leaves 8 ≥ 3 rows' headroom; a second would
    leave 3 < 4."""
    plan = waiting("a", "b").plan(room(rows=2, free=13), nobody, [])
    assert len(plan.admit) == 1
    plan = waiting("a", "b").plan(room(rows=2, free=14), nobody, [])
    assert len(plan.admit) == 2


def test_a_lone_request_goes_in_even_when_the_pages_say_no() -> None:
    plan = waiting("a", "b").plan(room(rows=0, free=3), nobody, [])
    assert len(plan.admit) == 1  # nothing runs: it could never start otherwise (its prefill then says)


def test_the_image_cache_gives_back_what_the_newcomers_take_beyond_the_free_pages() -> None:
    plan = waiting("a").plan(room(rows=1, free=2, cache=10), nobody, [])
    assert len(plan.admit) == 1 and plan.evict_pages == PAGES - 2


def test_a_short_next_step_takes_the_cache_first_then_hands_back_the_rows_that_wrote_least() -> None:
    rows = [row("a", written=40), row("b", written=10), row("c", written=25, movable=False)]
    plan = waiting().plan(room(rows=3, free=0, cache=1, next_step=3), lambda: rows, [])
    assert plan.suspend == [1] and not plan.short  # 1 page from the cache + row b's 3 ≥ 3
    assert plan.evict_pages == 0  # the freed row covers the rest; its pages were counted as free


def test_when_nothing_can_make_room_the_plan_says_short() -> None:
    rows = [row("a", movable=False, pages=1), row("b", pages=1)]
    plan = waiting().plan(room(rows=2, free=0, next_step=5), lambda: rows, [])
    assert plan.suspend == [1] and plan.short


def test_a_waiting_client_takes_its_share_from_the_client_holding_most() -> None:
    rows = [row("a", written=30), row("a", written=12), row("a", written=20), row("b", written=9)]
    plan = waiting("c").plan(room(rows=4, allowed=4), lambda: rows, [])
    assert plan.suspend == [1]  # a holds 3 of 4 (share 1 each of a, b, c): its row that wrote least goes back
    assert [r.client for r in plan.admit] == ["c"]


def test_rows_that_joined_a_moment_ago_are_not_handed_back() -> None:
    rows = [row("a", written=PREEMPT_AFTER - 1), row("a", written=PREEMPT_AFTER - 1)]
    plan = waiting("b").plan(room(rows=2, allowed=2), lambda: rows, [])
    assert plan.suspend == [] and plan.admit == []  # b waits a few steps more, not a thrash
    rows = [row("a", written=PREEMPT_AFTER), row("a", written=PREEMPT_AFTER - 1)]
    plan = waiting("b").plan(room(rows=2, allowed=2), lambda: rows, [])
    assert plan.suspend == [0] and len(plan.admit) == 1


def test_a_search_forks_before_any_newcomer_and_a_partial_fork_holds_the_queue() -> None:
    search = FakeSearch(3)
    plan = waiting("a").plan(room(rows=0, allowed=4), nobody, [search])
    assert plan.forks == [(search, 3)] and len(plan.admit) == 1
    plan = waiting("a").plan(room(rows=2, allowed=4), nobody, [search])
    assert plan.forks == [(search, 2)] and plan.admit == []  # the search waits for a row: so do newcomers


def test_a_speculating_search_takes_only_rows_nobody_waits_for() -> None:
    guess = FakeSearch(3, speculating=True)
    plan = waiting().plan(room(rows=0, allowed=4), nobody, [guess])
    assert plan.forks == [(guess, 3)]
    plan = waiting("a").plan(room(rows=0, allowed=4), nobody, [guess])
    assert plan.forks == [] and len(plan.admit) == 1


def test_the_token_budget_admits_while_the_cached_tokens_allow() -> None:
    scheduler = waiting("a", "b", "c")
    for request in scheduler.snapshot():
        request.inputs = {"input_ids": torch.zeros(1, 30, dtype=torch.long)}  # 30 prompt tokens each
    plan = scheduler.plan(room(rows=1, cached_tokens=50, token_budget=100), nobody, [])
    assert [r.client for r in plan.admit] == ["a"]  # 50 + 30 = 80 fits; 80 + 30 = 110 does not
    plan = scheduler.plan(room(rows=1, cached_tokens=40, token_budget=100), nobody, [])
    assert [r.client for r in plan.admit] == ["b", "c"]  # 40 + 30 + 30 = 100: exactly the budget


def test_a_search_needs_all_its_rows_at_once() -> None:
    plan = waiting("a", beams=3).plan(room(rows=2, allowed=4), nobody, [])
    assert plan.admit == []  # three candidates need three free rows; two are free
    plan = waiting("a", beams=3).plan(room(rows=1, allowed=4), nobody, [])
    assert len(plan.admit) == 1
