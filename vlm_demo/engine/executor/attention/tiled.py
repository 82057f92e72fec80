"""The ``triton`` decode attention: our paged kernel in Triton's language, for every torch (2.11's too).

Self-attention over each row's text pages and cross-attention over its image pages (its real tiles), through
the same block tables as ``flash`` (:mod:`~vlm_demo.engine.executor.attention.tables`); the kernels themselves are in
:mod:`~vlm_demo.engine.executor.attention.tiled_kernels`. A step's attention is one launch per layer when every row's
keys fit in one split, else two (the splits, then their merge): each is a torch custom operator
(``vlm_demo::…``), so the dispatcher, the profiler and ``bench --count-kernels`` see it like any other, and it
has a shape-only version for ``meta`` tensors.

It needs CUDA, or on a CPU Triton's interpreter (``TRITON_INTERPRET=1``: the same kernels run with numpy, ~1000×
slower — for tests, never chosen by ``auto``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vlm_demo.engine.executor.attention.tables import TableAttention, Tables
from vlm_demo.engine.kv.pages import PageShape


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_missing(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run here (``None``: it can; fp8 pages too, on every GPU: read as bytes)."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (CUDA torch wheels bring it; else pip install triton)"
    if device.type != "cuda" and not interpreted():
        return f"on {device.type} it runs only under Triton's interpreter: set TRITON_INTERPRET=1 (for tests)"
    return None


def _kernels() -> Any:
    """The kernels' module, imported at the first launch (Triton reads ``TRITON_INTERPRET`` then)."""
    return importlib.import_module("vlm_demo.engine.executor.attention.tiled_kernels")


@torch.library.custom_op("vlm_demo::paged_decode_attention", mutates_args=())
def paged_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, block: int, key_scales: torch.Tensor | None = None,
                           value_scales: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``[rows, heads, dim]`` queries over each row's ``lengths`` keys through ``table``: one split per row (fp8
    pages: with their scales)."""
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    _kernels().split_attention(query, keys, values, table, lengths, scale, block, 1, 1, out, None, key_scales,
                               value_scales)  # fmt: skip
    return out


@paged_decode_attention.register_fake
def _(query: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("vlm_demo::paged_decode_attention_split", mutates_args=())
def paged_decode_attention_split(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                                 lengths: torch.Tensor, scale: float, block: int, min_blocks: int, max_splits: int,
                                 key_scales: torch.Tensor | None = None,
                                 value_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The same over each row's own splits (at most ``max_splits``, each at least ``min_blocks`` blocks of
    ``block`` keys): each written split's part (float32) and its softmax's log total; unwritten parts stay as
    allocated, and the merge never reads them."""
    parts, lse = _split_buffers(query, max_splits)
    _kernels().split_attention(query, keys, values, table, lengths, scale, block, min_blocks, max_splits, parts, lse,
                               key_scales, value_scales)  # fmt: skip
    return parts, lse


