"""The response cache: a deterministic request asked again is answered from memory, in milliseconds.

The example gallery's images are asked the same questions again and again, and scripts retry. A request
whose answer cannot change — greedy, or sampled with a seed the caller chose (Think harder only with a
chosen seed: its candidates always sample) — is keyed by everything that decides its answer (the model,
the picture's digest, the question, every sampling parameter and the reasoning mode). A hit replays the
stored answer through the ordinary :class:`~vlm_demo.stream.Stream` path, so the page fills its four
panels as for any answer, and says it came from the cache. An unseeded sampled request never hits. The
cache holds finished answers only (not stopped or failed ones), least recently used first out, bounded
in bytes (``--response-cache-mb``; 0 turns it off).

It wraps any backend (the engine process, the engine in this process, a remote Triton), in the web
process: one cache per web replica.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

from vlm_demo.backends.base import Backend, Features, Health
from vlm_demo.errors import DemoError
from vlm_demo.request import KNOBS, NORMAL, ValidRequest
from vlm_demo.results import GenerationResult
from vlm_demo.stream import Listener, Listeners, OutputStream, Stream

Key = tuple[object, ...]


def cache_key(model: str, request: ValidRequest) -> Key | None:
    """What decides the answer, or ``None`` when it is not repeatable (or the picture has no digest)."""
    p = request.params
    if not p.repeatable or not request.image_key:
        return None
    seed = None if p.greedy and p.reasoning == NORMAL else p.seed
    fields = tuple(seed if name == "seed" else getattr(p, name) for name in KNOBS)  # every sampling field
    return (model, request.image_key, request.question, request.history, *fields)


def _size(key: Key, result: GenerationResult) -> int:
    """Bytes an entry costs, roughly: its texts (the candidates' too)."""
    beam = 0 if result.beam is None else sum(len(t) for s in result.beam.stages for t in (*s.candidates, *s.judgements))
    return len(result.text.encode()) + beam + len(str(key)) + 256  # the key holds the earlier turns' text


class ResponseCache:
    """A byte-bounded LRU of finished answers (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Key, tuple[GenerationResult, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Key) -> GenerationResult | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Key, result: GenerationResult) -> None:
        size = _size(key, result)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (result, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)


class Replay(OutputStream):
    """A cached answer as a stream: its whole text, then its result, at once."""

    def __init__(self, result: GenerationResult) -> None:
        super().__init__()
        self._send(result.text)
        self._end(result, None)


class CachingBackend:
    """A backend with the response cache in front of it; everything else goes straight through."""

    def __init__(self, inner: Backend, max_bytes: int) -> None:
        self.inner = inner
        self.cache = ResponseCache(max_bytes)
        self.listeners = Listeners()
        self.name, self.model, self.remote = inner.name, inner.model, inner.remote

    @property
    def notice(self) -> str | None:
        return self.inner.notice

    @property
    def features(self) -> Features:
        return self.inner.features

    def submit(self, request: ValidRequest) -> Stream:
        key = cache_key(self.model, request)
        found = self.cache.get(key) if key is not None else None
        if found is not None:
            return self._replay(found)
        stream = self.inner.submit(request)
        if key is not None:
            stream.add_done_callback(lambda done: self._keep(key, done))
        return stream

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        """Hits answered here; the misses go to the backend together (they batch there), and are kept."""
        keys = [cache_key(self.model, item) for item in items]
        found = [self.cache.get(key) if key is not None else None for key in keys]
        misses = [i for i, hit in enumerate(found) if hit is None]
        fresh = iter(self.inner.run_batch([items[i] for i in misses]) if misses else [])
        results: list[GenerationResult | DemoError] = []
        for key, hit in zip(keys, found, strict=True):
            if hit is not None:
                results.append(self._replay(hit).result(0))
                continue
            result = next(fresh)
            if key is not None and isinstance(result, GenerationResult) and result.finish_reason in ("stop", "length"):
                self.cache.put(key, result)
            results.append(result)
        return results

    def _replay(self, found: GenerationResult) -> Replay:
        replay = Replay(dataclasses.replace(found, cached=True, batch_size=0, queue_s=0.0, ttft_s=0.0, total_s=0.0))
        self.listeners.on_request_done(replay)
        return replay

    def _keep(self, key: Key, stream: Stream) -> None:
        if stream.error is None and stream.finish_reason in ("stop", "length"):
            self.cache.put(key, stream.result(0))

    def health(self) -> Health:
        health = self.inner.health()
        return dataclasses.replace(
            health,
            response_cache_hits=self.cache.hits,
            response_cache_misses=self.cache.misses,
            response_cache_entries=len(self.cache),
        )

    def add_listener(self, listener: Listener) -> None:
        self.listeners.add(listener)
        self.inner.add_listener(listener)

    def pids(self) -> dict[str, int]:
        return self.inner.pids()

    def close(self) -> None:
        self.inner.close()
