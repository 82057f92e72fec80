"""The Triton paged decode-attention kernels (``@triton.jit``, the language only) and their launchers.

Imported only when the Triton kernel is chosen, so that ``TRITON_INTERPRET=1`` (Triton's interpreter: the same
kernels on CPU tensors, with numpy) is read at the first import, as Triton requires.

One program takes one row, one key/value head and one *split* of that row's keys (flash-decoding): it loads the
row's query heads of that key/value head (GQA: ``group`` of them, one matrix), walks its split's keys ``BLOCK_N``
at a time through the row's page table, and keeps an online softmax in float32. With one split the program writes
the row's output; with more, each writes its part and the (base-2) log of its softmax total, and ``_merge``
combines a row's parts.

**Splits are chosen on the device**, from each row's own length (``_row_splits``): a row of ``blocks`` key blocks
takes ``min(max_splits, cdiv(blocks, MIN_BLOCKS))`` splits, its blocks dealt out evenly (the first splits one
more). ``max_splits`` is the launch's third grid dimension, sized by the launcher from the GPU's multiprocessors
so that one long row spreads over all of them; a program past its row's splits returns at once and writes
nothing, and the merge reads only the parts written. A row's splits depend on its length alone, never on the
other rows: batched == single, exactly, in float32. Nothing a step launches depends on a value read on the host:
it can be captured in a CUDA graph (the lengths live in the graph's static buffers).

**The key loop runs between bounds loaded from memory** (``range(lo, hi, BLOCK_N)``), the form Triton's software
pipeliner rewrites into asynchronous copies (``cp.async``) issued stages ahead; loads under an ``if`` inside the
loop it would leave alone. Where a page holds a whole number of blocks (the GPU's 256-token text and 1,024-token
image pages) a block reads one page number; else each key looks its page up. Keys and values are loaded as stored
(both issued before the first product) and multiplied in their own precision with float32 accumulation: bf16
products on tensor cores on a GPU, float32 products (``ieee``) for float32 caches such as the CPU tests'.

**An fp8 pool** (``SCALED``, a constant: the 16-bit kernel is compiled as before) passes its scale arenas (one
float32 per token per KV head, keys and values apart): each block's fp8 keys and values are widened in registers to
the queries' dtype, the key scales multiply the block's scores (``q·k × kscale[token]``) and the value scales its
weights before the product with the values (``p × vscale[token]``); the softmax's totals take the weights
unscaled. No 16-bit copy of the pool is made. The pages are read as bytes and widened by placing each e4m3
byte's bits in a bf16 (or fp32) pattern, which is its value × 2^-120 (subnormals too; fp16: × 2^-8): integer
operations, where a conversion instruction runs at a quarter of their rate (``.to(bf16)`` compiled to ~3
conversions per 2 values on sm_90 and made the loop conversion-bound), and no e4m3 type, so Ampere (sm_80)
compiles it too. The power of two is given back exactly: 2^64 on the queries (once per program), 2^56 in the
scales, and the output's 2^-64 at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_splits(length, max_splits, BLOCK_N: tl.constexpr, MIN_BLOCKS: tl.constexpr):
    """A row's key blocks and its splits (at least one: an empty row writes zeros once)."""
    blocks = tl.cdiv(length, BLOCK_N)
    return blocks, tl.maximum(tl.minimum(tl.cdiv(blocks, MIN_BLOCKS), max_splits), 1)


