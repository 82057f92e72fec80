"""The image-state cache: the vision tower's output for recent images, kept by the picture's digest.

On the 11B model one 4-tile image is ~6,400 vision tokens through a 40-layer ViT. The same image comes
back often: a Think-harder answer's judge calls (each judge prompt carries the image again), a follow-up
question, the example gallery, a client asking twice. Here the projected vision output (what every
cross-attention layer turns into its keys and values: 6,404 × 4,096 values, 52 MB in bf16) is kept by
the image's digest and reused, so such a prefill runs the text model only. Least recently used entries
go first; the continuous engine counts the cache in its KV budget and empties it before it turns a
request away (``ContinuousEngine._fits``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class ImageStates:
    """A byte-bounded LRU of ``[tiles, patches, hidden]`` vision states on the model's device."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # stats are read from other threads
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            states = self._entries.get(key) if key else None
            if states is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return states

    def put(self, key: str, states: torch.Tensor) -> None:
        size = states.numel() * states.element_size()
        if not key or size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = states
            self.bytes += size
            while self.bytes > self.max_bytes:
                self._drop_oldest()

    def evict(self, wanted: int) -> int:
        """Free at least ``wanted`` bytes (oldest first) if there are that many; returns the bytes freed."""
        freed = 0
        with self._lock:
            while self._entries and freed < wanted:
                freed += self._drop_oldest()
        return freed

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def _drop_oldest(self) -> int:
        _, states = self._entries.popitem(last=False)
        size = states.numel() * states.element_size()
        self.bytes -= size
        return size
