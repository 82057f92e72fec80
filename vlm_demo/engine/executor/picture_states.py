"""A newcomer's pictures as projected states (``[tiles run, patches, hidden]``), from one place.

A picture's states come from three sources, in this order: the request itself (encoded while it waited, by
:mod:`~vlm_demo.engine.scheduling.lookahead`), the image-state cache (:mod:`~vlm_demo.engine.kv.image_cache`, by the
picture's digest), or the vision tower (the pictures still lacking, each once however many rows show it; the
cache then keeps them). A prefill asks once for its rows' states (:meth:`PictureStates.for_rows`); the lookahead
asks whether a waiting picture still needs the tower (:meth:`PictureStates.ready`) and hands over what it
encoded (:meth:`PictureStates.encoded`). Nothing else reads or fills the image-state cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.kv.image_cache import ImageStates

# Pictures (processor outputs) through the whole tower at once (``Worker.encode_pictures``).
Encode = Callable[[list[dict[str, torch.Tensor]]], list[torch.Tensor]]


class PictureStates:
    """Where a request's picture states are, and encoding the missing ones (the engine thread's)."""

    def __init__(self, encode: Encode, cache: ImageStates | None = None) -> None:
        self.encode = encode
        self.cache = cache

    def ready(self, request: Request) -> bool:
        """Whether its prefill needs no tower work: it has no picture, holds its states, or the cache does (a
        look, not a lookup: no hit or miss counted)."""
        if request.vision is not None or "pixel_values" not in request.inputs:
            return True
        return self.cache is not None and bool(request.image_key) and self.cache.holds(request.image_key)

    def for_rows(self, requests: list[Request], reserve: int = 0) -> list[torch.Tensor]:
        """Each row's picture states: its own, the cache's, or one pass of the tower over the pictures still
        lacking (each once, however many rows show it), which the cache then keeps in free pages beyond the
        ``reserve`` the page table holds back."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, int] = {}  # picture -> the first row showing it
        for row, request in enumerate(requests):
            key = request.image_key or f"row-{row}"
            if key in found or key in missing:
                continue
            states = request.vision
            if states is None and self.cache is not None and request.image_key:
                states = self.cache.get(request.image_key)
            if states is not None:
                found[key] = states
            else:
                missing[key] = row
        if missing:
            encoded = self.encode([requests[row].inputs for row in missing.values()])
            for (key, row), states in zip(missing.items(), encoded, strict=True):
                found[key] = states
                if self.cache is not None:
                    self.cache.put(requests[row].image_key, states, reserve)
        return [found[r.image_key or f"row-{row}"] for row, r in enumerate(requests)]

    def encoded(self, showing: list[Request], states: torch.Tensor, reserve: int) -> None:
        """One picture's states, encoded ahead for the waiting requests ``showing`` it: each holds them until its
        prefill, and the cache keeps them for repeats (in free pages beyond ``reserve``)."""
        for request in showing:
            request.vision = states
        if self.cache is not None and showing[0].image_key:
            self.cache.put(showing[0].image_key, states, reserve)
