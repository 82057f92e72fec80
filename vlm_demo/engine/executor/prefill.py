"""A prefill's result and how it is written into the rows' pages.

Newcomers are prefilled together (``Worker.prefill``), left-padded among themselves as a dynamic batch;
each one's real tokens and the tiles it sees are then copied into the fresh pages the page table gave it
(:mod:`~vlm_demo.engine.kv.page_table`), every layer in one indexed write. Padding and unseen tiles take no
page, and a picture rows already hold in the pool (the same digest, tiles run and tiles seen) takes none either: the
newcomer's image pages are that picture's, and only its text is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlm_demo.engine.executor.staging import Staging
from vlm_demo.engine.kv.page_table import PageTable, PictureKey, Placement


@dataclass
class Prefill:
    """Newcomers prefilled together (``Worker.prefill``): left-padded among themselves, as a dynamic batch."""

    cache: Any  # transformers DynamicCache: [n, kv heads, L, dim] per self layer, every tile's states per cross layer
    logits: torch.Tensor  # [n, vocab] float32 at each row's last prompt position
    attention_mask: torch.Tensor  # [n, L] bool, False for left padding
    lengths: list[int]  # each row's real prompt tokens
    tiles: torch.Tensor  # [n, most real tiles] bool (host): the tiles each row's next token sees
    picture_tiles: list[int]  # each row's picture's real tiles (those its cache holds states of)
    digests: list[str] | None = None  # each row's picture's digest ("": none, its states are not shared)

    def shown(self, index: int) -> np.ndarray:
        """The tiles row ``index`` keeps: those it sees, or all its picture's when it sees none (it then
        attends evenly)."""
        seen = self.tiles[index]
        return np.nonzero(seen.numpy())[0] if bool(seen.any()) else np.arange(self.picture_tiles[index])

    def pages(self, table: PageTable, index: int) -> int:
        return table.shape.row_pages(self.lengths[index], len(self.shown(index)))

    def picture(self, index: int) -> PictureKey | None:
        """Row ``index``'s picture as the page table shares it (``None``: it has no digest)."""
        digest = self.digests[index] if self.digests is not None else ""
        return (digest, self.picture_tiles[index], tuple(int(t) for t in self.shown(index))) if digest else None


def place(table: PageTable, staging: Staging, dtype: torch.dtype, prefill: Prefill,
          index: list[int]) -> list[Placement] | None:  # fmt: skip
    """Write rows ``index`` of a prefill into fresh pages (``None``, nothing taken, when too few are free); a row
    whose picture is held already shares its pages, and only its text is written. If writing fails, the pages
    taken go back."""
    shown = [prefill.shown(i) for i in index]
    seen = [bool(prefill.tiles[i].any()) for i in index]
    pictures = [prefill.picture(i) for i in index]
    places = table.allocate([prefill.lengths[i] for i in index], [len(t) for t in shown], seen, pictures)
    if places is None:
        return None
    s = table.shape
    width, tiles_max = prefill.attention_mask.shape[1], prefill.tiles.shape[1]
    text, image, text_source, tile_source = [], [_addresses([], 0, 1)], [], [np.zeros(0, dtype=np.int64)]
    for j, (place, tiles) in enumerate(zip(places, shown, strict=True)):
        length = place.length
        text.append(_addresses(place.pages, length, s.page_tokens))
        text_source.append(j * width + np.arange(width - length, width))  # its real (right-aligned) tokens
        if not place.shared_picture:
            image.append(_addresses(place.image_pages, place.tiles * s.patches, s.image_page_tokens))
            tile_source.append(j * tiles_max + tiles)
    where = [np.concatenate(text, axis=1), np.concatenate(image, axis=1), np.concatenate(text_source),
             np.concatenate(tile_source)]  # fmt: skip
    try:
        _write(table, staging, dtype, prefill, index, where)
    except BaseException:
        for place in places:
            table.release(place)
        raise
    return places


def _write(table: PageTable, staging: Staging, dtype: torch.dtype, prefill: Prefill, index: list[int],
           where: list[np.ndarray]) -> None:  # fmt: skip
    """Every layer's keys/values of those rows into their pages: real tokens only, seen tiles only."""
    pool, shape = table.pool, table.shape
    sent: dict[str, list[torch.Tensor]] = {}
    rows = np.asarray(index, dtype=np.int64)
    for layer, cached in enumerate(prefill.cache.layers):
        device = cached.keys.device
        if str(device) not in sent:
            sender = staging if device == staging.device else Staging(device)
            sent[str(device)] = sender.send([rows, *where])
        picked, text, image, text_source, tile_source = sent[str(device)]
        cross = layer in shape.cross_layers
        if cross and not len(tile_source):  # every row's picture is held already
            continue
        target = image if cross else text
        pool_device = pool.keys[layer].device
        keys, values = (
            _tokens(t.index_select(0, picked), tile_source if cross else text_source, shape.patches if cross else 0).to(
                pool_device, dtype
            )
            for t in (cached.keys, cached.values)
        )
        pool.write(layer, (target[0].to(pool_device), target[1].to(pool_device)), keys, values)


def _tokens(cached: torch.Tensor, source: torch.Tensor, patches: int) -> torch.Tensor:
    """``[rows, heads, L, dim]`` cached keys or values -> ``[tokens, heads, dim]``: the ``source`` tokens (flat
    row-major indices), or with ``patches`` the ``source`` tiles' tokens (image states: ``L`` = tiles × patches)."""
    rows, heads, _, dim = cached.shape
    if patches:
        tiles = cached.view(rows, heads, -1, patches, dim).permute(0, 2, 3, 1, 4).reshape(-1, patches, heads, dim)
        return tiles.index_select(0, source).reshape(-1, heads, dim)
    return cached.transpose(1, 2).reshape(-1, heads, dim).index_select(0, source)


def _addresses(pages: list[int], tokens: int, per_page: int) -> np.ndarray:
    """``[2, tokens]``: the page and offset of each of a row's first ``tokens`` tokens."""
    at = np.arange(tokens, dtype=np.int64)
    return np.stack([np.asarray(pages, dtype=np.int64)[at // per_page], at % per_page])
