"""The Triton paged decode-attention kernels (``@triton.jit``, the language only) and their launchers.

Imported only when the Triton kernel is chosen, so that ``TRITON_INTERPRET=1`` (Triton's interpreter: the same
kernels on CPU tensors, with numpy) is read at the first import, as Triton requires.

One program takes one row, one key/value head and one *split* of ``split`` keys of that row (flash-decoding):
it loads the row's query heads of that key/value head (GQA: ``group`` of them, one matrix), walks its split's
keys ``block`` at a time through the row's page table (each token's page looked up, so pages may be anywhere
in the pool and a row's last page partly filled), and keeps an online softmax in float32. With one split the
program writes the row's output; with more, each writes its part and the log of its softmax total, and
``_merge`` combines a row's parts (a split past a row's keys writes an empty part, of weight zero). A split is a
fixed number of keys, whatever the batch, so a row's result does not depend on the other rows (batched ==
single, exactly, in float32).

Keys are upcast to float32 before the products, on every device: bf16 and fp16 values are exact in TF32, which
the GPU's products then take (``precision``), and the interpreter's 16-bit products are not to be trusted. The
loops have static bounds (the interpreter cannot take a bound loaded from memory) and skip the blocks past a
row's keys, so nothing a step launches depends on a value read on the host: it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_attention(
    Q, K, V, TABLE, LENGTHS, OUT, LSE,
    stride_qr, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_tr,
    stride_or, stride_oh, stride_os,
    stride_lr, stride_lh,
    scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    PARTS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(LENGTHS + row)
    start = split * SPLIT
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_live = g < GROUP
    d_live = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(Q + row * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=g_live[:, None] & d_live[None, :], other=0.0).to(tl.float32)  # fmt: skip
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i in range(0, SPLIT, BLOCK_N):
        if start + i < length:
            t = start + i + tl.arange(0, BLOCK_N)
            live = t < length
            page = tl.load(TABLE + row * stride_tr + t // PAGE, mask=live, other=0).to(tl.int64)
            at = t % PAGE
            kv_live = live[:, None] & d_live[None, :]
            k = tl.load(K + (page * stride_kp + at * stride_kt + kv_head * stride_kh)[:, None] + d[None, :],
                        mask=kv_live, other=0.0).to(tl.float32)  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
            scores = tl.where(live[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            keep = tl.exp(top - shift)
            weights = tl.exp(scores - shift[:, None])
            total = total * keep + tl.sum(weights, 1)
            v = tl.load(V + (page * stride_vp + at * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
                        mask=kv_live, other=0.0).to(tl.float32)  # fmt: skip
            acc = acc * keep[:, None] + tl.dot(weights, v, input_precision=PRECISION)
            top = new_top
    safe = tl.where(total > 0.0, total, 1.0)
    out = acc / safe[:, None]
    where = OUT + row * stride_or + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(where, out.to(OUT.dtype.element_ty), mask=g_live[:, None] & d_live[None, :])
    if PARTS:
        lse = tl.where(total > 0.0, top + tl.log(safe), float("-inf"))
        tl.store(LSE + row * stride_lr + heads * stride_lh + split, lse, mask=g_live)


@triton.jit
def _merge(
    PARTS, LSE, OUT, splits,
    stride_pr, stride_ph, stride_ps,
    stride_lr, stride_lh,
    stride_or, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_live = s < splits
    d_live = d < HEAD_DIM
    lse = tl.load(LSE + row * stride_lr + head * stride_lh + s, mask=s_live, other=float("-inf"))
    top = tl.max(lse, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - shift)  # an empty part: exp(-inf) = 0
    parts = tl.load(PARTS + row * stride_pr + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=s_live[:, None] & d_live[None, :], other=0.0)  # fmt: skip
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + row * stride_or + head * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d_live)


def _blocks(query: torch.Tensor, group: int) -> tuple[int, int]:
    """The query-heads and head-dim blocks (``tl.dot`` takes at least 16 of each)."""
    return max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(query.shape[-1]))


def split_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, scale: float, splits: int, split: int, block: int,
                    parts: torch.Tensor, lse: torch.Tensor | None) -> None:  # fmt: skip
    """Launch the split kernel: ``parts`` takes ``[rows, heads, splits, dim]`` (or ``[rows, heads, dim]`` output with
    one split and no ``lse``)."""
    rows, heads, dim = query.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    block_g, block_d = _blocks(query, group)
    out_split = parts.stride(2) if lse is not None else 0
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    _split_attention[(rows, kv_heads, splits)](
        query, keys, values, table, lengths, parts, lse if lse is not None else parts,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        table.stride(0),
        parts.stride(0), parts.stride(1), out_split,
        *lse_strides,
        scale,
        GROUP=group, HEAD_DIM=dim, PAGE=keys.shape[1], SPLIT=split, BLOCK_N=block, BLOCK_G=block_g,
        BLOCK_D=block_d, PARTS=lse is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip


def merge(parts: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Launch the merge: ``parts`` ``[rows, heads, splits, dim]`` float32 and ``lse`` ``[rows, heads, splits]`` into
    ``out`` ``[rows, heads, dim]``."""
    rows, heads, splits, dim = parts.shape
    _merge[(rows, heads)](
        parts, lse, out, splits,
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=dim, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        num_warps=4,
    )  # fmt: skip
