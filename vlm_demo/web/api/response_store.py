"""The stored responses of ``/v1/responses``: what ``GET``/``DELETE /v1/responses/{id}`` read and what a
follow-up by ``previous_response_id`` continues.

In this process's memory, bounded three ways, and lost on a restart (a follow-up then gets a 404, as after the
time limit): each response is kept at most :data:`TTL_S` after it was made, at most :data:`MAX_RESPONSES` of them,
and at most :data:`MAX_BYTES` in all, counting each one's picture as sent (a data URL's text, a fetched file's
bytes) and its texts; past a bound the oldest go first. Each belongs to whoever made it (a digest of the API key
it was made with, when the server has ``--api-key``): another key finds nothing, as if it never existed.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TTL_S = 3600.0  # an hour: a conversation's follow-ups come within minutes; memory is not a database
MAX_RESPONSES = 1000
MAX_BYTES = 256 << 20  # pictures included: a few hundred phone photos, or thousands of small pictures


@dataclass(frozen=True)
class Thread:
    """What a follow-up continues: the picture as it was sent, the system texts, the turns so far (each the
    question and the answer's CONCLUSION, as a client replaying the output would send them)."""

    image: Any  # what load_image reads: {"url": data URL} or the fetched file's bytes
    system: tuple[str, ...]
    turns: tuple[tuple[str, str], ...]

    def size(self) -> int:
        image = self.image.get("url", "") if isinstance(self.image, dict) else self.image
        return len(image) + sum(len(t) for t in self.system) + sum(len(q) + len(a) for q, a in self.turns)


@dataclass(frozen=True)
class Stored:
    owner: str
    body: dict[str, Any]  # the response object as GET returns it
    thread: Thread
    size: int
    expires: float


class ResponseStore:
    """Responses by id, each visible to its owner only; safe to call from any thread."""

    def __init__(
        self,
        ttl_s: float = TTL_S,
        max_responses: int = MAX_RESPONSES,
        max_bytes: int = MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.max_responses, self.max_bytes, self.clock = ttl_s, max_responses, max_bytes, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, owner: str, body: dict[str, Any], thread: Thread) -> None:
        """Keep ``body`` (its ``id`` names it) and its thread; the oldest make room. One larger than the whole
        store is not kept."""
        size = thread.size() + len(json.dumps(body))
        if size > self.max_bytes:
            return
        with self._lock:
            self._expire()
            while self._items and (len(self._items) >= self.max_responses or self._bytes + size > self.max_bytes):
                self._drop(next(iter(self._items)))
            self._items[body["id"]] = Stored(owner, body, thread, size, self.clock() + self.ttl_s)
            self._bytes += size

    def get(self, owner: str, response_id: str) -> Stored | None:
        """The response ``response_id`` if ``owner`` made it and it has not expired."""
        with self._lock:
            self._expire()
            found = self._items.get(response_id)
            return found if found is not None and found.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            found = self._items.get(response_id)
            if found is None or found.owner != owner or found.expires <= self.clock():
                return False
            self._drop(response_id)
            return True

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _expire(self) -> None:
        now = self.clock()
        while self._items and next(iter(self._items.values())).expires <= now:
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        self._bytes -= self._items.pop(response_id).size
