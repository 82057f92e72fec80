"""The page pool: every row's keys/values and image states, in fixed-size pages allocated once.

A row's cache has two parts: its text keys/values (one entry per token in every self-attention layer,
growing by one token a step) and its picture's cross-attention keys/values (a fixed number of tokens,
``patches`` per tile it sees, in every cross-attention layer). Both live in one arena of equal-sized
pages: a *text page* holds ``page_tokens`` tokens of every self-attention layer, an *image page*
``image_page_tokens`` tokens of every cross-attention layer, and the two are sized to take the same
bytes (``image_page_tokens = page_tokens × self layers ÷ cross layers``), so one free list serves both
and the split between text and pictures follows the load, not a guess made at start.

Rows own lists of pages. Joining writes only the newcomer's pages, leaving frees only the leaver's,
and nothing ever moves: no operation copies other rows' keys/values. Pages are reference-counted, so
the candidates of a Think-harder search share their prompt's full pages and image pages; only a
partly filled last page is copied when a row is forked (a row writes only into a page it owns alone).

Each layer sees the arena through a strided view of shape ``[pages, tokens per page, kv heads,
head dim]`` (the layout FlashAttention's paged kernel reads). A model spread over several devices
gets one arena per device, holding the layers that run there; page numbers are shared by all arenas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

CPU_PAGE_TOKENS = 16  # small pages on CPU: the reference attention reads whole text pages
CUDA_PAGE_TOKENS = 256  # FlashAttention's paged kernel takes pages of a multiple of 256 tokens


def page_tokens_for(device: torch.device | str) -> int:
    """Text tokens per page on this device."""
    return CUDA_PAGE_TOKENS if torch.device(device).type == "cuda" else CPU_PAGE_TOKENS


@dataclass(frozen=True)
class PageShape:
    """What one page holds, from the model's config: enough to size the pool and address every layer."""

    page_tokens: int  # text tokens per page
    image_page_tokens: int  # image-state tokens per page
    self_layers: tuple[int, ...]
    cross_layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    patches: int  # image-state tokens per tile
    max_tiles: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, page_tokens: int) -> PageShape:
        text, vision = config.get_text_config(), config.vision_config
        cross = tuple(sorted(text.cross_attention_layers))
        own = tuple(i for i in range(text.num_hidden_layers) if i not in cross)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        image_tokens = max(1, page_tokens * len(own) // max(1, len(cross)))
        patches = (vision.image_size // vision.patch_size) ** 2 + 1  # + the class token
        kv_heads, tiles = text.num_key_value_heads, vision.max_num_tiles
        return cls(page_tokens, image_tokens, own, cross, kv_heads, head_dim, patches, tiles, dtype)

    @property
    def token_elements(self) -> int:
        """Elements of one token's keys or values in one layer."""
        return self.kv_heads * self.head_dim

    @property
    def text_bytes_per_token(self) -> int:
        """Keys and values of one text token over every self-attention layer."""
        return 2 * len(self.self_layers) * self.token_elements * self.dtype.itemsize

    @property
    def image_bytes_per_token(self) -> int:
        """Keys and values of one image-state token over every cross-attention layer."""
        return 2 * len(self.cross_layers) * self.token_elements * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        return max(self.page_tokens * self.text_bytes_per_token, self.image_page_tokens * self.image_bytes_per_token)

    def text_pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_tokens)

    def image_pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.image_page_tokens)

    def row_pages(self, tokens: int, tiles: int) -> int:
        """Pages one row of ``tokens`` text tokens showing ``tiles`` tiles takes."""
        return self.text_pages(tokens) + self.image_pages(tiles * self.patches)


