"""The Triton kernel behind :mod:`~vlm_demo.engine.packed`: a matrix product that reads 8- or 4-bit weights as
stored and widens them in registers (``@triton.jit``, the language only, and its launcher).

Imported at the first launch, so that ``TRITON_INTERPRET=1`` (Triton's interpreter: the same kernel on CPU
tensors, with numpy) is read then, as Triton requires.

One program computes a ``BLOCK_M × BLOCK_N`` tile of ``out = residual + alpha · x @ Wᵀ``, walking the inputs
``BLOCK_K`` at a time: it loads ``x``'s tile in its own dtype and the weights' tile in theirs (1 byte per weight;
int4: 1 byte per 2), widens the weights to ``x``'s dtype — exact for int8, e4m3 and 4-bit codes in bf16 and fp16
— and accumulates their product in float32 on the tensor cores. The scales come after the sum: a row's scale
(int8, fp8) multiplies the finished tile; an int4 group's scale and zero (``w = code · scale + zero``) multiply
that group's product and ``x``'s sum over the group. So every weight byte is read once, by one program, and the
scale, ``alpha`` and the residual add cost no launch of their own. The grid and loop bounds depend on shapes
only, so a CUDA graph captures it.

Float32 inputs take IEEE products. Under the interpreter 16-bit inputs are widened to float32 first (``UPCAST``):
its casts to bf16 and its bf16 products give garbage (Triton 3.9, checked here), so the CPU tests check the
kernel's indexing, unpacking, scales and residual in float32 arithmetic, and the GPU's 16-bit products are
Triton's own (the compile test checks they become tensor-core instructions).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _weight_only_matmul(
    X, W, SCALE, ZERO, RES, OUT,
    M, N,
    stride_xm, stride_wn, stride_sn, stride_rm, stride_om,
    alpha,
    K: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_live = m < M
    n_live = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if INT4:  # a group of GROUP inputs is GROUP // 2 bytes: input j in byte j's low half, j + GROUP // 2 in its high
        half = tl.arange(0, GROUP // 2)
        for group in range(0, K // GROUP):
            codes = tl.load(W + n[:, None] * stride_wn + group * (GROUP // 2) + half[None, :], mask=n_live[:, None],
                            other=0)  # fmt: skip
            x_low = tl.load(X + m[:, None] * stride_xm + group * GROUP + half[None, :], mask=m_live[:, None], other=0.0)
            x_high = tl.load(X + m[:, None] * stride_xm + group * GROUP + GROUP // 2 + half[None, :],
                             mask=m_live[:, None], other=0.0)  # fmt: skip
            if UPCAST:
                x_low, x_high = x_low.to(tl.float32), x_high.to(tl.float32)
            low = (codes & 15).to(x_low.dtype)
            high = (codes >> 4).to(x_low.dtype)
            part = tl.dot(x_low, tl.trans(low), input_precision=PRECISION)
            part += tl.dot(x_high, tl.trans(high), input_precision=PRECISION)
            total = tl.sum(x_low.to(tl.float32), 1) + tl.sum(x_high.to(tl.float32), 1)
            scale = tl.load(SCALE + n * stride_sn + group, mask=n_live, other=0.0).to(tl.float32)
            zero = tl.load(ZERO + n * stride_sn + group, mask=n_live, other=0.0).to(tl.float32)
            acc += part * scale[None, :] + total[:, None] * zero[None, :]
    else:
        k = tl.arange(0, BLOCK_K)
        for start in range(0, K, BLOCK_K):
            k_live = start + k < K
            w = tl.load(W + n[:, None] * stride_wn + start + k[None, :], mask=n_live[:, None] & k_live[None, :],
                        other=0.0)  # fmt: skip
            x = tl.load(X + m[:, None] * stride_xm + start + k[None, :], mask=m_live[:, None] & k_live[None, :],
                        other=0.0)  # fmt: skip
            if UPCAST:
                x = x.to(tl.float32)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
        acc *= tl.load(SCALE + n, mask=n_live, other=0.0)[None, :]
    acc *= alpha
    live = m_live[:, None] & n_live[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(RES + m[:, None] * stride_rm + n[None, :], mask=live, other=0.0).to(tl.float32)
    tl.store(OUT + m[:, None] * stride_om + n[None, :], acc.to(OUT.dtype.element_ty), mask=live)


def blocks(rows: int, int4_group: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for ``rows`` rows: a decode step's few rows take narrow column tiles, so
    that a 4,096-wide projection still spreads over ~256 programs (every multiprocessor reading weights); wider
    batches take squarer tiles, which read ``x`` fewer times; few rows also take longer steps along the inputs (more
    weight bytes in flight per program). ``tl.dot`` needs at least 16 of each. Chosen on paper, not tuned on a
    GPU: gpucheck's weight-format stage says whether a step beats bf16's."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 16 if rows <= 16 else 32 if rows <= 64 else 64
    return block_m, block_n, int4_group or (256 if rows <= 16 else 128)


def weight_only_matmul(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       residual: torch.Tensor | None, alpha: float, out: torch.Tensor) -> None:  # fmt: skip
    """Launch the kernel: ``x`` ``[M, K]`` (unit stride along K), ``values`` ``[N, K]`` (int8, float8 e4m3) with
    ``scale`` ``[N]``, or ``[N, K / 2]`` 4-bit codes with ``scale`` and ``zero`` ``[N, K / group]``; ``residual``
    and ``out`` ``[M, N]``."""
    rows, width = x.shape
    columns = values.shape[0]
    group = width // scale.shape[1] if zero is not None else 0
    block_m, block_n, block_k = blocks(rows, group)
    upcast = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"  # see the module's docstring
    grid = (triton.cdiv(columns, block_n), triton.cdiv(rows, block_m))
    _weight_only_matmul[grid](
        x, values, scale, zero if zero is not None else scale, residual if residual is not None else out, out,
        rows, columns,
        x.stride(0), values.stride(0), scale.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
        alpha,
        K=width, GROUP=max(group, 1), INT4=zero is not None, HAS_RESIDUAL=residual is not None,
        UPCAST=upcast, PRECISION="ieee" if upcast else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=4,
    )  # fmt: skip
