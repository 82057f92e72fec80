"""The language model's quantized projections in our own layout, and the one operator that multiplies by them.

torchao's tensors (what the loader quantizes into) cost a decode step more than they save: FP8 with dynamic
activations launches ~8 kernels per projection, int8 weight-only widens the whole weight to bf16 at every call
(reading ~5 bytes per weight instead of 1), and neither can be merged, so the step loses its merged q/k/v and
gate/up products and its residual adds. So once loaded, each quantized ``nn.Linear`` of the language model is
re-packed, once, into a :class:`PackedLinear`:

- **int8** and **fp8**: the ``[out, in]`` int8 / float8-e4m3 values as torchao made them (the same bytes, no copy)
  and one float32 scale per output row (``w = value · scale``; torchao's int8 zero points are all zero);
- **int4**: two 4-bit codes a byte (``[out, in / 2]``: in each group of ``group`` inputs, input ``j`` in byte
  ``j``'s low half and ``j + group / 2`` in its high half) and, per group of a row, a scale and a zero in the
  model dtype (``w = code · scale + zero``, codes 0–15: the group's minimum to its maximum), ``[out, groups]``
  tables stored group-major (:func:`group_major`). torchao's int4
  layouts (tinygemm's tiles, aten's CPU packing) cannot be concatenated or read by our kernel, so their values
  are read back through the layer itself and packed again — on the same 16-level grid, so nothing is lost.

Rows of one format concatenate, scales with them, so the decode step merges q/k/v and gate/up again
(:func:`merge`: the modules' tensors become views of the merged ones, as for plain weights). Every product is
one call of ``vlm_demo::weight_only_linear`` (:func:`weight_only_linear`): ``residual + alpha · x @ Wᵀ`` with
the weights read once, as stored. On CUDA it is our Triton kernel (:mod:`~vlm_demo.engine.weights.packed_kernels`) for
up to ``TRITON_ROWS`` rows — a decode step — and cuBLAS on a widened copy above that (a prefill, where the
arithmetic, not the weight bytes, bounds the time); on a CPU the same arithmetic in torch operations (the
tests also run the Triton kernel there, under its interpreter); on ``meta`` its shapes, for counting.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Rows up to which CUDA runs the Triton kernel (a decode step); a prefill above takes cuBLAS on a widened copy. The
# compiled ceilings put the crossover above 256 for every format and target (docs/quantization.md, "Where cuBLAS
# would win"); 256 is also the engine's largest batch.
TRITON_ROWS = 256
FORMATS = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.uint8: "int4"}  # by the stored values' dtype
CHUNK = 2048  # inputs read back at once when re-packing a torchao int4 layer


def _kernels() -> Any:
    """The kernel's module, imported at the first launch (Triton reads ``TRITON_INTERPRET`` then)."""
    return importlib.import_module("vlm_demo.engine.weights.packed_kernels")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _output(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], values.shape[0]))


