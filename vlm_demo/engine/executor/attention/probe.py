"""A fast kernel checked against the reference before the engine trusts it: many decode steps on random pages.

A one-call check cannot see a fault that strikes one step in a hundred (FA2's automatic key splits gave NaNs
about that often), so the probe runs a few hundred steps of random rows — a few to many rows, lengths across
page boundaries, one to four tiles, pages scattered over a scratch pool of the engine's shape (the engine's own
pool is not touched) — and compares self- and cross-attention with the reference's on every one. The scratch pool
stores keys/values as the engine's does (``--kv-cache-dtype``): an fp8 kernel is compared with the reference
reading the same fp8 pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlm_demo.engine.executor.attention.base import VERSIONS, PagedAttention, StepRows
from vlm_demo.engine.executor.attention.reference import ReferenceAttention
from vlm_demo.engine.executor.staging import Staging
from vlm_demo.engine.kv.pages import PagePool, PageShape

MOST_ROWS = 6
MOST_TEXT_PAGES = 4


@dataclass
class _Place:
    """A row's placement, as the kernels read it (``rows.Placement``'s fields)."""

    pages: list[int]
    length: int
    image_pages: list[int]
    tiles: int
    sees_image: bool = True


@dataclass
class ProbeResult:
    kernel: str
    steps: int = 0
    nan_steps: int = 0
    max_error: float = 0.0
    failure: str = ""  # an exception the kernel raised

    def passed(self, tolerance: float) -> bool:
        return not self.why(tolerance)

    def why(self, tolerance: float) -> str:
        """What went wrong, in words (empty when it passed)."""
        if self.failure:
            return f"failed its probe: {self.failure}"
        if self.nan_steps:
            return f"gave NaN on {self.nan_steps} of {self.steps} probe steps on random pages"
        if self.max_error > tolerance:
            return f"differs from the reference by {self.max_error:.3g} (more than {tolerance:g}) on random pages"
        return ""


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def probe(kind: type[PagedAttention], shape: PageShape, heads: int, device: torch.device, steps: int,
          seed: int = 0) -> ProbeResult:  # fmt: skip
    """``steps`` decode steps' attention by ``kind`` and by the reference over the same random rows."""
    result = ProbeResult(kind.name)
    row_pages = MOST_TEXT_PAGES + shape.image_pages(shape.max_tiles * shape.patches)
    layers = {shape.self_layers[0]: device}
    if shape.cross_layers:
        layers[shape.cross_layers[0]] = device
    pool = PagePool(shape, MOST_ROWS * row_pages, layers)
    generator = torch.Generator(device=device).manual_seed(seed)
    fill(pool, generator)
    scale = shape.head_dim**-0.5
    try:
        fast, slow = kind(pool, heads, scale), ReferenceAttention(pool, heads, scale)
        rng = np.random.default_rng(seed)
        staging = Staging(device)
        with torch.inference_mode():
            for _ in range(steps):
                error = _step(fast, slow, pool, rng, staging, generator)
                result.steps += 1
                if error != error:  # NaN
                    result.nan_steps += 1
                else:
                    result.max_error = max(result.max_error, error)
                staging.recycle()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this kernel
        result.failure = f"{type(exc).__name__}: {exc}"
    return result


def fill(pool: PagePool, generator: torch.Generator) -> None:
    """Random keys and values (standard normal) in every page of ``pool``; an fp8 pool's written as the engine
    writes them (quantised per token per head, with their scales)."""
    if not pool.shape.scaled:
        for buffer in pool.buffers.values():
            buffer.normal_(generator=generator)
        return
    for layer, keys in pool.keys.items():
        pages, tokens = keys.shape[:2]
        where = (torch.arange(pages, device=keys.device).repeat_interleave(tokens),
                 torch.arange(tokens, device=keys.device).repeat(pages))  # fmt: skip
        size = (pages * tokens, *keys.shape[2:])
        new = [torch.randn(size, generator=generator, device=keys.device).to(pool.shape.dtype) for _ in range(2)]
        pool.write(layer, where, *new)


def _step(fast: PagedAttention, slow: PagedAttention, pool: PagePool, rng: np.random.Generator, staging: Staging,
          generator: torch.Generator) -> float:  # fmt: skip
    """One random step through both kernels' own inputs; the largest difference (NaN if the fast one gave any)."""
    s = pool.shape
    rows = int(rng.integers(1, MOST_ROWS + 1))
    free = [int(p) for p in rng.permutation(pool.pages)]
    places = []
    for _ in range(rows):
        length = int(rng.integers(0, MOST_TEXT_PAGES * s.page_tokens))  # the row attends to length + 1 tokens
        tiles = int(rng.integers(1, s.max_tiles + 1))
        text, image = s.text_pages(length + 1), s.image_pages(tiles * s.patches)
        places.append(_Place([free.pop() for _ in range(text)], length, [free.pop() for _ in range(image)], tiles))
    version = next(VERSIONS)
    device = next(iter(pool.buffers.values())).device
    query = torch.randn(rows, fast.heads, s.head_dim, generator=generator, device=device).to(s.dtype)
    outs = []
    for kernel in (fast, slow):
        order = kernel.order(places, rows, version, staging)
        mine = places if order is None else [places[i] for i in order.rank]
        lengths = np.asarray([p.length for p in mine], dtype=np.int64)
        _, layout = kernel.prepare(StepRows(mine, rows, lengths, version, staging), [])
        q = query if order is None else query[order.order]
        got = [kernel.self_attention(s.self_layers[0], q, layout)]
        if s.cross_layers:
            got.append(kernel.cross_attention(s.cross_layers[0], q, layout))
        out = torch.cat(got, dim=-1).float()
        outs.append(out if order is None else out[order.restore[:rows]])
    if not bool(torch.isfinite(outs[0]).all()):
        return float("nan")
    return float((outs[0] - outs[1]).abs().max())
