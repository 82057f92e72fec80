"""The Triton kernel behind :mod:`~vlm_demo.engine.weights.packed`: a matrix product that reads 8- or 4-bit weights as
stored and widens them in registers (``@triton.jit``, the language only, and its launcher).

Imported at the first launch, so that ``TRITON_INTERPRET=1`` (Triton's interpreter: the same kernel on CPU
tensors, with numpy) is read then, as Triton requires.

One program computes a ``BLOCK_M × BLOCK_N`` tile of ``out = residual + alpha · x @ Wᵀ`` (batch rows × weight
rows), walking ``BLOCK_K`` inputs at a time (int4: one group): ``x``'s tile in its dtype, the weights' in theirs,
widened in registers and multiplied on the tensor cores into float32 sums; the scales come after the sum.

**Tiles** (:func:`blocks`; docs/quantization.md has their compiled figures). A decode step's 1–32 rows take
``BLOCK_M`` 16 or 32 and 64 weight rows (int4: 128) on 4 warps: the tensor-core layout puts one warp per 16
(int4: 32) weight rows, so no warp repeats another's widening or products (16 × 16 tiles did it 2–4 times). Up to
256 rows one program takes the whole batch (8-bit formats; 8 warps above 64 rows), so each weight byte is read
from memory once per step; int4 stops at 64-row blocks (its per-group sums would spill above) and the grid runs
the row blocks that share a weight tile fastest (``program_id(0)``), so they read it together, from L2.

**Widening by bit placement** (integer operations only, no conversion instructions; a test checks every code):

- **int4**, from int32 words of 8 codes: ``(word & 0x000F000F) | 0x43004300`` is two bf16 ``128 + c`` (exponent
  2⁷, the code in the mantissa's low bits), for bytes 0 and 2 of the word; ``word >> 8`` gives bytes 1 and 3,
  ``word >> 4`` the high halves. The 128 folds into the group's zero: ``scale · Σx·(128 + c) + (zero −
  128·scale) · Σx`` — two fused multiply-adds per output per group, ``Σx`` from ``x``'s bf16 bits.
- **fp8** (e4m3), from int32 words of 4 bytes: ``((word << 4) & 0x07F007F0) | ((word << 8) & 0x80008000)``
  places bytes 0 and 2 as bf16 (sign to bit 15, the 7 exponent and mantissa bits under it: the 4 exponent bits
  land in bf16's low exponent bits, bias 127 for 7), ``((word >> 4) & 0x07F007F0) | (word & 0x80008000)`` bytes
  1 and 3. Each is the e4m3 value × 2⁻¹²⁰, subnormals and zeros too (bf16 subnormals); the 2¹²⁰ multiplies the
  row scale.
- **int8**: on sm_80 and sm_89, from int32 words: ``(word & 0x007F007F) | 0x43004300`` is ``128 + `` the low 7
  bits, ``(word & 0x00800080) | 0x43004300`` is ``128 + 128 ·`` the sign bit, and their bf16 difference is the
  int8 value (exact). On sm_90 and later ``.to(bf16)``, which Triton lowers to the same trick with PRMT/LOP3/HADD2
  and schedules better there (under the interpreter, whose bf16 arithmetic and int8 casts are wrong, both go
  through float32; tests pick the word path with ``capability=80``).

Float32 inputs (the CPU tests) take fp32 patterns of the same placement and IEEE products; fp16 the fp16 ones.

**Split-K** (:func:`splits`): where the weight tiles alone give fewer than ``PROGRAMS`` programs (a 4,096-wide
projection: 64 tiles), up to ``MAX_SPLIT`` programs share a tile's inputs; each parks its float32 part, and the
last to arrive (an atomic ticket per tile, which that program resets to zero, so a CUDA graph replays it) adds
the parts in split order and stores. Grid, splits and loop bounds depend on shapes only: nothing is read back
to the host.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _pairs(even, odd, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """Two int32 tensors ``[ROWS, COLUMNS / 4]`` of bf16 pairs — ``even`` holding inputs 4j and 4j + 2 (low and
    high half), ``odd`` 4j + 1 and 4j + 3 — as the ``[ROWS, COLUMNS]`` bf16 tensor in input order."""
    e2 = tl.join(even.to(tl.int16).to(tl.bfloat16, bitcast=True),
                 (even >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))  # fmt: skip
    o2 = tl.join(odd.to(tl.int16).to(tl.bfloat16, bitcast=True),
                 (odd >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))  # fmt: skip
    return tl.reshape(tl.join(e2, o2), [ROWS, COLUMNS])  # [rows, j, half, parity]: input 4j + 2·half + parity


@triton.jit
def _fp8_words(words, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """int32 words of four e4m3 bytes as bf16 × 2^-120: each byte's sign to its half's bit 15, its 7 exponent and
    mantissa bits shifted left by 4 — bytes 0 and 2 with one shift and two masks of the whole word, 1 and 3 too."""
    even = ((words << 4) & 0x07F007F0) | ((words << 8) & -0x7FFF8000)  # -0x7FFF8000: 0x80008000, two sign bits
    odd = ((words >> 4) & 0x07F007F0) | (words & -0x7FFF8000)
    return _pairs(even, odd, ROWS, COLUMNS)


@triton.jit
def _int8_words(words, ROWS: tl.constexpr, COLUMNS: tl.constexpr, INTERPRETED: tl.constexpr):
    """int32 words of four int8 as bf16: ``(128 + low 7 bits) − (128 + the sign bit's 128)``, both operands placed
    into 0x4300 patterns (the sign bit already sits at bf16's mantissa top), one bf16 subtraction per pair."""
    low = _pairs((words & 0x007F007F) | 0x43004300, ((words >> 8) & 0x007F007F) | 0x43004300, ROWS, COLUMNS)
    top = _pairs((words & 0x00800080) | 0x43004300, ((words >> 8) & 0x00800080) | 0x43004300, ROWS, COLUMNS)
    if INTERPRETED:  # the interpreter subtracts bf16's raw bits: the same difference in float32 there
        return (_float32(low) - _float32(top)).to(tl.bfloat16)
    else:
        return low - top


@triton.jit
def _int4_words(words, HIGH: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """int32 words of four bytes of codes as bf16 ``128 + c`` (the code OR-ed into the pattern 0x4300): the low
    halves, or the high ones (shifted down by 4); one shift and one mask-and-OR per two codes."""
    if HIGH:
        words = words >> 4
    return _pairs((words & 0x000F000F) | 0x43004300, ((words >> 8) & 0x000F000F) | 0x43004300, ROWS, COLUMNS)


@triton.jit
def _widen(w, FP8: tl.constexpr, WIDE: tl.constexpr, INTERPRETED: tl.constexpr):
    """int8 or e4m3 ``w`` elementwise as ``WIDE`` (fp32, fp16; bf16 where the inputs are not whole words)."""
    if FP8:
        b = w.to(tl.uint8, bitcast=True)
        if WIDE == tl.float32:  # fp32: 8 exponent bits like bf16's, × 2^-120
            b = b.to(tl.uint32)
            return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
        elif WIDE == tl.float16:  # fp16: 5 exponent bits (bias 15), × 2^-8
            b = b.to(tl.uint16)
            return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
        else:
            b = b.to(tl.uint16)
            return (((b & 0x80) << 8) | ((b & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
    elif INTERPRETED:  # Triton's interpreter casts int8 to bf16 wrongly (NaN; checked on 3.9): through fp32 there
        return w.to(tl.float32).to(WIDE)
    else:
        return w.to(WIDE)  # ptxas widens int8 pairs with PRMT/LOP3/HADD2 on sm_90 (0 conversions, measured)


@triton.jit
def _nibbles(codes, HIGH: tl.constexpr, WIDE: tl.constexpr):
    """Codes elementwise (fp32, fp16, bf16 off whole words) as ``BASE + c`` (BASE 128, fp16 1024: the code in
    the low mantissa bits of 2⁷ or 2¹⁰)."""
    if HIGH:
        codes = codes >> 4
    mask: tl.constexpr = 0x0F
    if WIDE == tl.float32:
        return (((codes.to(tl.uint32) & mask) << 16) | 0x43000000).to(tl.float32, bitcast=True)
    elif WIDE == tl.float16:
        return ((codes.to(tl.uint16) & mask) | 0x6400).to(tl.float16, bitcast=True)
    else:
        return ((codes.to(tl.uint16) & mask) | 0x4300).to(tl.bfloat16, bitcast=True)


@triton.jit
def _times_2_64(x, INTERPRETED: tl.constexpr):
    """bf16 ``x · 2⁶⁴``: one HMUL2 per pair on the GPU; the interpreter multiplies bf16's raw bits, so there 64 is
    added to the exponent field (the same value for every normal ``|x| < 2⁶³``; a zero becomes 2⁻⁶³, whose products
    with the placed weights, ≤ 2⁻¹¹¹, are below float32's smallest subnormal and round to zero)."""
    if INTERPRETED:
        return (x.to(tl.int16, bitcast=True) + 0x2000).to(tl.bfloat16, bitcast=True)
    else:
        return x * 18446744073709551616.0


@triton.jit
def _float32(x):
    """A bf16 (or other float) tensor as fp32; bf16 by placing its bits (exact; no conversion instruction)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _int4_product(X, W, SCALE, ZERO, m_read, n_read, split, acc, stride_xm, stride_wn, stride_sn, stride_sg,
                  K: tl.constexpr, GROUP: tl.constexpr, WORDS: tl.constexpr, PRECISION: tl.constexpr,
                  SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """``acc`` plus this split's groups of int4 products: each group's codes widened, multiplied, then its scale and
    (the pattern's base folded in) its zero applied."""
    wide: tl.constexpr = X.dtype.element_ty
    half = tl.arange(0, GROUP // 2)
    per_split: tl.constexpr = K // GROUP // SPLIT_K
    base: tl.constexpr = 1024.0 if wide == tl.float16 else 128.0  # what a code's pattern adds to it
    for group in range(split * per_split, split * per_split + per_split):
        x_low = tl.load(X + m_read[:, None] * stride_xm + group * GROUP + half[None, :])
        x_high = tl.load(X + m_read[:, None] * stride_xm + group * GROUP + GROUP // 2 + half[None, :])
        if WORDS:
            quarter = tl.arange(0, GROUP // 8)
            codes = tl.load(W + n_read[:, None] * stride_wn + group * (GROUP // 8) + quarter[None, :])
            w_low = _int4_words(codes, False, BLOCK_N, GROUP // 2)
            w_high = _int4_words(codes, True, BLOCK_N, GROUP // 2)
        else:
            codes = tl.load(W + n_read[:, None] * stride_wn + group * (GROUP // 2) + half[None, :])
            w_low = _nibbles(codes, False, wide)
            w_high = _nibbles(codes, True, wide)
        scale = tl.load(SCALE + n_read * stride_sn + group * stride_sg).to(tl.float32)  # group-major: contiguous
        zero = tl.load(ZERO + n_read * stride_sn + group * stride_sg).to(tl.float32)
        part = tl.dot(x_low, tl.trans(w_low), input_precision=PRECISION)
        part = tl.dot(x_high, tl.trans(w_high), part, input_precision=PRECISION)
        total = tl.sum(_float32(x_low) + _float32(x_high), 1)
        acc = tl.fma(part, scale[None, :], acc)  # two fused multiply-adds an element per group
        acc = tl.fma(total[:, None], (zero - base * scale)[None, :], acc)
    return acc


@triton.jit
def _weight_only_matmul(
    X, W, SCALE, ZERO, RES, OUT, PARTS, TICKETS,
    M, N,
    stride_xm, stride_wn, stride_sn, stride_sg, stride_rm, stride_om,
    alpha,
    K: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr, FP8: tl.constexpr, WORDS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, PRECISION: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(1)  # the row blocks that share a weight tile run fastest, so together (its bytes in L2)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_read = tl.minimum(n, N - 1)  # a partial tile reads a valid row again and does not store it: no load masks
    m_read = tl.minimum(m, M - 1)
    wide: tl.constexpr = X.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if INT4:  # a group of GROUP inputs is GROUP // 2 bytes: input j in byte j's low half, j + GROUP // 2 in its high
        acc = _int4_product(X, W, SCALE, ZERO, m_read, n_read, split, acc, stride_xm, stride_wn, stride_sn, stride_sg,
                            K, GROUP, WORDS, PRECISION, SPLIT_K, BLOCK_N)  # fmt: skip
    else:
        k = tl.arange(0, BLOCK_K)
        per_split: tl.constexpr = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        for start in range(split * per_split, split * per_split + per_split, BLOCK_K):
            if WORDS:  # e4m3 or int8 bytes read four to an int32 and widened two at a time
                words = tl.load(W + n_read[:, None] * stride_wn + start // 4 + tl.arange(0, BLOCK_K // 4)[None, :])
                x = tl.load(X + m_read[:, None] * stride_xm + start + k[None, :])
                if FP8:
                    w = _fp8_words(words, BLOCK_N, BLOCK_K)
                else:
                    w = _int8_words(words, BLOCK_N, BLOCK_K, INTERPRETED)
            elif K % (BLOCK_K * SPLIT_K) == 0:
                x = tl.load(X + m_read[:, None] * stride_xm + start + k[None, :])
                w = _widen(tl.load(W + n_read[:, None] * stride_wn + start + k[None, :]), FP8, wide, INTERPRETED)
            else:  # the last step's inputs past K: x's are zero, the weights' a valid column again (no fill value)
                k_live = start + k < K
                x = tl.load(X + m_read[:, None] * stride_xm + start + k[None, :], mask=k_live[None, :], other=0.0)
                w = tl.load(W + n_read[:, None] * stride_wn + tl.minimum(start + k, K - 1)[None, :])
                w = _widen(w, FP8, wide, INTERPRETED)
            if FP8 and wide == tl.bfloat16:  # 2^64 of the placement's 2^-120 moved onto x (exact: a power of two)
                x = _times_2_64(x, INTERPRETED)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        row_scale = tl.load(SCALE + n_read)
        if FP8:  # what the e4m3 placement leaves: fp16 2^8; bf16 2^56 (2^120 less x's 2^64); fp32 2^120
            row_scale *= 256.0 if wide == tl.float16 else 7.205759403792794e16 if wide == tl.bfloat16 else 2.0**120
        acc *= row_scale[None, :]
    live = (m < M)[:, None] & (n < N)[None, :]
    _store(acc, alpha, RES, OUT, PARTS, TICKETS, n, m, live, split, tile, stride_rm, stride_om, HAS_RESIDUAL,
           SPLIT_K, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _store(acc, alpha, RES, OUT, PARTS, TICKETS, n, m, live, split, tile, stride_rm, stride_om,
           HAS_RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The tile's sum out: at once, or with split-K parked, the last split of the tile to arrive adding them all."""
    if SPLIT_K > 1:  # park this split's part; the last split of the tile to arrive adds them all, in split order
        out_tile = tile * tl.num_programs(0) + tl.program_id(0)
        parts = PARTS + out_tile * SPLIT_K * (BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
        parts += tl.arange(0, BLOCK_N)[None, :]
        tl.store(parts + split * (BLOCK_M * BLOCK_N), acc)
        tl.debug_barrier()  # every thread's part stored before the (one-thread, releasing) ticket
        ticket = tl.atomic_add(TICKETS + out_tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the others' parts, read past L1 (not coherent across SMs)
            acc = tl.load(parts, cache_modifier=".cg")
            for other in range(1, SPLIT_K):
                acc += tl.load(parts + other * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            tl.atomic_xchg(TICKETS + out_tile, 0)  # zero again for the next launch (a graph's replay)
            _finish(acc, alpha, RES, OUT, n, m, live, stride_rm, stride_om, HAS_RESIDUAL)
    else:
        _finish(acc, alpha, RES, OUT, n, m, live, stride_rm, stride_om, HAS_RESIDUAL)


@triton.jit
def _finish(acc, alpha, RES, OUT, n, m, live, stride_rm, stride_om, HAS_RESIDUAL: tl.constexpr):
    """``residual + alpha · acc`` into ``out`` ``[M, N]``."""
    acc *= alpha
    if HAS_RESIDUAL:
        acc += tl.load(RES + m[:, None] * stride_rm + n[None, :], mask=live, other=0.0).to(tl.float32)
    tl.store(OUT + m[:, None] * stride_om + n[None, :], acc.to(OUT.dtype.element_ty), mask=live)


PROGRAMS = 264  # programs a product wants in flight: 2 per SM of an H100 (132), more than an L40S's 142
MAX_SPLIT = 8


def blocks(rows: int, int4_group: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for ``rows`` rows (see the module's docstring)."""
    if int4_group:
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
        return block_m, 128 if block_m <= 32 else 64, int4_group
    block_m = min(256, max(16, triton.next_power_of_2(rows)))
    return block_m, 64, 128 if block_m <= 64 else 64


def warps(block_m: int) -> int:
    """4 warps (one warpgroup) up to 64 batch rows, 8 above (the accumulator's registers)."""
    return 4 if block_m <= 64 else 8


SHARED = 101376  # shared memory a program may take on every target (sm_89 and sm_120: 99 KiB; sm_80 163, sm_90 227)


def stages(block_m: int, block_n: int, block_k: int, int4: bool) -> int:
    """Pipeline depth (``num_stages``: that many minus one tiles in flight) that fits ``SHARED``: each stage holds an
    ``x`` tile and a weight tile; 64+ batch rows add a widened bf16 weight tile for Hopper's ``wgmma`` (twice)."""
    per_stage = block_m * block_k * 2 + block_n * block_k // (2 if int4 else 1)
    staging = 4 * block_n * block_k if block_m >= 64 else 0
    return max(2, min(4, (SHARED - staging) // per_stage + 1))


def splits(columns: int, width: int, block_n: int, block_k: int) -> int:
    """Programs per row tile along the inputs: enough that ``PROGRAMS`` run (a power of two, at most
    ``MAX_SPLIT``, dividing the input steps evenly); 1 where the row tiles alone are enough."""
    tiles, steps = triton.cdiv(columns, block_n), width // block_k
    split = 1
    while tiles * split < PROGRAMS and split < MAX_SPLIT and steps % (2 * split) == 0:
        split *= 2
    return split


_TICKETS: dict[torch.device, torch.Tensor] = {}


def tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, kept per device (the last split of a tile resets its own, so they
    are zero again after every launch: a CUDA graph captures the pointer once)."""
    held = _TICKETS.get(device)
    if held is None or held.numel() < count:
        held = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = held
    return held


def _capability(device: torch.device, given: int | None) -> int:
    """``given``, else the CUDA device's compute capability as 80, 89, 90…; 90 elsewhere (meta, CPU)."""
    if given is not None:
        return given
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return 90


def weight_only_matmul(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       residual: torch.Tensor | None, alpha: float, out: torch.Tensor,
                       capability: int | None = None) -> None:  # fmt: skip
    """Launch the kernel: ``x`` ``[M, K]`` (unit stride along K), ``values`` ``[N, K]`` (int8, float8 e4m3) with
    ``scale`` ``[N]``, or ``[N, K / 2]`` 4-bit codes with ``scale`` and ``zero`` ``[N, K / group]``; ``residual``
    and ``out`` ``[M, N]``; ``capability`` (80, 89, 90…) for a launch recorded on ``meta`` (else the device's)."""
    rows, width = x.shape
    columns = values.shape[0]
    group = width // scale.shape[1] if zero is not None else 0
    block_m, block_n, block_k = blocks(rows, group)
    split = splits(columns, width, block_n, block_k)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(columns, block_n), split)
    # bf16 inputs read the weights as int32 words (4 bytes: fp8's or int4's codes) and widen two at a time
    fp8 = values.dtype == torch.float8_e4m3fn
    words = x.dtype == torch.bfloat16 and values.stride(0) % 4 == 0 and values.shape[1] % 4 == 0
    words = words and (group % 8 == 0 if zero is not None else width % (block_k * split) == 0)
    if values.dtype == torch.int8:  # placed bits beat Triton's own widening where that takes I2F (sm_80, sm_89)
        words = words and _capability(x.device, capability) < 90
    if words:
        values = values.view(torch.int32)
    if zero is not None and zero.stride() != scale.stride():  # one pair of strides serves both tables
        zero = torch.empty_like(scale).copy_(zero)
    parts, ticket = out, scale  # unread without a split
    if split > 1:
        parts = torch.empty(grid[0] * grid[1] * split * block_n * block_m, dtype=torch.float32, device=x.device)
        ticket = tickets(x.device, grid[0] * grid[1])
    _weight_only_matmul[grid](
        x, values, scale, zero if zero is not None else scale, residual if residual is not None else out, out,
        parts, ticket,
        rows, columns,
        x.stride(0), values.stride(0), scale.stride(0), scale.stride(1) if scale.dim() > 1 else 0,
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        alpha,
        K=width, GROUP=max(group, 1), INT4=zero is not None, FP8=fp8, WORDS=words,
        HAS_RESIDUAL=residual is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SPLIT_K=split,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps(block_m), num_stages=stages(block_m, block_n, block_k, zero is not None),
    )  # fmt: skip
