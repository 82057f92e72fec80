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

``--kv-cache-dtype fp8`` stores keys and values as float8 e4m3 (``torch.float8_e4m3fn``) with **one float32
scale per token per KV head** (its amax over the head dim ÷ 448), keys and values apart. Per token, because the
decode step writes one token at a time: a token's scale is set when it is written and no older token is ever
quantised again; per head, because heads differ in range. A scale costs 4 bytes per ``head_dim`` (128) fp8
values, 3 %, so a page holds ~1.94× the tokens of a bf16 one. The scales live beside the pages, in a float32
arena per device carved like the keys'/values' (``key_scales[layer]``: ``[pages, tokens per page, kv heads]``);
the kernels read the fp8 values and their scales and widen them in registers (no 16-bit copy of the pool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

CPU_PAGE_TOKENS = 16  # small pages on CPU: the reference attention reads whole text pages
CUDA_PAGE_TOKENS = 256  # FlashAttention's paged kernel takes pages of a multiple of 256 tokens
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest value
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8}  # --kv-cache-dtype -> the storage dtype (None: the model's)
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny  # an all-zero token's scale: its values stay zeros


def kv_dtype_for(choice: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for ``--kv-cache-dtype choice`` when the model computes in ``dtype``."""
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {choice!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[choice] or dtype


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., kv heads, head dim]`` -> its fp8 values and one float32 scale per ``[..., kv head]``."""
    wide = x.float()
    scale = (wide.abs().amax(dim=-1) / FP8_MAX).clamp_min(_SMALLEST_SCALE)
    return (wide / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``values`` times their ``scale`` (one per ``[..., kv head]``), in ``dtype``."""
    return (values.float() * scale[..., None]).to(dtype)


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
    dtype: torch.dtype  # the model's compute dtype (what the kernels read the cache as)
    kv_dtype: torch.dtype | None = None  # how the pool stores keys/values (None: ``dtype``; fp8 adds scales)

    def __post_init__(self) -> None:
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, page_tokens: int, kv_dtype: torch.dtype | None = None) -> PageShape:
        text, vision = config.get_text_config(), config.vision_config
        cross = tuple(sorted(text.cross_attention_layers))
        own = tuple(i for i in range(text.num_hidden_layers) if i not in cross)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        image_tokens = max(1, page_tokens * len(own) // max(1, len(cross)))
        patches = (vision.image_size // vision.patch_size) ** 2 + 1  # + the class token
        kv_heads, tiles = text.num_key_value_heads, vision.max_num_tiles
        return cls(page_tokens, image_tokens, own, cross, kv_heads, head_dim, patches, tiles, dtype, kv_dtype)

    @property
    def token_elements(self) -> int:
        """Elements of one token's keys or values in one layer."""
        return self.kv_heads * self.head_dim

    @property
    def scaled(self) -> bool:
        """Whether the pool stores fp8 values with a float32 scale per token per KV head."""
        return self.kv_dtype == FP8

    @property
    def token_bytes(self) -> int:
        """One token's keys or values in one layer, as stored (with its scales)."""
        scales = 4 * self.kv_heads if self.scaled else 0
        return self.token_elements * self.kv_dtype.itemsize + scales  # type: ignore[union-attr]

    @property
    def text_bytes_per_token(self) -> int:
        """Keys and values of one text token over every self-attention layer."""
        return 2 * len(self.self_layers) * self.token_bytes

    @property
    def image_bytes_per_token(self) -> int:
        """Keys and values of one image-state token over every cross-attention layer."""
        return 2 * len(self.cross_layers) * self.token_bytes

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
        # fp8 only: layer -> [pages, tokens per page, kv heads] float32 (empty otherwise)
        self.key_scales: dict[int, torch.Tensor] = {}
        self.value_scales: dict[int, torch.Tensor] = {}
        self.scale_buffers: dict[str, torch.Tensor] = {}  # device -> its scale arena, [pages, scales per page]
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
        tokens_per_page = max(2 * len(own) * s.page_tokens, 2 * len(cross) * s.image_page_tokens, 1)
        page = tokens_per_page * per_token
        buffer = torch.zeros(self.pages * page, dtype=s.kv_dtype, device=device)
        self.buffers[str(device)] = buffer.view(self.pages, page)
        scales = None
        if s.scaled:  # zeros with zero scales: a page never written (the null pages) reads as finite zeros
            scales = torch.zeros(self.pages * tokens_per_page * s.kv_heads, dtype=torch.float32, device=device)
            self.scale_buffers[str(device)] = scales.view(self.pages, -1)
        for group, tokens in ((own, s.page_tokens), (cross, s.image_page_tokens)):
            for j, layer in enumerate(group):
                size, stride = (self.pages, tokens, s.kv_heads, s.head_dim), (page, per_token, s.head_dim, 1)
                self.keys[layer] = buffer.as_strided(size, stride, 2 * j * tokens * per_token)
                self.values[layer] = buffer.as_strided(size, stride, (2 * j + 1) * tokens * per_token)
                if scales is not None:
                    rows, steps = (self.pages, tokens, s.kv_heads), (tokens_per_page * s.kv_heads, s.kv_heads, 1)
                    self.key_scales[layer] = scales.as_strided(rows, steps, 2 * j * tokens * s.kv_heads)
                    self.value_scales[layer] = scales.as_strided(rows, steps, (2 * j + 1) * tokens * s.kv_heads)

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[tokens, kv heads, head dim]`` keys and values at ``where`` = (pages, offsets), one per token
        (fp8: quantised per token per head, with their scales). Returns what the pool now holds for them, in the
        model's dtype (fp8: the dequantised values; else the ones given)."""
        pages, offsets = where
        if not self.shape.scaled:
            self.keys[layer].index_put_((pages, offsets), keys)
            self.values[layer].index_put_((pages, offsets), values)
            return keys, values
        held = []
        for x, store, scales in ((keys, self.keys, self.key_scales), (values, self.values, self.value_scales)):
            q, scale = quantize(x)
            store[layer].index_put_((pages, offsets), q)
            scales[layer].index_put_((pages, offsets), scale)
            held.append(dequantize(q, scale, x.dtype))
        return held[0], held[1]

    def holds(self, device: torch.device) -> bool:
        return str(device) in self.buffers

    def _bytes(self, device: torch.device) -> torch.Tensor:
        """The device's arena as ``[pages, bytes per page]`` (what ``store`` and ``load`` copy, whatever it holds)."""
        return self.buffers[str(device)].view(torch.uint8).view(self.pages, -1)

    def pages_for(self, tensor: torch.Tensor) -> int:
        """Pages ``store`` takes to keep ``tensor``."""
        return math.ceil(tensor.numel() * tensor.element_size() / self._bytes(tensor.device).shape[1])

    def store(self, pages: list[int], tensor: torch.Tensor) -> None:
        """Keep any tensor in these pages of its device's arena, its bytes as they are (the image-state cache keeps
        16-bit vision states there, in an fp8 pool too)."""
        arena = self._bytes(tensor.device)
        flat, size = tensor.reshape(-1).view(torch.uint8), arena.shape[1]
        for i, page in enumerate(pages):
            chunk = flat[i * size : (i + 1) * size]
            arena[page, : chunk.numel()].copy_(chunk)

    def load(self, pages: list[int], shape: torch.Size, device: torch.device,
             dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
        """A tensor of ``dtype`` (default: the model's) that ``store`` kept (a copy, assembled from its pages)."""
        dtype = dtype or self.shape.dtype
        arena = self._bytes(device)
        total, size = math.prod(shape) * dtype.itemsize, arena.shape[1]
        parts = [arena[page, : min(size, total - i * size)] for i, page in enumerate(pages)]
        return torch.cat(parts).view(dtype).view(shape)

    def copy_page(self, source: int, target: int, tokens: int, text: bool) -> None:
        """The first ``tokens`` tokens of page ``source`` into page ``target`` (a fork's own last page)."""
        layers = self.shape.self_layers if text else self.shape.cross_layers
        for layer in layers:
            for store in (self.keys, self.values, self.key_scales, self.value_scales):
                if layer in store:
                    store[layer][target, :tokens].copy_(store[layer][source, :tokens])