@triton.jit
def _load_block(k_head, v_head, pages, s, hi, stride_kp, stride_kt, stride_vp, stride_vt,
                HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Keys ``s … s + BLOCK_N`` (those below ``hi``) of one KV head, keys and values as stored, and which are live."""
    n = tl.arange(0, BLOCK_N)
    t = s + n
    live = t < hi
    if PAGE % BLOCK_N == 0:  # the block lies in one page: one page number for it
        page = tl.load(pages + s // PAGE).to(tl.int64)
        k_at = page * stride_kp + (s % PAGE + n) * stride_kt
        v_at = page * stride_vp + (s % PAGE + n) * stride_vt
    else:
        page = tl.load(pages + t // PAGE, mask=live, other=0).to(tl.int64)
        k_at = page * stride_kp + (t % PAGE) * stride_kt
        v_at = page * stride_vp + (t % PAGE) * stride_vt
    if HEAD_DIM == BLOCK_D:  # a mask constant along the head dim: 16-byte loads
        kv_mask = live[:, None]
    else:
        kv_mask = live[:, None] & (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, :]
    k = tl.load(k_head + k_at[:, None], mask=kv_mask, other=0.0)
    v = tl.load(v_head + v_at[:, None], mask=kv_mask, other=0.0)
    return k, v, live


@triton.jit
def _split_bounds(split, blocks, splits, length, BLOCK_N: tl.constexpr):
    """The keys ``lo … hi`` of one of a row's splits (the first ``blocks % splits`` take one block more)."""
    each = blocks // splits
    more = blocks % splits
    first = split * each + tl.minimum(split, more)
    return first * BLOCK_N, tl.minimum((first + each + (split < more).to(tl.int32)) * BLOCK_N, length)


@triton.jit
def _widened(k, v, ks_head, vs_head, pages, s, hi, stride_sp, stride_st, WIDE: tl.constexpr, LEFT: tl.constexpr,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """An fp8 block's keys and values placed in ``WIDE``, and the factors its scores and weights take: the key and
    value scales (float32, one per token of this KV head; 0 past ``hi``) × ``LEFT``."""
    n = tl.arange(0, BLOCK_N)
    t = s + n
    live = t < hi
    if PAGE % BLOCK_N == 0:
        at = tl.load(pages + s // PAGE).to(tl.int64) * stride_sp + (s % PAGE + n) * stride_st
    else:
        at = tl.load(pages + t // PAGE, mask=live, other=0).to(tl.int64) * stride_sp + (t % PAGE) * stride_st
    k_scale, v_scale = tl.load(ks_head + at, mask=live, other=0.0), tl.load(vs_head + at, mask=live, other=0.0)
    return _placed(k, WIDE), _placed(v, WIDE), k_scale * LEFT, v_scale * LEFT


@triton.jit
def _placed(x, WIDE: tl.constexpr):
    """e4m3 ``x`` as ``WIDE`` by placing its bits: × 2^-120 in bf16 or fp32 (8 exponent bits, bias 127 against
    e4m3's 4 and 7), × 2^-8 in fp16 (5, bias 15); e4m3's subnormals land on the wide type's."""
    b = x.to(tl.uint8, bitcast=True)
    if WIDE == tl.float32:
        b = b.to(tl.uint32)
        return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
    elif WIDE == tl.float16:
        b = b.to(tl.uint16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    else:
        b = b.to(tl.uint16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _split_attention(
    Q, K, V, TABLE, LENGTHS, OUT, LSE, KS, VS,
    stride_qr, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_tr, stride_or, stride_oh, stride_os,
    stride_lr, stride_lh, stride_sp, stride_st, stride_sh,
    scale, max_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_BLOCKS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr,
    PRECISION: tl.constexpr, SCALED: tl.constexpr, LIFT: tl.constexpr, LEFT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(LENGTHS + row)
    blocks, splits = _row_splits(length, max_splits, BLOCK_N, MIN_BLOCKS)
    if split < splits:
        lo, hi = _split_bounds(split, blocks, splits, length, BLOCK_N)
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        head_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(Q + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=head_mask, other=0.0)
        if SCALED:  # LIFT (2^64, exact) of the placement's 2^-120 given back on the queries
            q = (q.to(tl.float32) * LIFT).to(q.dtype)
        qk_scale = scale * 1.4426950408889634  # log2(e): scores in base 2, as exp2 is one instruction and exp two
        top = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        k_head = K + kv_head * stride_kh + d[None, :]
        v_head = V + kv_head * stride_vh + d[None, :]
        pages = TABLE + row * stride_tr
        for s in range(lo, hi, BLOCK_N):
            k, v, live = _load_block(k_head, v_head, pages, s, hi, stride_kp, stride_kt, stride_vp, stride_vt,
                                     HEAD_DIM, PAGE, BLOCK_N, BLOCK_D)  # fmt: skip
            if SCALED:  # fp8 pages: widened here, their scales folded into the scores and the weights
                k, v, k_fold, v_fold = _widened(k, v, KS + kv_head * stride_sh, VS + kv_head * stride_sh, pages, s, hi,
                                                stride_sp, stride_st, q.dtype, LEFT, PAGE, BLOCK_N)  # fmt: skip
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (k_fold * qk_scale)[None, :]
            else:
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], base 2
            scores = tl.where(live[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            keep = tl.exp2(top - shift)
            weights = tl.exp2(scores - shift[:, None])
            total = total * keep + tl.sum(weights, 1)
            if SCALED:
                weights = weights * v_fold[None, :]
            acc = acc * keep[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            top = new_top
        safe = tl.where(total > 0.0, total, 1.0)
        if SCALED:
            acc = acc * LIFT  # the values' placement: 2^-120 × LEFT's 2^56
        out = acc / safe[:, None]
        where = OUT + row * stride_or + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(where, out.to(OUT.dtype.element_ty), mask=head_mask)
        if PARTS:
            lse = tl.where(total > 0.0, top + tl.log2(safe), float("-inf"))
            tl.store(LSE + row * stride_lr + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit
def _merge(
    PARTS, LSE, LENGTHS, OUT, max_splits,
    stride_pr, stride_ph, stride_ps,
    stride_lr, stride_lh,
    stride_or, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MIN_BLOCKS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    _, splits = _row_splits(tl.load(LENGTHS + row), max_splits, BLOCK_N, MIN_BLOCKS)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_live = s < splits  # only the parts the row's splits wrote
    d_live = d < HEAD_DIM
    lse = tl.load(LSE + row * stride_lr + head * stride_lh + s, mask=s_live, other=float("-inf"))
    top = tl.max(lse, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - shift)  # an empty part: exp2(-inf) = 0
    parts = tl.load(PARTS + row * stride_pr + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=s_live[:, None] & d_live[None, :], other=0.0)  # fmt: skip
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + row * stride_or + head * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d_live)


def _blocks(query: torch.Tensor, group: int) -> tuple[int, int]:
    """The query-heads and head-dim blocks (``tl.dot`` takes at least 16 of each)."""
    return max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(query.shape[-1]))


def split_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, scale: float, block: int, min_blocks: int, max_splits: int,
                    out: torch.Tensor, lse: torch.Tensor | None, key_scales: torch.Tensor | None = None,
                    value_scales: torch.Tensor | None = None) -> None:  # fmt: skip
    """Launch the split kernel: ``out`` takes ``[rows, heads, max_splits, dim]`` parts and ``lse`` their logs, or,
    with ``max_splits`` 1 and no ``lse``, the ``[rows, heads, dim]`` output. fp8 ``keys``/``values`` come with
    their ``key_scales``/``value_scales`` (``[pages, tokens per page, kv heads]`` float32, strided alike)."""
    rows, heads, dim = query.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    block_g, block_d = _blocks(query, group)
    out_split = out.stride(2) if lse is not None else 0
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    scaled = key_scales is not None and value_scales is not None
    if scaled:  # read as bytes (no e4m3 type in the kernel: every GPU compiles it, sm_80 too) and placed
        assert key_scales.stride() == value_scales.stride(), "key and value scales are carved alike"  # type: ignore[union-attr]
        scale_strides = key_scales.stride()  # type: ignore[union-attr]
        keys, values = keys.view(torch.uint8), values.view(torch.uint8)
    else:
        scale_strides = (0, 0, 0)
    _split_attention[(rows, kv_heads, max_splits)](
        query, keys, values, table, lengths, out, lse if lse is not None else out,
        key_scales if scaled else lengths, value_scales if scaled else lengths,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        table.stride(0),
        out.stride(0), out.stride(1), out_split,
        *lse_strides,
        *scale_strides,
        scale, max_splits,
        GROUP=group, HEAD_DIM=dim, PAGE=keys.shape[1], BLOCK_N=block, MIN_BLOCKS=min_blocks, BLOCK_G=block_g,
        BLOCK_D=block_d, PARTS=lse is not None, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SCALED=scaled, LIFT=1.0 if query.dtype == torch.float16 else 2.0**64,
        LEFT=2.0**8 if query.dtype == torch.float16 else 2.0**56, num_warps=4,
    )  # fmt: skip


def merge(parts: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor, block: int, min_blocks: int,
          out: torch.Tensor) -> None:  # fmt: skip
    """Launch the merge: each row's written ``parts`` ``[rows, heads, max_splits, dim]`` (float32) and ``lse``
    ``[rows, heads, max_splits]`` into ``out`` ``[rows, heads, dim]``."""
    rows, heads, max_splits, dim = parts.shape
    _merge[(rows, heads)](
        parts, lse, lengths, out, max_splits,
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=dim, BLOCK_N=block, MIN_BLOCKS=min_blocks, BLOCK_S=max(2, triton.next_power_of_2(max_splits)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), num_warps=4,
    )  # fmt: skip
