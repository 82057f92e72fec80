"""Newcomers admitted without stalling the running rows (``engine/scheduling/pacing.py``, ``engine/scheduling/lookahead.py``): the
engine driven by hand on the tiny model with the pacer's figures fixed, so every count is exact."""

from __future__ import annotations

import dataclasses

import pytest
from support import Stepper, door

from vlm_demo.config import Config
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.scheduling.pacing import Pacer
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import SamplingParams


def forced(tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)


def ask(colour: str, size: tuple[int, int], tokens: int, client: str) -> object:
    valid = door(solid_image(colour, *size), "Describe this picture in detail.", forced(tokens))
    return dataclasses.replace(valid, client=client)


@pytest.fixture
def paced(worker):
    """``paced(**config)``: a never-started continuous engine whose pacer has fixed figures: a decode step of
    1 s, a tile-layer of the tower 0.125 s (8 tile-layers a step: one layer of two 4-tile pictures), a prompt
    token 10 s (one newcomer a step)."""
    made = []

    def make(**settings) -> Stepper:
        engine = ContinuousEngine(worker, Config(batching="continuous", max_batch_size=4, **settings))
        engine.pacer.learn = False
        engine.pacer.decode_s.append(1.0)
        engine.pacer.cost.update(vision=0.125, prompt=10.0)
        made.append(engine)
        return Stepper(engine)

    yield make
    for engine in made:
        engine.shutdown()


def test_the_allowance_is_a_share_of_a_decode_step_and_only_while_rows_run() -> None:
    pacer = Pacer(share=0.5)
    assert pacer.allowance(running=3) is None  # nothing measured yet: nothing held back
    pacer.decode_step(0.02)
    pacer.decode_step(0.04)
    pacer.decode_step(0.03)
    assert pacer.allowance(running=3) == pytest.approx(0.015)  # half the median step
    assert pacer.allowance(running=0) is None  # nobody waits on it
    assert Pacer(share=0.0).allowance(running=3) is None  # --prefill-share 0: at once, as before
    assert pacer.units("vision", 0.015) == 1  # unmeasured work goes one unit at a time
    with pacer.timed("vision", 4):
        pass
    assert pacer.cost["vision"] > 0 and pacer.units("vision", 1e9) > 1


def test_pictures_go_through_the_tower_a_layer_a_step_and_newcomers_join_one_a_step(paced, worker) -> None:
    """One row decodes; three newcomers arrive (two 4-tile pictures, one 1-tile). The two 4-tile pictures run
    the tiny tower's 3 layers together, one a step, while the row gets a token every step; then one newcomer
    joins per step, each as soon as its picture is ready, in arrival order."""
    run = paced()
    engine = run.engine
    tower_layers = len(worker.tower.transformer.layers) + len(worker.tower.global_transformer.layers)
    assert tower_layers == 3
    first = run.submit(ask("red", (40, 40), 60, "a"))
    run.step()  # nothing ran: admitted at once, its first two tokens
    assert len(first.token_ids) == 2
    big = [run.submit(ask(c, (40, 40), 10, c)) for c in ("green", "blue")]
    small = run.submit(ask("white", (16, 16), 10, "white"))
    encodes = worker.vision_encodes
    layers = []
    for _ in range(3):
        run.step()
        layers.append(engine.lookahead.job.layer if engine.lookahead.job is not None else None)
        assert all(not h.token_ids for h in [*big, small])  # their pictures are still in the tower
    assert layers == [1, 2, None]  # one layer a step; the third finished the job
    assert worker.vision_encodes - encodes == 2 and all(r.vision is not None for r in engine.scheduler.snapshot()[:2])
    assert len(first.token_ids) == 2 + 3  # it never missed a step
    joined = []
    for _ in range(3):
        run.step()
        joined.append([len(h.token_ids) for h in [*big, small]])
    # step 4: green joins (its prompt is the step's one); the 1-tile picture runs its 3 tile-layers meanwhile
    assert joined == [[2, 0, 0], [3, 2, 0], [4, 3, 2]]
    assert worker.vision_encodes - encodes == 3
    assert len(first.token_ids) == 2 + 6
    assert all(row.request.vision is None for row in engine.rows.rows)  # the states live in the pages now
    run.until(lambda: first.done and small.done)


def test_a_lone_request_is_prefilled_at_once(paced) -> None:
    run = paced()
    handle = run.submit(ask("red", (40, 40), 10, "a"))
    run.step()
    assert len(handle.token_ids) == 2  # as without pacing: its prefill's token and the step's


def test_without_pacing_newcomers_are_prefilled_at_the_next_boundary(paced) -> None:
    run = paced(prefill_share=0.0)
    first = run.submit(ask("red", (40, 40), 60, "a"))
    run.step()
    late = [run.submit(ask(c, (40, 40), 10, c)) for c in ("green", "blue")]
    run.step()
    assert [len(h.token_ids) for h in late] == [2, 2] and run.engine.lookahead.job is None
    assert len(first.token_ids) == 3
