"""Failpoints: make a chosen point of an engine step raise, to test and drill the engine's recovery.

A GPU fails in ways a CPU box never shows (out of memory mid-step, a sticky CUDA error that every later
call repeats), so the recovery code would otherwise run for the first time on a visitor's request.
Off unless ``VLM_FAULTS`` is set (then the engine logs a warning); each point costs one ``None`` check
per step when off.

``VLM_FAULTS="forward:oom@3,host_read:error"`` makes the third decode step's forward raise a
``torch.OutOfMemoryError`` and the first host read a ``RuntimeError``. Points: ``prefill``, ``forward``,
``advance`` (the next inputs on the device), ``host_read`` (the step's one read back to the host, where
asynchronous CUDA errors surface), ``evict`` (finished rows leave the batch) and ``generate`` (a
dynamic batch). Kinds: ``error`` (a plain ``RuntimeError``), ``oom`` and ``device`` (a sticky CUDA
error: ``torch.AcceleratorError``, what an illegal memory access raises), and ``slow`` (no error: the point
waits ``SLOW_S``, so that a test's answers stay in flight long enough whatever the machine's speed —
``forward:slow@1+`` makes every decode step take at least 50 ms). ``@N`` fires at the N-th time
the point is reached (default the first), once; ``@N+`` fires from the N-th time on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

POINTS = ("prefill", "forward", "advance", "host_read", "evict", "generate")
KINDS = ("error", "oom", "device", "slow")
ENV = "VLM_FAULTS"
SLOW_S = 0.05  # what a ``slow`` point waits


def injected(kind: str, point: str) -> Exception:
    """The exception a failpoint raises: what the real fault would raise at that point."""
    where = f"injected at {point} ({ENV})"
    if kind == "oom":
        return torch.OutOfMemoryError(f"CUDA out of memory (fault {where})")
    if kind == "device":
        return torch.AcceleratorError(f"CUDA error: an illegal memory access was encountered (fault {where})")
    return RuntimeError(f"fault {where}")


@dataclass
class Fault:
    point: str
    kind: str
    at: int = 1  # fire at this hit (1-based)
    onwards: bool = False  # ... and at every later one


class FailPoints:
    """The faults planned for one engine; ``hit(point)`` raises when one is due (thread-safe)."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self.hits = dict.fromkeys(POINTS, 0)
        self.fired: list[str] = []  # "point:kind" in the order they fired
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str) -> FailPoints:
        """``point:kind[@N[+]]`` items separated by commas; raises ``ValueError`` naming a bad item."""
        faults = []
        for item in filter(None, (part.strip() for part in spec.split(","))):
            where, _, kind = item.partition(":")
            kind, _, when = kind.partition("@")
            kind = kind or "error"
            if where not in POINTS or kind not in KINDS:
                raise ValueError(f"{ENV}: bad fault {item!r} (points {', '.join(POINTS)}; kinds {', '.join(KINDS)})")
            onwards = when.endswith("+")
            at = int(when.rstrip("+") or 1)
            faults.append(Fault(where, kind, at, onwards))
        return cls(faults)

    def hit(self, point: str) -> None:
        with self._lock:
            self.hits[point] += 1
            count = self.hits[point]
            due = next(
                (f for f in self.faults if f.point == point and (count == f.at or (f.onwards and count > f.at))),
                None,
            )
            if due is None:
                return
            self.fired.append(f"{point}:{due.kind}")
        if due.kind == "slow":
            time.sleep(SLOW_S)
            return
        raise injected(due.kind, point)


def from_env() -> Callable[[str], None] | None:
    """The failpoints ``VLM_FAULTS`` asks for, as a ``hit`` function; ``None`` (nothing to check) when unset."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return None
    points = FailPoints.parse(spec)
    log.warning("%s=%r: this engine will fail on purpose (fault drill)", ENV, spec)
    return points.hit
