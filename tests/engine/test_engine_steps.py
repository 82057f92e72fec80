"""The continuous engine driven by hand on the real tiny model: ``step()`` on the test's thread, no engine
thread, so admission, leaving, preemption and fair share are checked by exact step counts."""

from __future__ import annotations

import dataclasses

import pytest
from support import Stepper, door

from vlm_demo.config import Config
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.scheduling.scheduler import PREEMPT_AFTER
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import STAGE_BEAM, SamplingParams


def forced(tokens: int) -> SamplingParams:
    """An answer of exactly ``tokens`` tokens (greedy, end of turn ignored)."""
    return SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)


def ask(colour: str, tokens: int, client: str = "") -> object:
    return dataclasses.replace(door(solid_image(colour, 40, 40), "Describe this picture in detail.", forced(tokens)),
                               client=client)  # fmt: skip


@pytest.fixture
def hand(worker):
    """``hand(**config)``: a continuous engine over the shared tiny worker, never started, and its Stepper."""
    made = []

    def make(**settings) -> Stepper:
        config = Config(**{"batching": "continuous", "max_batch_size": 2, "batch_window_ms": 0.0, **settings})
        engine = ContinuousEngine(worker, config)
        made.append(engine)
        return Stepper(engine)

    yield make
    for engine in made:
        engine.shutdown()


def test_rows_join_at_the_next_step_and_leave_in_the_step_of_their_last_token(hand) -> None:
    """A newcomer's prefill draws its first token and the same step decodes its second; an answer of N
    tokens leaves in step N - 1, and the request waiting for its row joins at the next."""
    run = hand(max_batch_size=2)
    engine = run.engine
    free = engine.rows.pool.free_pages
    first, second, third = (run.submit(ask(c, n)) for c, n in (("red", 12), ("green", 20), ("blue", 6)))
    run.step()
    assert len(engine.rows) == 2 and engine.scheduler.depth == 1
    assert (len(first.token_ids), len(second.token_ids), len(third.token_ids)) == (2, 2, 0)
    run.step(12 - 2)  # step 11: the first answer's 12th token
    assert first.done and len(first.token_ids) == 12 and len(engine.rows) == 1
    assert third.token_ids == []  # it joins at the next boundary, not in the middle of a step
    run.step()
    assert len(third.token_ids) == 2 and len(second.token_ids) == 13 and len(engine.rows) == 2
    run.until(lambda: third.done and second.done)
    assert (len(second.token_ids), len(third.token_ids)) == (20, 6)
    assert run.steps == 19  # the second answer's 20 tokens: its prefill's, then 19 steps
    assert len(engine.rows) == 0
    assert engine.rows.pool.free_pages + (engine.images.pages if engine.images else 0) == free  # every page back


def test_a_cancelled_row_leaves_at_the_next_step_and_its_neighbour_goes_on(hand) -> None:
    run = hand(max_batch_size=2)
    keep, drop = run.submit(ask("red", 30)), run.submit(ask("green", 30))
    run.step(5)
    drop.cancel()
    run.step()
    assert len(run.engine.rows) == 1 and run.engine.rows.rows[0].request.rid == keep.rid
    written = len(drop.token_ids)
    run.until(lambda: keep.done)
    assert len(keep.token_ids) == 30 and len(drop.token_ids) == written


def test_a_waiting_client_gets_a_row_back_at_once_and_the_row_resumes_exactly(hand) -> None:
    """Fair share by steps: one client holds both rows; once they wrote ``PREEMPT_AFTER`` tokens a second
    client's request takes the row that wrote least at the very next boundary, and the handed-back answer
    later continues token for token as it would have alone."""
    alone = hand(max_batch_size=1)
    reference = alone.submit(ask("red", 40, "flooder"))
    alone.until(lambda: reference.done)
    run = hand(max_batch_size=2)
    engine = run.engine
    flood = [run.submit(ask(c, 40, "flooder")) for c in ("red", "green")]
    run.step()  # both rows: their prefill's token and one step's
    visitor = run.submit(ask("blue", 10, "visitor"))
    run.step(PREEMPT_AFTER - 2)  # each row has now written PREEMPT_AFTER tokens; until now too new to hand back
    assert engine.preemptions == 0 and visitor.token_ids == []
    assert [len(h.token_ids) for h in flood] == [PREEMPT_AFTER] * 2
    run.step()  # this boundary hands one back and admits the visitor
    assert engine.preemptions == 1 and len(visitor.token_ids) == 2
    running = {row.request.rid for row in engine.rows.rows}
    assert running == {flood[1].rid, visitor.rid}  # of two equal rows, the first in the batch went back
    assert engine.scheduler.depth == 1
    run.until(lambda: visitor.done)
    assert len(visitor.token_ids) == 10
    run.until(lambda: all(h.done for h in flood))
    assert [len(h.token_ids) for h in flood] == [40, 40]
    assert flood[0].token_ids == reference.token_ids, "the handed-back answer did not continue exactly"
    assert flood[0].result().text == reference.result().text
    assert "".join(flood[0].stream(timeout=1)) == flood[0].result().text, "a resumed answer repeated or lost text"


def test_the_token_budget_holds_newcomers_back_until_a_row_leaves(hand, worker) -> None:
    """``--kv-token-budget``: a newcomer whose prompt would take the cached tokens past it waits, and joins at the
    boundary after a row leaves."""
    probe = hand()
    prompt = probe.engine.make_request(ask("red", 1)).input_tokens
    run = hand(max_batch_size=3, kv_token_budget=prompt + prompt // 2)
    first, second = run.submit(ask("red", 8)), run.submit(ask("green", 8))
    run.step()
    assert len(run.engine.rows) == 1 and second.token_ids == []
    run.step(6)
    assert first.done and second.token_ids == []
    run.step()
    assert len(second.token_ids) == 2


def test_think_harder_forks_its_candidates_before_newcomers_join(hand) -> None:
    """A search's candidates take the free rows first (an answer in progress); a plain newcomer waits for a row."""
    run = hand(max_batch_size=3)
    think = SamplingParams(60, 0.0, reasoning=STAGE_BEAM, beams=3)
    search = run.submit(door(solid_image("red", 40, 40), "Describe this picture in detail.", think))
    run.step()  # the search's prompt is prefilled and kept aside; no row runs yet
    assert len(run.engine.rows) == 0 and len(run.engine.beams) == 1
    plain = run.submit(ask("green", 5))
    run.step()  # the three candidates fork at this boundary, before the newcomer
    assert len(run.engine.rows) == 3 and all(row.beam is not None for row in run.engine.rows.rows)
    assert plain.token_ids == [] and run.engine.scheduler.depth == 1
    run.until(lambda: search.done and plain.done)
    assert len(plain.token_ids) == 5 and search.result().finish_reason in ("stop", "length")
