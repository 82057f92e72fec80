"""The ``triton`` decode attention: our paged kernel in Triton's language, for every torch (2.11's too).

Self-attention over each row's text pages and cross-attention over its image pages (its real tiles), through
the same block tables as ``flash`` (:mod:`~vlm_demo.engine.attention.tables`); the kernels themselves are in
:mod:`~vlm_demo.engine.attention.triton_kernels`. A step's attention is one launch per layer when every row's
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
from typing import Any, ClassVar

import torch

from vlm_demo.engine.attention.tables import TableAttention, Tables


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_missing(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run here (``None``: it can)."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (CUDA torch wheels bring it; else pip install triton)"
    if device.type != "cuda" and not interpreted():
        return f"on {device.type} it runs only under Triton's interpreter: set TRITON_INTERPRET=1 (for tests)"
    return None


def _kernels() -> Any:
    """The kernels' module, imported at the first launch (Triton reads ``TRITON_INTERPRET`` then)."""
    return importlib.import_module("vlm_demo.engine.attention.triton_kernels")


@torch.library.custom_op("vlm_demo::paged_decode_attention", mutates_args=())
def paged_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, split: int, block: int) -> torch.Tensor:  # fmt: skip
    """``[rows, heads, dim]`` queries over each row's ``lengths`` keys through ``table``: one split per row."""
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    _kernels().split_attention(query, keys, values, table, lengths, scale, 1, split, block, out, None)
    return out


@paged_decode_attention.register_fake
def _(query: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("vlm_demo::paged_decode_attention_split", mutates_args=())
def paged_decode_attention_split(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                                 lengths: torch.Tensor, scale: float, splits: int, split: int,
                                 block: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The same over ``splits`` splits of ``split`` keys: each split's part (float32) and its softmax's log total."""
    parts, lse = _split_buffers(query, splits)
    _kernels().split_attention(query, keys, values, table, lengths, scale, splits, split, block, parts, lse)
    return parts, lse


@paged_decode_attention_split.register_fake
def _(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
      scale: float, splits: int, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _split_buffers(query, splits)


def _split_buffers(query: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, heads, dim = query.shape
    return (
        query.new_empty((rows, heads, splits, dim), dtype=torch.float32),
        query.new_empty((rows, heads, splits), dtype=torch.float32),
    )


@torch.library.custom_op("vlm_demo::merge_decode_splits", mutates_args=())
def merge_decode_splits(parts: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row's splits combined by their softmax totals -> ``[rows, heads, dim]`` of ``dtype``."""
    out = parts.new_empty((parts.shape[0], parts.shape[1], parts.shape[3]), dtype=dtype)
    _kernels().merge(parts, lse, out)
    return out


@merge_decode_splits.register_fake
def _(parts: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return parts.new_empty((parts.shape[0], parts.shape[1], parts.shape[3]), dtype=dtype)


class TritonAttention(TableAttention):
    name = "triton"
    # (text keys per split, image-state keys per split, keys per block) by device: on a GPU, splits small enough
    # to spread few long rows over the multiprocessors; under the interpreter, big blocks (each costs ~ms of
    # Python). Shapes-only (meta) steps count as CUDA's.
    SPLITS: ClassVar[dict[str, tuple[int, int, int]]] = {"cuda": (512, 1024, 32), "cpu": (256, 256, 64)}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        device = next(iter(self.pool.keys.values())).device
        self.text_split, self.image_split, self.block = self.SPLITS["cpu" if device.type == "cpu" else "cuda"]

    def self_attention(self, layer: int, query: torch.Tensor, layout: Tables) -> torch.Tensor:
        return self._call(layer, query, layout.text_table, layout.text_lengths, layout.max_text, self.text_split)

    def cross_attention(self, layer: int, query: torch.Tensor, layout: Tables) -> torch.Tensor:
        return self._call(layer, query, layout.image_table, layout.image_lengths, layout.max_image, self.image_split)

    def _call(self, layer: int, query: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, bound: int,
              split: int) -> torch.Tensor:  # fmt: skip
        """One launch when ``bound`` keys fit in one split (the split cut to them), else the splits and their merge;
        ``bound`` is the tables' width in tokens, a constant under a CUDA graph."""
        keys, values, rows = self.pool.keys[layer], self.pool.values[layer], query.shape[0]
        splits = -(-bound // split)
        if splits <= 1:
            split = -(-bound // self.block) * self.block
            out = paged_decode_attention(query, keys, values, table, lengths, self.scale, split, self.block)
        else:
            parts, lse = paged_decode_attention_split(query, keys, values, table, lengths, self.scale, splits, split,
                                                      self.block)  # fmt: skip
            out = merge_decode_splits(parts, lse, query.dtype)
        return out.reshape(rows, self.heads * self.shape.head_dim)
