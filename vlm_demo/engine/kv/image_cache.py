"""The image-state cache: the vision tower's output for recent images, kept by the picture's digest.

On the 11B model one 4-tile image is ~6,400 vision tokens through a 40-layer ViT. The same image comes
back often: a Think-harder answer's judge calls (each judge prompt carries the image again), a follow-up
question, the example gallery, a client asking twice. Here the projected vision output (what every
cross-attention layer turns into its keys and values: 6,404 × 4,096 values, 52 MB in bf16) is kept by
the image's digest and reused, so such a prefill runs the text model only. Least recently used entries
go first. The entries live in pages of the continuous engine's page pool, so the cache and the rows
share one budget: it takes only free pages, and the scheduler's plan has it give pages back
(``evict``) before a row would wait or be handed back for want of them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from vlm_demo.engine.kv.pages import PagePool


@dataclass
class Entry:
    pages: list[int]  # in the pool (empty when the tensor is kept itself)
    shape: torch.Size
    device: torch.device
    size: int  # bytes
    tensor: torch.Tensor | None = None  # when the pool has no arena on its device
    dtype: torch.dtype | None = None  # the states' dtype (the pool keeps their bytes, whatever it stores)


class ImageStates:
    """A byte-bounded LRU of ``[tiles, patches, hidden]`` vision states, kept in the pool's free pages."""

    def __init__(self, max_bytes: int, pool: PagePool | None = None) -> None:
        self.max_bytes = max_bytes
        self.pool = pool
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()  # stats are read from other threads
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def stats(self) -> dict[str, int]:
        """Its figures for ``EngineStats``."""
        return {
            "image_cache_hits": self.hits,
            "image_cache_misses": self.misses,
            "image_cache_bytes": self.bytes,
            "image_cache_entries": len(self._entries),
        }

    @property
    def pages(self) -> int:
        """Pool pages the cache holds (all of them can be given back)."""
        return sum(len(e.pages) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, key: str) -> bool:
        """Whether it has ``key``'s states (a look, not a lookup: no hit or miss counted)."""
        with self._lock:
            return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key) if key else None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        if entry.tensor is not None:
            return entry.tensor
        assert self.pool is not None
        return self.pool.load(entry.pages, entry.shape, entry.device, entry.dtype)

    def put(self, key: str, states: torch.Tensor, reserve: int = 0) -> None:
        """Keep ``states`` (a copy) if they fit under the cap, in free pages only: never the ``reserve`` pages
        rows need (``PageTable.cache_reserve``)."""
        size = states.numel() * states.element_size()
        if not key or size > self.max_bytes or key in self._entries:
            return
        pool = self.pool
        on_pool = pool is not None and pool.holds(states.device)  # its bytes, in an fp8 pool too
        with self._lock:
            while self._entries and self.bytes + size > self.max_bytes:
                self._drop_oldest()
        if on_pool:
            assert pool is not None
            count = pool.pages_for(states)
            pages = pool.take(count) if pool.free_pages - count >= reserve else None
            if pages is None:
                return  # the rows hold or need the pages: not remembered
            pool.store(pages, states)
            entry = Entry(pages, states.shape, states.device, size, dtype=states.dtype)
        else:
            entry = Entry([], states.shape, states.device, size, states)
        with self._lock:
            self._entries[key] = entry
            self.bytes += size

    def evict(self, pages: int) -> int:
        """Give back at least ``pages`` pool pages (oldest entries first) if there are that many; returns those freed."""
        freed = 0
        with self._lock:
            while self._entries and freed < pages:
                freed += self._drop_oldest()
        return freed

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._drop_oldest()

    def _drop_oldest(self) -> int:
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size
        if entry.pages and self.pool is not None:
            self.pool.release(entry.pages)
        return len(entry.pages)
