"""Which waiting requests run together, and when.

Continuous mode asks :meth:`Scheduler.plan` at every step boundary what to do — preempt, fork a
search's candidates, admit newcomers — and only executes it; every decision of that kind is here.

Fair share: waiting requests queue per client (the visitor's address, an API key; requests without one
share the anonymous client ``""``), and clients take turns: each admission goes to the next client in
rotation, so one client with 30 waiting answers gets every other free row while another client waits,
not all of them. Within a client, requests keep their arrival order. In continuous mode a waiting client
also gets its share of the running rows back (``plan``: preemption).

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from vlm_demo.engine.batching.job import Request, Search
from vlm_demo.errors import EngineStoppedError, QueueFullError

PREEMPT_AFTER = 8  # a row that joined less than this many tokens ago is not handed back (no thrashing)


@dataclass(frozen=True)
class RowState:
    """What the plan knows of a running row."""

    client: str
    written: int  # tokens it has written
    movable: bool  # a plain answer (a search's rows are not handed back)
    count_pages: Callable[[], int]  # the pages it would give back by leaving (counted only when a plan asks)

    @property
    def pages(self) -> int:
        return self.count_pages()


@dataclass
class Room:
    """The running batch's room at a step boundary."""

    rows: int  # rows running
    rows_allowed: int
    free_pages: int
    cache_pages: int  # pages the image-state cache holds (it gives them back when asked)
    pages_next_step: int  # pages the running rows take at the next step (those opening a page)
    pages_for: Callable[[Request], int]  # a newcomer's pages (its prompt and its picture's tiles)
    cached_tokens: int = 0  # text tokens the rows hold, for ``token_budget``
    token_budget: int = 0  # --kv-token-budget (0: none)
    ready: Callable[[Request], bool] | None = None  # paced: whether a newcomer's picture is through the tower
    prefill_tokens: int | None = None  # paced: prompt tokens this step may prefill beyond its first newcomer


S = TypeVar("S", bound=Search)  # the searches the engine runs (``StageBeam``), handed back in ``forks``


@dataclass
class Plan(Generic[S]):
    """What the continuous engine does at this step boundary, in this order."""

    suspend: list[int] = field(default_factory=list)  # rows handed back to the queue (they resume later)
    forks: list[tuple[S, int]] = field(default_factory=list)  # (search, candidate rows to fork)
    admit: list[Request] = field(default_factory=list)  # newcomers to prefill and join
    evict_pages: int = 0  # pages the image-state cache gives back first (memory pressure)
    short: bool = False  # the next step lacks pages even after handing back every plain row