class PagePool:
    """The arena(s) and the free list; not thread-safe (the engine thread owns it)."""

    def __init__(self, shape: PageShape, pages: int, layer_devices: dict[int, torch.device]) -> None:
        self.shape = shape
        self.pages = pages
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [pages, tokens per page, kv heads, head dim]
        self.values: dict[int, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}  # device -> its arena, [pages, elements per page]
        devices = sorted({str(d) for d in layer_devices.values()})
        for device in devices:
            layers = [i for i, d in layer_devices.items() if str(d) == device]
            self._carve(torch.device(device), layers)
        self._refs = [0] * pages
        self._free = list(range(pages - 1, -1, -1))  # pop() hands out low page numbers first
        self._null: list[int] | None = None

    def _carve(self, device: torch.device, layers: list[int]) -> None:
        """One buffer for this device's layers; each layer's keys and values are strided views of it."""
        s, per_token = self.shape, self.shape.token_elements
        own = [i for i in s.self_layers if i in layers]
        cross = [i for i in s.cross_layers if i in layers]
        page = max(2 * len(own) * s.page_tokens, 2 * len(cross) * s.image_page_tokens, 1) * per_token
        buffer = torch.zeros(self.pages * page, dtype=s.dtype, device=device)
        self.buffers[str(device)] = buffer.view(self.pages, page)
        for group, tokens in ((own, s.page_tokens), (cross, s.image_page_tokens)):
            for j, layer in enumerate(group):
                size, stride = (self.pages, tokens, s.kv_heads, s.head_dim), (page, per_token, s.head_dim, 1)
                self.keys[layer] = buffer.as_strided(size, stride, 2 * j * tokens * per_token)
                self.values[layer] = buffer.as_strided(size, stride, (2 * j + 1) * tokens * per_token)

    def null_pages(self) -> list[int]:
        """A text page, then the image pages of one tile, that no row ever owns: where the inert rows that pad a
        step to its CUDA graph's size write and read (taken from the pool the first time they are asked for)."""
        if self._null is None:
            taken = self.take(1 + self.shape.image_pages(self.shape.patches))
            if taken is None:
                raise RuntimeError("the page pool has no room for the null pages CUDA graphs pad with")
            self._null = taken
        return self._null

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.pages - len(self._free)

    def take(self, count: int) -> list[int] | None:
        """``count`` fresh pages (owned by the caller alone), or ``None`` when fewer are free."""
        if count > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(count)]
        for page in taken:
            self._refs[page] = 1
        return taken

    def share(self, pages: list[int]) -> None:
        """One more owner for each page (a fork, a snapshot)."""
        for page in pages:
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """One owner less; a page nobody owns goes back to the free list."""
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def owners(self, page: int) -> int:
        return self._refs[page]

    def write(
        self, layer: int, where: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``[tokens, kv heads, head dim]`` keys and values at ``where`` = (pages, offsets), one per token."""
        pages, offsets = where
        self.keys[layer].index_put_((pages, offsets), keys)
        self.values[layer].index_put_((pages, offsets), values)

    def holds(self, device: torch.device) -> bool:
        return str(device) in self.buffers

    def page_elements(self, device: torch.device) -> int:
        return int(self.buffers[str(device)].shape[1])

    def store(self, pages: list[int], tensor: torch.Tensor) -> None:
        """Keep any tensor of the pool's dtype in these pages of its device's arena (the image-state cache)."""
        arena = self.buffers[str(tensor.device)]
        flat, size = tensor.reshape(-1), arena.shape[1]
        for i, page in enumerate(pages):
            chunk = flat[i * size : (i + 1) * size]
            arena[page, : chunk.numel()].copy_(chunk)

    def load(self, pages: list[int], shape: torch.Size, device: torch.device) -> torch.Tensor:
        """A tensor ``store`` kept (a copy, assembled from its pages)."""
        arena = self.buffers[str(device)]
        total, size = math.prod(shape), arena.shape[1]
        parts = [arena[page, : min(size, total - i * size)] for i, page in enumerate(pages)]
        return torch.cat(parts).view(shape)

    def copy_page(self, source: int, target: int, tokens: int, text: bool) -> None:
        """The first ``tokens`` tokens of page ``source`` into page ``target`` (a fork's own last page)."""
        layers = self.shape.self_layers if text else self.shape.cross_layers
        for layer in layers:
            self.keys[layer][target, :tokens].copy_(self.keys[layer][source, :tokens])
            self.values[layer][target, :tokens].copy_(self.values[layer][source, :tokens])
