"""What a decode-attention kernel is to the engine: it builds its own inputs from the step's rows, and runs self- and
cross-attention of one decode step over the page pool (``[rows, heads, dim]`` queries in, ``[rows, heads × dim]``
out).

The rows (:mod:`~vlm_demo.engine.batching.rows`) know only where each row's cache is (``StepRows``: page lists and
lengths, on the host); each kernel turns that into what it reads (block tables, a gather plan, …: its *layout*)
and sends it to the device in the same staging copy as the step's other inputs. Every layout has ``rows``,
``restore`` (where each engine row ran in the step, when the kernel took them in another order) and ``read``
(the text and image-state tokens the real rows' attention reads per layer, for the byte counters).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from vlm_demo.engine.executor.staging import Staging
from vlm_demo.engine.kv.pages import PagePool, PageShape

VERSIONS = itertools.count(1)  # who the rows are, numbered across every set of rows (a kernel's caches key on it)


class Layout(Protocol):
    """What every kernel's layout has (its own fields besides)."""

    rows: int
    restore: torch.Tensor | None  # [rows] long: each engine row's place in the step (None: in order)
    read: tuple[int, int]  # text and image-state tokens the real rows read, per layer


@dataclass
class StepOrder:
    """The step's rows in another order than the engine's (the reference's dense lines run longest first)."""

    rank: list[int]  # the engine's row of each step row
    order: torch.Tensor  # the same, on the device
    restore: torch.Tensor  # [rows] long: the step row of each engine row (inert rows last)


@dataclass
class StepRows:
    """The step's rows as a kernel builds its inputs from them, on the host: placements in the step's order (inert
    rows, which pad a step to its CUDA graph's size, last)."""

    places: list[Any]  # Placement: pages, length, image_pages, tiles, sees_image
    real: int  # rows that are not inert
    lengths: np.ndarray  # [rows] int64: tokens each row holds (its new token goes there)
    version: int  # who the rows are: changes whenever rows join or leave (never repeats)
    staging: Staging
    restore: torch.Tensor | None = None

    @property
    def seen(self) -> np.ndarray:
        """Tokens each row attends to (its new one included)."""
        return self.lengths + 1

    def used(self, page_tokens: int) -> np.ndarray:
        """Text pages each row reads (its last one takes the new token)."""
        return -(-self.seen // page_tokens)

    def image_tokens(self, patches: int) -> list[int]:
        """Image-state tokens each real row attends to."""
        return [p.tiles * patches for p in self.places[: self.real]]


class PagedAttention:
    """Self- and cross-attention of one decode step over the pool; a kernel is a subclass."""

    name: ClassVar[str]
    graphable: ClassVar[bool] = False  # its layout lives in static buffers a CUDA graph can replay

    def __init__(self, pool: PagePool, heads: int, scale: float) -> None:
        self.pool = pool
        self.shape = pool.shape
        self.heads = heads
        self.group = heads // self.shape.kv_heads
        self.scale = scale

    @property
    def kernel(self) -> str:
        """The kernel's name, as ``--decode-attention``, ``/health`` and ``/metrics`` say it."""
        return self.name

    def order(self, places: list[Any], rows: int, version: int, staging: Staging) -> StepOrder | None:
        """The order the step runs its rows in (``None``: the engine's)."""
        return None

    def prepare(self, step: StepRows, common: list[np.ndarray]) -> tuple[list[torch.Tensor], Any]:
        """The step's layout, and the ``common`` arrays on the device (sent in the same copy as the layout's)."""
        raise NotImplementedError

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, layout: Any) -> None:  # fmt: skip
        """A self-attention layer's new keys/values ``[rows, kv heads, dim]`` into the pool."""
        self.pool.write(layer, (pages, offsets), keys, values)

    def self_attention(self, layer: int, query: torch.Tensor, layout: Any) -> torch.Tensor:
        """``[rows, heads, dim]`` queries over each row's text tokens -> ``[rows, heads × dim]``."""
        raise NotImplementedError

    def cross_attention(self, layer: int, query: torch.Tensor, layout: Any) -> torch.Tensor:
        """``[rows, heads, dim]`` queries over each row's image-state tokens -> ``[rows, heads × dim]``."""
        raise NotImplementedError

    @classmethod
    def working_bytes(cls, shape: PageShape, heads: int, rows: int, tiles: int, tokens: int) -> int:
        """Memory a step's attention takes beyond the model's activations, at ``rows`` rows of ``tokens`` text tokens
        and ``tiles`` tiles each (what the memory plan reserves)."""
        return 0


def table(pages: list[list[int]], width: int) -> np.ndarray:
    """``[rows, width]``: each row's pages, left-aligned (unused entries 0)."""
    out = np.zeros((len(pages), width), dtype=np.int64)
    for r, own in enumerate(pages):
        out[r, : len(own)] = own
    return out


def moved(layout: Any, device: torch.device) -> Any:
    """A layout with its tensors on ``device`` (a model spread over devices: each layer reads them where it runs)."""

    def to(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
            return tuple(v.to(device) for v in value)
        return value

    return dataclasses.replace(layout, **{f.name: to(getattr(layout, f.name)) for f in dataclasses.fields(layout)})
