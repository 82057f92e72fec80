"""Which waiting requests run together, and when.

Fair share: waiting requests queue per client (the visitor's address, an API key; requests without one
share the anonymous client ``""``), and clients take turns: each admission goes to the next client in
rotation, so one client with 30 waiting answers gets every other free row while another client waits,
not all of them. Within a client, requests keep their arrival order. (The continuous engine also gives
a waiting client back its share of the running rows: see ``ContinuousEngine._preempt``.)

Policy (dynamic batching): when the worker asks for work, take up to ``max_batch_size`` waiting
requests in turn. If fewer are waiting, wait for company at most ``batch_window_s``, counted from when
the batch could first start (the worker became free, or the first request arrived, whichever is later),
then go with what is there. Counting from that moment rather than from the oldest arrival matters
under load: clients whose answers just finished send their next request a few milliseconds later, and
without the pause the batches split into two half-full groups that alternate for ever (measured: mean
batch 4.0 of 8 at concurrency 8). The queue is bounded: past ``max_queue`` a request is refused
immediately, so a burst never turns into an unbounded wait.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator

from vlm_demo.engine.request import Request
from vlm_demo.errors import EngineStoppedError, QueueFullError


class FairQueue:
    """Per-client FIFO queues served in rotation (not thread-safe: the scheduler holds its lock)."""

    def __init__(self) -> None:
        self._queues: dict[str, collections.deque[Request]] = {}
        self._turn: collections.deque[str] = collections.deque()  # clients with waiting requests, next first
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def append(self, request: Request) -> None:
        client = request.client
        if client not in self._queues:
            self._queues[client] = collections.deque()
            self._turn.append(client)
        self._queues[client].append(request)
        self._size += 1

    def appendleft(self, request: Request, first: bool = True) -> None:
        """Back at the head of its client's queue; ``first``: that client also takes the next turn."""
        client = request.client
        if client not in self._queues:
            self._queues[client] = collections.deque()
            self._turn.append(client)
        if first:
            self._turn.remove(client)
            self._turn.appendleft(client)
        self._queues[client].appendleft(request)
        self._size += 1

    def peek(self) -> Request | None:
        """The request whose turn it is."""
        return self._queues[self._turn[0]][0] if self._turn else None

    def popleft(self) -> Request:
        client = self._turn.popleft()
        queue = self._queues[client]
        request = queue.popleft()
        if queue:
            self._turn.append(client)
        else:
            del self._queues[client]
        self._size -= 1
        return request

    def prune(self) -> None:
        """Drop requests that ended while waiting (cancelled)."""
        for client in list(self._queues):
            queue = self._queues[client]
            if any(r.done for r in queue):
                kept = collections.deque(r for r in queue if not r.done)
                self._size -= len(queue) - len(kept)
                if kept:
                    self._queues[client] = kept
                else:
                    del self._queues[client]
                    self._turn.remove(client)

    def clients(self) -> list[str]:
        """Clients with waiting requests, in turn order."""
        return list(self._turn)

    def oldest_arrival(self) -> float:
        return min(queue[0].arrival for queue in self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        """The order they would be admitted in if nobody else came: the clients' queues interleaved."""
        queues = [list(self._queues[client]) for client in self._turn]
        for depth in range(max((len(q) for q in queues), default=0)):
            for queue in queues:
                if depth < len(queue):
                    yield queue[depth]

    def drain(self) -> list[Request]:
        left = list(self)
        self._queues.clear()
        self._turn.clear()
        self._size = 0
        return left


class Scheduler:
    def __init__(self, max_batch_size: int, batch_window_s: float, max_queue: int) -> None:
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.max_queue = max_queue
        self.waiting = FairQueue()
        self._cond = threading.Condition()
        self._closed = False
        self._free_since: float | None = None  # when the worker last asked for work and got none yet

    @property
    def depth(self) -> int:
        """Requests waiting for a batch (cancelled ones are dropped lazily, so prune first)."""
        with self._cond:
            self.waiting.prune()
            return len(self.waiting)

    def snapshot(self) -> list[Request]:
        """The waiting requests in admission order (for queue positions; safe from any thread)."""
        with self._cond:
            return list(self.waiting)

    def clients_waiting(self) -> list[str]:
        with self._cond:
            self.waiting.prune()
            return self.waiting.clients()

    def add(self, request: Request) -> None:
        """Enqueue, or refuse at once when full or closed."""
        with self._cond:
            if self._closed:
                raise EngineStoppedError("The server is shutting down; please try again shortly.")
            self.waiting.prune()
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(
                    f"Server busy: {len(self.waiting)} requests are already waiting. Please try again in a moment."
                )
            self.waiting.append(request)
            self._cond.notify_all()

    def next_batch(self, timeout: float | None = None) -> list[Request]:
        """Block until a batch is due; return it (empty on timeout or close)."""
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._free_since is None:  # kept across calls that time out empty
                self._free_since = time.monotonic()
            while True:
                self.waiting.prune()
                if self._closed:
                    return []
                if self.waiting:
                    due = max(self.waiting.oldest_arrival(), self._free_since) + self.batch_window_s
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
            self.waiting.prune()
            if not self.waiting and not self._closed:
                self._cond.wait(timeout)
                self.waiting.prune()
            return bool(self.waiting) and not self._closed

    def admit(self, free_rows: int, fits: Callable[[Request], bool], alone: bool = False) -> list[Request]:
        """Continuous mode: at a step boundary, take waiting requests in turn while their rows (a
        stage-beam search takes one per candidate) fit the free rows and ``fits`` says the cache
        budget allows. No overtaking: a large request whose turn it is is not starved by small ones
        behind it. ``alone`` (nothing is running) admits the next one even if it wants more rows
        than are free, or it could never run."""
        taken: list[Request] = []
        used = 0
        with self._cond:
            self.waiting.prune()
            while self.waiting:
                head = self.waiting.peek()
                assert head is not None
                need = head.rows_needed
                if used + need > free_rows and not (alone and not taken):
                    break
                if not fits(head):
                    break
                taken.append(self.waiting.popleft())
                used += need
        return taken

    def requeue_front(self, requests: list[Request], first: bool = True) -> None:
        """Put requests back at the head of their clients' queues, ahead of newer arrivals (after an
        out-of-memory step: ``first``, their clients go next; preempted rows: they wait their turn)."""
        with self._cond:
            for request in reversed(requests):
                if not request.done:
                    self.waiting.appendleft(request, first)
            self._cond.notify_all()

    def wake(self) -> None:
        """Interrupt a blocked ``next_batch`` (e.g. a cancellation changed the queue)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> list[Request]:
        """Stop handing out batches; return the requests still waiting so the engine can fail them."""
        with self._cond:
            self._closed = True
            left = self.waiting.drain()
            self._cond.notify_all()
            return left
