"""How much of the newcomers' prefill work a step may do beside the running rows.

Prefilling newcomers in the engine thread before a step's decode stalls every running row for as long as it
takes: eight 4-tile newcomers at once held 210 rows for ~14 decode steps at 11B (estimated), and a visitor
saw the panels freeze whenever others arrived. So while rows decode, a step does at most ``--prefill-share``
× one decode step's time of prefill work: some layers of the vision tower for the pictures of the requests
waiting next (:mod:`~vlm_demo.engine.scheduling.lookahead`), and the prompts of newcomers whose pictures are ready. A
running row's next token then waits about ``1 + share`` steps' time at most. With no row running nothing is
held back: a lone request's first token comes as soon as before.

The decode step's time and each kind of work's cost (seconds per tile-layer of the tower, per prompt token)
are measured as the engine runs, at the step's host reads (the device is synchronised around timed work), so
one setting holds on a CPU and on any GPU. Nothing is skipped for want of a figure: unmeasured work goes one
unit at a time until it is measured.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DECODE_SAMPLES = 32  # recent decode-only steps whose median is "one decode step"
SMOOTHING = 0.5  # weight of a new measurement in a work kind's cost


class Pacer:
    """The prefill allowance per step and the costs it is computed from (the engine thread's)."""

    def __init__(self, share: float, synchronize: Callable[[], None] = lambda: None) -> None:
        self.share = share
        self.synchronize = synchronize
        self.decode_s: deque[float] = deque(maxlen=DECODE_SAMPLES)
        self.cost: dict[str, float] = {}  # work kind ("vision": per tile-layer, "prompt": per token) -> seconds
        self.learn = True  # tests fix the figures instead

    @property
    def step_s(self) -> float | None:
        """One decode step's time (the median of the recent ones), once measured."""
        return statistics.median(self.decode_s) if self.decode_s else None

    def allowance(self, running: int) -> float | None:
        """Seconds of prefill work this step may do; ``None``: no limit (no row waits on it, pacing is off, or
        no decode step was measured yet)."""
        step = self.step_s
        if self.share <= 0 or running == 0 or step is None:
            return None
        return self.share * step

    def units(self, kind: str, seconds: float, at_least: int = 1) -> int:
        """How many units of ``kind`` fit in ``seconds`` (at least ``at_least``; all of them at least once
        measured before)."""
        cost = self.cost.get(kind)
        if not cost:
            return at_least
        return max(at_least, int(seconds / cost))

    def decode_step(self, seconds: float) -> None:
        """A step that decoded and did no prefill work took ``seconds``."""
        if self.learn:
            self.decode_s.append(seconds)

    @contextmanager
    def timed(self, kind: str, units: int) -> Iterator[list[float]]:
        """Time ``units`` of ``kind`` (the device synchronised on both sides; ``kind`` "": timed, not learnt);
        yields a list that holds the seconds afterwards."""
        spent: list[float] = []
        self.synchronize()
        start = time.perf_counter()
        yield spent
        self.synchronize()
        spent.append(time.perf_counter() - start)
        if self.learn and kind and units > 0:
            per = spent[0] / units
            old = self.cost.get(kind)
            self.cost[kind] = per if old is None else (1 - SMOOTHING) * old + SMOOTHING * per
