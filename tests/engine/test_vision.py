"""The vision tower split at its layers (``engine/executor/vision.py``): ``--vision-tiles all`` is the stock forward bit
for bit however it is chunked; ``real`` runs a picture's real tiles only, equal to the stock forward for a
4-tile picture and not for smaller ones (real tiles attend to padding ones in the stock mask), though the tiny
model answers alike."""

from __future__ import annotations

import pytest
import torch
from support import door

from vlm_demo.config import Config
from vlm_demo.engine.batching.continuous import ContinuousEngine
from vlm_demo.engine.executor.vision import jobs, real_tiles
from vlm_demo.models.tiny import COLOURS, solid_image
from vlm_demo.request import SamplingParams

SHAPES = [(16, 16), (32, 16), (16, 48), (30, 80), (40, 40)]  # 1, 2, 3, 3 and 4 tiles of 16 px


def stock(worker, inputs) -> torch.Tensor:
    """The stock tower's states of a picture's real tiles."""
    tower = worker.tower
    with torch.inference_mode():
        out = tower(inputs["pixel_values"], inputs["aspect_ratio_ids"], inputs["aspect_ratio_mask"]).last_hidden_state
    return out[0, 0, : real_tiles(inputs["aspect_ratio_mask"])[0]]


def pictures(worker) -> list[dict]:
    return [worker.prepare(solid_image(c, w, h, noise=40, seed=i), "Colour?") for i, (c, (w, h)) in
            enumerate(zip(COLOURS, SHAPES, strict=False))]  # fmt: skip


def test_the_shapes_run_the_tiles_they_say(worker) -> None:
    assert [real_tiles(p["aspect_ratio_mask"])[0] for p in pictures(worker)] == [1, 2, 3, 3, 4]


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_all_tiles_is_the_stock_tower_bit_for_bit_however_it_is_chunked(worker, chunk) -> None:
    inputs = pictures(worker)
    ((members, job),) = jobs(worker.tower, inputs, "all")  # every picture runs 4 tiles: one job
    assert members == list(range(len(inputs))) and job.tiles == 4
    steps = 0
    while not job.done:
        job.advance(chunk)
        steps += 1
    assert steps == -(-job.layers // chunk)
    for index, states in enumerate(job.states()):
        real = real_tiles(inputs[index]["aspect_ratio_mask"])[0]
        assert torch.equal(states[:real], stock(worker, inputs[index]))


def test_real_tiles_group_by_tile_count_and_equal_the_stock_tower_for_four_tiles(worker) -> None:
    inputs = pictures(worker)
    made = jobs(worker.tower, inputs, "real")
    assert [(members, job.tiles) for members, job in made] == [([4], 4), ([2, 3], 3), ([1], 2), ([0], 1)]
    for members, job in made:
        job.run()
        for index, states in zip(members, job.states(), strict=True):
            want = stock(worker, inputs[index])
            assert states.shape == want.shape
            if job.tiles == 4:
                assert torch.equal(states, want)
            else:  # the stock mask lets real tiles attend to the padding ones: not equal (measured 7-36 % here)
                difference = ((states - want).norm() / want.norm()).item()
                assert 0 < difference < 0.5, (index, difference)


def test_real_tiles_give_the_tiny_models_stock_answers(worker) -> None:
    """Greedy answers with real tiles only equal those with every tile (the stock computation) on the tiny
    model, for 1-, 2- and 3-tile pictures of every colour."""
    params = SamplingParams(max_new_tokens=120, temperature=0.0)
    answers = {}
    for tiles in ("all", "real"):
        engine = ContinuousEngine(worker, Config(batching="continuous", max_batch_size=8, vision_tiles=tiles))
        engine.start()
        try:
            handles = [engine.submit(door(solid_image(c, w, h), q, params)) for c in COLOURS
                       for (w, h) in SHAPES[:3] for q in ("What colour is this picture?", "Describe it.")]  # fmt: skip
            answers[tiles] = [h.result(timeout=300).text for h in handles]
        finally:
            engine.shutdown()
    assert answers["real"] == answers["all"]
    assert all("</CONCLUSION>" in text for text in answers["real"])
