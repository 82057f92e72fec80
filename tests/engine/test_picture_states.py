"""A newcomer's picture states from one place (``engine/executor/picture_states.py``): the request's own, the
image-state cache's, or the tower's, each missing picture once; the cache counts hits and misses as before."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_demo.engine.executor.picture_states import PictureStates
from vlm_demo.engine.kv.image_cache import ImageStates


@dataclass
class Asks:
    """What ``PictureStates`` reads of a request."""

    image_key: str
    vision: torch.Tensor | None = None
    inputs: dict[str, Any] = field(default_factory=lambda: {"pixel_values": torch.zeros(1)})


class Tower:
    """Counts the pictures it encodes; each picture's states are its key's length, so they can be told apart."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def __call__(self, inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        self.encoded += [x["key"] for x in inputs]
        return [torch.full((1, 2, 2), float(len(x["key"]))) for x in inputs]


def asks(key: str) -> Asks:
    return Asks(key, inputs={"pixel_values": torch.zeros(1), "key": key})


def test_each_missing_picture_runs_the_tower_once_and_the_cache_keeps_it() -> None:
    tower, cache = Tower(), ImageStates(1 << 20)
    pictures = PictureStates(tower, cache)
    rows = [asks("aa"), asks("b"), asks("aa")]
    states = pictures.for_rows(rows)
    assert tower.encoded == ["aa", "b"] and [float(s[0, 0, 0]) for s in states] == [2.0, 1.0, 2.0]
    assert (cache.hits, cache.misses, len(cache)) == (0, 2, 2)  # one lookup per picture, not per row
    again = pictures.for_rows([asks("b"), asks("c")])
    assert tower.encoded == ["aa", "b", "c"] and float(again[0][0, 0, 0]) == 1.0
    assert (cache.hits, cache.misses) == (1, 3)


def test_states_encoded_ahead_are_the_requests_own_and_the_caches() -> None:
    tower, cache = Tower(), ImageStates(1 << 20)
    pictures = PictureStates(tower, cache)
    waiting, other = asks("dd"), asks("eee")
    assert not pictures.ready(waiting)
    pictures.encoded([waiting], torch.ones(1, 2, 2), reserve=0)
    assert pictures.ready(waiting) and waiting.vision is not None and cache.holds("dd")
    assert (cache.hits, cache.misses) == (0, 0)  # a look is not a lookup
    states = pictures.for_rows([waiting, other])
    assert tower.encoded == ["eee"] and float(states[0][0, 0, 0]) == 1.0
    assert (cache.hits, cache.misses) == (0, 1)  # its own states first: the cache is not asked for them


def test_without_a_cache_the_tower_gives_every_missing_picture() -> None:
    tower = Tower()
    pictures = PictureStates(tower)
    assert pictures.ready(Asks("", inputs={}))  # no picture: nothing to encode
    states = pictures.for_rows([asks("f"), asks("f")])
    assert tower.encoded == ["f"] and len(states) == 2