@paged_decode_attention_split.register_fake
def _(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
      scale: float, block: int, min_blocks: int, max_splits: int, key_scales: torch.Tensor | None = None,
      value_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _split_buffers(query, max_splits)


def _split_buffers(query: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, heads, dim = query.shape
    return (
        query.new_empty((rows, heads, splits, dim), dtype=torch.float32),
        query.new_empty((rows, heads, splits), dtype=torch.float32),
    )


@torch.library.custom_op("vlm_demo::merge_decode_splits", mutates_args=())
def merge_decode_splits(parts: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor, block: int, min_blocks: int,
                        dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Each row's written splits (as many as its ``lengths`` gave it) combined by their softmax totals ->
    ``[rows, heads, dim]`` of ``dtype``."""
    out = parts.new_empty((parts.shape[0], parts.shape[1], parts.shape[3]), dtype=dtype)
    _kernels().merge(parts, lse, lengths, block, min_blocks, out)
    return out


@merge_decode_splits.register_fake
def _(parts: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor, block: int, min_blocks: int,
      dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return parts.new_empty((parts.shape[0], parts.shape[1], parts.shape[3]), dtype=dtype)


@dataclass(frozen=True)
class SplitPlan:
    """How a device splits rows' keys: ``block`` keys per loop step (a page holds a whole number of them where it
    can), a split of at least ``text_blocks`` / ``image_blocks`` blocks, and at most ``most`` splits a row."""

    block: int
    text_blocks: int
    image_blocks: int
    most: int

    @classmethod
    def for_device(cls, device: torch.device, shape: PageShape) -> SplitPlan:
        """On a GPU, splits enough for one row's key/value heads to cover every multiprocessor (``most`` =
        SMs ÷ KV heads: 17 on an H100 or H200), each at least two text blocks (a shorter split would not shorten
        the longest one below 34 blocks, and each split costs a part written and read back) or one image block
        (pictures are long); shapes-only (meta) steps count as an H100's. Under the interpreter (the CPU: tests
        only), where each program and each of its operations costs Python time, few big blocks and one split a
        row, no merge (4 splits made an engine step 4× slower); a test of the splits and their merge sets
        ``TritonAttention.PLANS``."""
        if device.type == "cpu":
            return cls(_block_for(64, shape), 1, 1, 1)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS
        return cls(_block_for(32, shape), 2, 1, max(1, -(-sms // shape.kv_heads)))

    def splits(self, bound: int, image: bool) -> int:
        """The launch's split dimension for tables ``bound`` keys wide: no row there takes more."""
        blocks = -(-bound // self.block)
        return max(1, min(self.most, -(-blocks // (self.image_blocks if image else self.text_blocks))))


H100_SMS = 132


def _block_for(preferred: int, shape: PageShape) -> int:
    """``preferred`` keys a block, fewer (down to ``tl.dot``'s 16) where that lets every page hold whole blocks."""
    block = preferred
    while block > 16 and (shape.page_tokens % block or shape.image_page_tokens % block):
        block //= 2
    return block


CASCADE_SLOTS = 8  # rows of one picture a program reads its states for: 32 query heads of the 11B model's 4 per KV head


class TritonAttention(TableAttention):
    name = "triton"
    PLANS: ClassVar[dict[str, SplitPlan]] = {}  # a device type's plan in place of its own (tests: small splits)
    cascade_slots = CASCADE_SLOTS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        device = next(iter(self.pool.keys.values())).device
        self.plan = self.PLANS.get(device.type) or SplitPlan.for_device(device, self.shape)

    def self_attention(self, layer: int, query: torch.Tensor, layout: Tables) -> torch.Tensor:
        out = self._call(layer, query, layout.text_table, layout.text_lengths, layout.max_text, False)
        return out.reshape(query.shape[0], self.heads * self.shape.head_dim)

    def cross_attention(self, layer: int, query: torch.Tensor, layout: Tables) -> torch.Tensor:
        """Over picture rows where the layout has them (:mod:`.tables`): each row's query heads are put in its
        picture row's slot, so the kernel's "group" of query heads per KV head is every slot's (``slots`` × the
        model's group) and one program reads a picture's keys once for all its rows; slots no row fills hold zeros,
        and their outputs are not read."""
        rows, dim = query.shape[0], self.shape.head_dim
        if not layout.slots:
            out = self._call(layer, query, layout.image_table, layout.image_lengths, layout.max_image, True)
            return out.reshape(rows, self.heads * dim)
        slots, kv = layout.slots, self.shape.kv_heads
        table, lengths, where = layout.pictures()
        placed = query.new_zeros((rows * slots, self.heads, dim)).index_copy_(0, where, query)
        grouped = placed.view(rows, slots, kv, self.group, dim).transpose(1, 2).reshape(rows, -1, dim)
        out = self._call(layer, grouped, table, lengths, layout.max_image, True)
        back = out.view(rows, kv, slots, self.group, dim).transpose(1, 2).reshape(rows * slots, self.heads, dim)
        return back.index_select(0, where).reshape(rows, self.heads * dim)

    def _call(self, layer: int, query: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, bound: int,
              image: bool) -> torch.Tensor:  # fmt: skip
        """``[rows, query heads, dim]``: one launch when no row can take two splits, else the splits and their
        merge; ``bound`` is the tables' width in tokens, a constant under a CUDA graph (so is the launch's split
        dimension)."""
        keys, values, plan = self.pool.keys[layer], self.pool.values[layer], self.plan
        scales = self.pool.key_scales.get(layer), self.pool.value_scales.get(layer)  # fp8 pages only
        splits = plan.splits(bound, image)
        if splits <= 1:
            out = paged_decode_attention(query, keys, values, table, lengths, self.scale, plan.block, *scales)
        else:
            least = plan.image_blocks if image else plan.text_blocks
            parts, lse = paged_decode_attention_split(query, keys, values, table, lengths, self.scale, plan.block,
                                                      least, splits, *scales)  # fmt: skip
            out = merge_decode_splits(parts, lse, lengths, plan.block, least, query.dtype)
        return out