class FairQueue:
    """Per-client FIFO queues served in rotation (not thread-safe: the scheduler holds its lock)."""

    def __init__(self) -> None:
        self._queues: dict[str, collections.deque[Request]] = {}
        self._turn: collections.deque[str] = collections.deque()  # clients with waiting requests, next first
        self._size = 0
        self.changes = 0  # bumped whenever a request comes or goes (queue positions move)

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
        self.changes += 1

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
        self.changes += 1

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
        self.changes += 1
        return request

    def prune(self) -> None:
        """Drop requests that ended while waiting (cancelled)."""
        for client in list(self._queues):
            queue = self._queues[client]
            if any(r.done for r in queue):
                kept = collections.deque(r for r in queue if not r.done)
                self._size -= len(queue) - len(kept)
                self.changes += 1
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

    def plan(self, room: Room, rows: Callable[[], list[RowState]], searches: Sequence[S]) -> Plan[S]:
        """Decide this step boundary: rows handed back (the next step's pages, then each waiting client's
        share), searches' candidates forked (before any newcomer: they are answers in progress), then
        newcomers admitted while rows and pages allow; the image-state cache gives back the pages all that
        takes beyond the free ones. ``rows`` is asked only when a decision needs it."""
        plan: Plan[S] = Plan()
        free_rows = room.rows_allowed - room.rows
        free, available = room.free_pages, room.free_pages + room.cache_pages
        states: list[RowState] | None = None
        if available < room.pages_next_step:
            states = rows()
            plan.suspend, freed = _make_room(states, room.pages_next_step - available)
            plan.short = available + freed < room.pages_next_step
            free, available, free_rows = free + freed, available + freed, free_rows + len(plan.suspend)
        waiting = self.clients_waiting()
        if free_rows <= 0 and waiting:
            states = states if states is not None else rows()
            more = self._fair_share(states, waiting, room.rows_allowed, set(plan.suspend))
            freed = sum(states[i].pages for i in more)
            plan.suspend += more
            free, available, free_rows = free + freed, available + freed, free_rows + len(more)
        used = room.pages_next_step
        spare = not waiting  # nobody waits: a search may write its next stage ahead
        for search in searches:
            wanted = search.rows_wanted(spare)
            take = min(wanted, free_rows, max(0, available - used))
            if not wanted or (take <= 0 and search.speculating):
                continue  # a guess takes only rows nobody wants, and never blocks other forks
            if take <= 0:
                break  # a search waits for rows: newcomers wait too
            plan.forks.append((search, take))
            free_rows -= take
            used += take  # each candidate's own last page
            if take < wanted and not search.speculating:
                break
        else:
            if free_rows > 0 and waiting:
                used += self._admit_into(plan, room, free_rows, available - used)
        plan.evict_pages = max(0, used - free)
        return plan

    def _admit_into(self, plan: Plan[Any], room: Room, free_rows: int, pages: int) -> int:
        """Admit newcomers in turn while rows and ``pages`` allow, each running row keeping a page of headroom
        to grow into (a lone request always goes in), and while rows decode (``room.ready``) only those whose
        picture is ready, within the step's prompt tokens (the first one always); returns the pages they take."""
        running = room.rows - len(plan.suspend) + sum(n for _, n in plan.forks)
        tokens, taken, prefilled, count = room.cached_tokens, 0, 0, 0

        def fits(request: Request) -> bool:
            nonlocal running, tokens, taken, prefilled, count
            need = room.pages_for(request)
            lone = running == 0 and not count
            over_tokens = 0 < room.token_budget < tokens + request.input_tokens * request.rows_needed
            if not lone and (pages - taken - need < running + request.rows_needed or over_tokens):
                return False
            if not lone and room.ready is not None and not room.ready(request):
                return False  # its picture is still in the tower: it (and everyone behind it) waits
            paced = room.prefill_tokens is not None and count > 0
            if paced and prefilled + request.input_tokens > room.prefill_tokens:  # type: ignore[operator]
                return False
            taken += need
            running += request.rows_needed
            tokens += request.input_tokens * request.rows_needed
            prefilled += request.input_tokens
            count += 1
            return True

        plan.admit = self.admit(free_rows, fits, alone=running == 0)
        return taken

    def _fair_share(self, rows: list[RowState], waiting: list[str], allowed: int, taken: set[int]) -> list[int]:
        """Each waiting client's share of the rows: a client holding more than ``rows ÷ clients`` gives back
        the rows that wrote least (cheapest to resume). A search's rows stay."""
        held: dict[str, int] = {}
        movable: dict[str, list[int]] = {}
        for index, row in enumerate(rows):
            if index in taken:
                continue
            held[row.client] = held.get(row.client, 0) + 1
            if row.movable and row.written >= PREEMPT_AFTER:
                movable.setdefault(row.client, []).append(index)
        share = max(1, allowed // len(set(held) | set(waiting)))
        victims: list[int] = []
        for client in waiting:
            if held.get(client, 0) >= share:
                continue
            over = [c for c, n in held.items() if n > share and movable.get(c)]
            if not over:
                break
            donor = max(over, key=lambda c: held[c])
            victims.append(min(movable[donor], key=lambda i: rows[i].written))
            movable[donor].remove(victims[-1])
            held[donor] -= 1
            held[client] = held.get(client, 0) + 1
        return victims

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


def _make_room(rows: list[RowState], pages: int) -> tuple[list[int], int]:
    """Plain rows to hand back until ``pages`` are free, those that wrote least first (cheapest to resume)."""
    order = sorted((i for i, r in enumerate(rows) if r.movable), key=lambda i: rows[i].written)
    chosen, freed = [], 0
    for index in order:
        if freed >= pages:
            break
        chosen.append(index)
        freed += rows[index].pages
    return chosen, freed
