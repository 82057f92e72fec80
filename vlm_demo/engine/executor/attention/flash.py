"""The ``flash`` decode attention: FlashAttention's paged variable-length kernel from torch itself.

``aten._flash_attention_forward`` with a block table and per-row key counts, on CUDA in 16-bit floats: it reads
exactly each row's live tokens in place. Only torch ≥ 2.12 declares ``block_table`` (2.11's FA2 has the paged
path inside but Python cannot reach it), and its automatic key splits gave intermittent NaNs (~1% of steps,
fixed upstream in mid-2026), so this kernel passes its own ``num_splits`` where the schema takes one, and the
engine uses it only after a probe of a few hundred random steps (:mod:`~vlm_demo.engine.executor.attention.probe`).
"""

from __future__ import annotations

from typing import Any

import torch

from vlm_demo.engine.executor.attention.tables import TableAttention, Tables

MOST_SPLITS = 8  # key splits per row when rows are too few to fill the GPU (flash-decoding)


def schema() -> str:
    return str(torch.ops.aten._flash_attention_forward.default._schema)


def paged_call_missing() -> str | None:
    """Why this torch has no paged FlashAttention call (``None``: it has one)."""
    if "block_table" not in schema():
        return f"torch {torch.__version__.split('+')[0]} has no paged call (block_table came in 2.12)"
    return None


def flash_missing(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str | None:
    """Why this torch cannot run the paged call here (``None``: it can); ``kv_dtype``: how the pool stores
    keys/values (the call reads them in the queries' dtype: no fp8 pages, no scales)."""
    if device.type != "cuda":
        return "needs CUDA"
    if kv_dtype is not None and kv_dtype != dtype:
        stored = str(kv_dtype).removeprefix("torch.")
        return f"cannot read {stored} pages (--kv-cache-dtype fp8): its paged call takes 16-bit keys/values"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs 16-bit floats (the model runs in {str(dtype).removeprefix('torch.')})"
    return paged_call_missing()


class FlashAttention(TableAttention):
    name = "flash"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        device = next(iter(self.pool.keys.values())).device
        self._starts = torch.arange(1, dtype=torch.int32, device=device)
        self._takes_splits = "num_splits" in schema()
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0

    def self_attention(self, layer: int, query: torch.Tensor, layout: Tables) -> torch.Tensor:
        return self._call(layer, query, layout.text_table, layout.text_lengths, layout.max_text)

    def cross_attention(self, layer: int, query: torch.Tensor, layout: Tables) -> torch.Tensor:
        return self._call(layer, query, layout.image_table, layout.image_lengths, layout.max_image)

    def splits(self, rows: int) -> int:
        """Key splits per row: one when the rows' heads fill the GPU's multiprocessors, else enough to fill them (a
        number of rows gives the same splits every step: a graph's bucket keeps them)."""
        programs = rows * self.heads
        return 1 if not self._sms or programs >= self._sms else min(MOST_SPLITS, -(-self._sms // programs))

    def _call(self, layer: int, query: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
              bound: int) -> torch.Tensor:  # fmt: skip
        count = query.shape[0]
        if self._starts.numel() < count + 1:  # grown before any capture (the largest bucket is warmed up first)
            self._starts = torch.arange(count + 1, dtype=torch.int32, device=query.device)
        starts = self._starts[: count + 1]
        extra = {"num_splits": self.splits(count)} if self._takes_splits else {}
        # With a block table the kernel finds each row's keys through it and counts them by ``lengths``; the key
        # offsets it also takes are not read then, so the query offsets stand in for them.
        out = torch.ops.aten._flash_attention_forward(
            query, self.pool.keys[layer], self.pool.values[layer], starts, starts, 1, bound, 0.0, False, False,
            scale=self.scale, seqused_k=lengths, block_table=table, **extra,
        )[0]  # fmt: skip
        return out.reshape(count, self.heads * self.shape.head_dim)
