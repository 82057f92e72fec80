"""Which waiting requests run together, and when.

Policy (dynamic batching): when the worker asks for work, take up to ``max_batch_size`` waiting
requests in arrival order. If fewer are waiting, wait for company at most ``batch_window_s``,
counted from when the batch could first start (the worker became free, or the first request
arrived, whichever is later), then go with what is there. Counting from that moment rather than
from the oldest arrival matters under load: clients whose answers just finished send their next
request a few milliseconds later, and without the pause the batches split into two half-full
groups that alternate for ever (measured: mean batch 4.0 of 8 at concurrency 8).
The queue is bounded: past ``max_queue`` a request is refused immediately, so a burst never turns
into an unbounded wait.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from vlm_demo.engine.request import Request
from vlm_demo.errors import EngineStoppedError, QueueFullError


class Scheduler:
    def __init__(self, max_batch_size: int, batch_window_s: float, max_queue: int) -> None:
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.max_queue = max_queue
        self.waiting: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._free_since: float | None = None  # when the worker last asked for work and got none yet

    @property
    def depth(self) -> int:
        """Requests waiting for a batch (cancelled ones are dropped lazily, so prune first)."""
        with self._cond:
            self._prune()
            return len(self.waiting)

    def add(self, request: Request) -> None:
        """Enqueue, or refuse at once when full or closed."""
        with self._cond:
            if self._closed:
                raise EngineStoppedError("The server is shutting down; please try again shortly.")
            self._prune()
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(
                    f"Server busy: {len(self.waiting)} requests are already waiting. Please try again in a moment."
                )
            self.waiting.append(request)
            self._cond.notify_all()

    def _prune(self) -> None:
        if any(r.done for r in self.waiting):
            self.waiting = collections.deque(r for r in self.waiting if not r.done)

    def next_batch(self, timeout: float | None = None) -> list[Request]:
        """Block until a batch is due; return it (empty on timeout or close)."""
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._free_since is None:  # kept across calls that time out empty
                self._free_since = time.monotonic()
            while True:
                self._prune()
                if self._closed:
                    return []
                if self.waiting:
                    due = max(self.waiting[0].arrival, self._free_since) + self.batch_window_s
                    now = time.monotonic()
                    if len(self.waiting) >= self.max_batch_size or now >= due:
                        self._free_since = None
                        return [self.waiting.popleft() for _ in range(min(self.max_batch_size, len(self.waiting)))]
                    wait = due - now
                else:
                    wait = None
                if give_up is not None:
                    left = give_up - time.monotonic()
                    if left <= 0:
                        return []
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def wait_for_work(self, timeout: float) -> bool:
        """Continuous mode: block until something is waiting (True) or the timeout/close (False)."""
        with self._cond:
            self._prune()
            if not self.waiting and not self._closed:
                self._cond.wait(timeout)
                self._prune()
            return bool(self.waiting) and not self._closed

    def admit(self, free_rows: int, fits: Callable[[Request], bool], alone: bool = False) -> list[Request]:
        """Continuous mode: at a step boundary, take waiting requests in arrival order while their
        rows (a stage-beam search takes one per candidate) fit the free rows and ``fits`` says the
        cache budget allows. No overtaking: a large request at the head is not starved by small
        ones behind it. ``alone`` (nothing is running) admits the head even if it wants more rows
        than are free, or it could never run."""
        taken: list[Request] = []
        used = 0
        with self._cond:
            self._prune()
            while self.waiting:
                need = self.waiting[0].rows_needed
                if used + need > free_rows and not (alone and not taken):
                    break
                if not fits(self.waiting[0]):
                    break
                taken.append(self.waiting.popleft())
                used += need
        return taken

    def requeue_front(self, requests: list[Request]) -> None:
        """Put requests back at the head (after an out-of-memory step), ahead of newer arrivals."""
        with self._cond:
            for request in reversed(requests):
                if not request.done:
                    self.waiting.appendleft(request)
            self._cond.notify_all()

    def wake(self) -> None:
        """Interrupt a blocked ``next_batch`` (e.g. a cancellation changed the queue)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> list[Request]:
        """Stop handing out batches; return the requests still waiting so the engine can fail them."""
        with self._cond:
            self._closed = True
            left = list(self.waiting)
            self.waiting.clear()
            self._cond.notify_all()
            return left
