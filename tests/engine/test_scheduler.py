"""Scheduler policy: batch window, batch limit, bounded queue, cancellation (no model needed)."""

from __future__ import annotations

import threading
import time

import pytest
from support import checked

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.scheduling.scheduler import Scheduler
from vlm_demo.errors import QueueFullError
from vlm_demo.request import SamplingParams


def make() -> Request:
    return Request(image=None, question="q", params=checked(SamplingParams()))


def test_lone_request_waits_for_the_window_then_runs_alone() -> None:
    sched = Scheduler(max_batch_size=4, batch_window_s=0.15, max_queue=10)
    req = make()
    sched.add(req)
    start = time.monotonic()
    batch = sched.next_batch(timeout=2)
    waited = time.monotonic() - start
    assert batch == [req]
    assert 0.1 <= waited < 1.0


def test_full_batch_goes_at_once_without_waiting_for_the_window() -> None:
    sched = Scheduler(max_batch_size=4, batch_window_s=5.0, max_queue=10)
    reqs = [make() for _ in range(5)]
    for r in reqs:
        sched.add(r)
    start = time.monotonic()
    first = sched.next_batch(timeout=2)
    assert time.monotonic() - start < 0.5
    assert first == reqs[:4]  # arrival order, capped at max_batch_size
    assert sched.depth == 1


def test_request_arriving_inside_the_window_joins_the_batch() -> None:
    sched = Scheduler(max_batch_size=4, batch_window_s=0.3, max_queue=10)
    a, b = make(), make()
    sched.add(a)
    threading.Timer(0.05, sched.add, args=(b,)).start()
    assert sched.next_batch(timeout=2) == [a, b]


def test_window_counts_from_when_the_worker_asks_not_from_arrival() -> None:
    """Requests queued while the worker was busy still get one window for company to arrive."""
    sched = Scheduler(max_batch_size=8, batch_window_s=0.2, max_queue=10)
    a, b, c = make(), make(), make()
    a.arrival -= 1.0  # queued long ago, while the worker was busy
    sched.add(a)
    sched.add(b)
    threading.Timer(0.05, sched.add, args=(c,)).start()  # a client whose answer just finished
    start = time.monotonic()
    assert sched.next_batch(timeout=2) == [a, b, c]
    assert time.monotonic() - start < 0.5


def test_queue_full_is_refused_at_once_with_a_clear_message() -> None:
    sched = Scheduler(max_batch_size=2, batch_window_s=0.0, max_queue=2)
    sched.add(make())
    sched.add(make())
    with pytest.raises(QueueFullError, match="Server busy"):
        sched.add(make())


def test_cancelled_waiting_requests_leave_the_queue_and_free_their_place() -> None:
    sched = Scheduler(max_batch_size=4, batch_window_s=0.0, max_queue=2)
    a, b = make(), make()
    sched.add(a)
    sched.add(b)
    a.cancel()
    assert sched.depth == 1
    sched.add(make())  # the cancelled request's place is free again
    batch = sched.next_batch(timeout=1)
    assert a not in batch and b in batch and len(batch) == 2


def test_close_hands_back_waiting_requests_and_unblocks() -> None:
    sched = Scheduler(max_batch_size=4, batch_window_s=10.0, max_queue=4)
    req = make()
    sched.add(req)
    got: list = []
    t = threading.Thread(target=lambda: got.append(sched.next_batch()))
    t.start()
    time.sleep(0.05)
    assert sched.close() == [req]
    t.join(2)
    assert got == [[]]


def test_next_batch_times_out_empty() -> None:
    sched = Scheduler(max_batch_size=4, batch_window_s=0.0, max_queue=4)
    assert sched.next_batch(timeout=0.05) == []


def test_a_window_longer_than_the_poll_timeout_still_lets_a_lone_request_run() -> None:
    """The engine polls with a short timeout; the window must not restart on every poll."""
    sched = Scheduler(max_batch_size=4, batch_window_s=0.3, max_queue=4)
    req = make()
    sched.add(req)
    batches = [sched.next_batch(timeout=0.1) for _ in range(6)]
    assert [req] in batches