def widened(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a ``[out, in]`` matrix of ``dtype`` (what the packed bytes stand for)."""
    if zero is None:
        return values.to(dtype) * scale[:, None].to(dtype)
    rows, groups = scale.shape
    codes = values.reshape(rows, groups, -1)
    codes = torch.cat([codes & 15, codes >> 4], dim=-1).to(dtype)  # [rows, groups, group]
    return (codes * scale[..., None].to(dtype) + zero[..., None].to(dtype)).reshape(rows, -1)


def torch_product(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              residual: torch.Tensor | None, alpha: float) -> torch.Tensor:  # fmt: skip
    """The operator in torch operations: int8 and fp8 widen their values and scale the product's columns, int4
    widens the whole weight."""
    if zero is None:
        product = F.linear(x, values.to(x.dtype)) * scale.to(x.dtype)
    else:
        product = F.linear(x, widened(values, scale, zero, x.dtype))
    if residual is None:
        return product * alpha if alpha != 1.0 else product
    return torch.add(residual, product, alpha=alpha)


@torch.library.custom_op("vlm_demo::weight_only_linear", mutates_args=())
def weight_only_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       residual: torch.Tensor | None, alpha: float) -> torch.Tensor:  # fmt: skip
    """``residual + alpha · x @ Wᵀ`` (without ``residual``: ``alpha · x @ Wᵀ``) for packed ``W``, in ``x``'s
    dtype. Here, the CPU's (and any device's but CUDA's): torch operations."""
    return torch_product(x, values, scale, zero, residual, alpha)


@weight_only_linear.register_kernel("cuda")
def _(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
      residual: torch.Tensor | None, alpha: float) -> torch.Tensor:  # fmt: skip
    rows = _rows(x)
    if rows.shape[0] > TRITON_ROWS:  # a prefill: cuBLAS on the widened weight
        return torch_product(x, values, scale, zero, residual, alpha)
    out = _output(x, values)
    kept = _rows(residual).contiguous() if residual is not None else None
    triton_matmul(rows.contiguous(), values, scale, zero, kept, alpha, _rows(out))
    return out


@weight_only_linear.register_fake
def _(x: torch.Tensor, values: torch.Tensor, *args: Any) -> torch.Tensor:
    return _output(x, values)


def triton_matmul(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  residual: torch.Tensor | None, alpha: float, out: torch.Tensor) -> None:  # fmt: skip
    """The Triton kernel on ``[M, K]`` rows into ``out`` ``[M, N]`` (on a CPU under ``TRITON_INTERPRET=1``)."""
    _kernels().weight_only_matmul(x, values, scale, zero, residual, alpha, out)


@dataclass(frozen=True)
class PackedWeight:
    """What the decode step multiplies by: the packed values and their scales (and int4's zeros), resolved once."""

    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
        return weight_only_linear(x, self.values, self.scale, self.zero, residual, alpha)


class PackedLinear(torch.nn.Module):
    """A bias-free projection stored as :class:`PackedWeight`'s parts: ``weight`` (the values), ``scale`` and
    ``zero`` are parameters, so everything that counts or places a model's parameters sees their real bytes."""

    zero: torch.nn.Parameter | None

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, values.shape[0]
        self.weight = torch.nn.Parameter(values, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.register_parameter("zero", torch.nn.Parameter(zero, requires_grad=False) if zero is not None else None)

    @property
    def format(self) -> str:
        return FORMATS[self.weight.dtype]

    def packed(self) -> PackedWeight:
        zero = self.zero.detach() if self.zero is not None else None
        return PackedWeight(self.weight.detach(), self.scale.detach(), zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed()(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def packed_bytes(fmt: str, out_features: int, in_features: int, dtype: torch.dtype, group: int | None) -> int:
    """A :class:`PackedLinear`'s bytes: values and float32 row scales (int8, fp8), or 4-bit codes and a scale and
    a zero per group in ``dtype`` (int4)."""
    if fmt in ("int8", "fp8"):
        return out_features * in_features + out_features * 4
    assert group is not None
    return out_features * in_features // 2 + 2 * out_features * (in_features // group) * dtype.itemsize


def group_major(table: torch.Tensor) -> torch.Tensor:
    """A ``[out, groups]`` table stored group by group (``stride(0) == 1``): the kernel loads one group's scales (or
    zeros) for a tile of consecutive rows as one contiguous run; indexing and views see the same ``[out, groups]``."""
    return table.t().contiguous().t()


def pack_int4(weight: torch.Tensor, group: int, dtype: torch.dtype) -> PackedLinear:
    """``weight`` ``[out, in]`` in 4 bits per groups of ``group`` inputs: codes 0–15 from the group's minimum
    (the zero) to its maximum, scale and zero stored in ``dtype`` (the codes computed from the stored ones)."""
    rows, width = weight.shape
    w = weight.detach().float().reshape(rows, width // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = group_major(((high - low) / 15).to(dtype))
    zero = group_major(low.to(dtype))
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = ((w - zero.float()[..., None]) / step[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    values = codes[..., : group // 2] | (codes[..., group // 2 :] << 4)
    return PackedLinear(values.reshape(rows, width // 2), scale, zero, width)


def from_torchao(linear: torch.nn.Linear, int4_group: int | None) -> PackedLinear:
    """A torchao-quantized ``linear`` re-packed: int8 and fp8 take torchao's values and row scales as they are;
    int4 (``int4_group``) reads its weights back through the layer (``I @ Wᵀ``, ``CHUNK`` inputs at a time:
    exactly its values) and packs them again on the same grid."""
    weight: Any = linear.weight  # torchao's tensor subclass: qdata, scale (and zero_point)
    width = linear.in_features
    if int4_group is None:
        values, scale = weight.qdata.contiguous(), weight.scale.reshape(-1).float()  # the kernel walks rows
        zero_point = getattr(weight, "zero_point", None)
        if zero_point is not None and zero_point.device.type != "meta" and bool(zero_point.any()):
            raise ValueError("an asymmetric int8 weight: the packed format has no zero points")
        return PackedLinear(values, scale, None, width)
    dtype = weight.dtype
    device = weight.qdata.device
    with torch.no_grad():
        parts = []
        for start in range(0, width, CHUNK):
            inputs = torch.zeros(min(CHUNK, width - start), width, dtype=dtype, device=device)
            inputs[:, start : start + inputs.shape[0]] = torch.eye(inputs.shape[0], dtype=dtype, device=device)
            parts.append(linear(inputs))  # [chunk, out]: a slice of Wᵀ
        return pack_int4(torch.cat(parts).t(), int4_group, dtype)


def merge(modules: Sequence[torch.nn.Module]) -> PackedWeight | None:
    """One packed weight for several projections of the same input (their rows one after another, with their
    scales), the modules' parameters becoming views of it; ``None`` unless all are :class:`PackedLinear` of one
    format, group, dtype and device."""
    packs = [m for m in modules if isinstance(m, PackedLinear)]
    if not modules or len(packs) != len(modules):
        return None
    parts = [m.packed() for m in packs]
    kinds = {(p.values.dtype, p.values.device, p.values.shape[1], p.scale.dtype, p.scale.shape[1:]) for p in parts}
    if len(kinds) != 1 or len({p.zero is None for p in parts}) != 1:
        return None
    values = torch.cat([p.values for p in parts])
    if parts[0].zero is None:
        scale, zero = torch.cat([p.scale for p in parts]), None
    else:  # int4: concatenated group-major, so the modules' rows stay views of it
        scale = torch.cat([p.scale.t() for p in parts], dim=1).t()
        zero = torch.cat([p.zero.t() for p in parts], dim=1).t()  # type: ignore[union-attr]  # int4 has zeros
    start = 0
    for module, part in zip(modules, parts, strict=True):
        end = start + part.values.shape[0]
        module.weight = torch.nn.Parameter(values[start:end], requires_grad=False)
        module.scale = torch.nn.Parameter(scale[start:end], requires_grad=False)
        if zero is not None:
            module.zero = torch.nn.Parameter(zero[start:end], requires_grad=False)
        start = end
    return PackedWeight(values, scale, zero)
