"""Weights in 8 or 4 bits, quantized as they load (torchao), so the 11B model runs on 24 GB GPUs.

No 8-bit checkpoint of Llama-3.2V-11B-cot exists, so the bf16 weights are quantized while they load:
transformers hands each weight to torchao on its way to the device (:func:`load_config`), so neither the
host nor the GPU ever holds the whole bf16 model; a model already in memory is quantized in place
(:func:`quantize_model`: the GPU check's random-weight model, the tests). Both follow one table of which
layer gets which format (:func:`layer_configs`):

- every ``nn.Linear`` of the language model (self- and cross-attention projections, MLPs) gets the chosen
  format: it is 8.7 of the 10.7 B parameters and everything a decode step reads but the LM head;
- the vision tower's ``nn.Linear`` layers get int8 weight-only in every mode: the tower runs once per
  picture, at prefill, where arithmetic rather than weight reads bounds the time, so 8-bit weights with
  untouched activations save its memory (1.7 → 0.9 GB) without putting its activations through FP8 or
  its weights through 4 bits;
- the embeddings, the LM head, the norms, the cross-attention tanh gates and the multimodal projector
  stay in the model dtype (the head and the embeddings decide every token; the rest is small).

Loading quantizes with torchao 0.18: ``fp8`` is FP8 e4m3 weights with one scale per output row (on a GPU
with compute capability 8.9 or newer, Ada and Hopper, torchao's dynamic-activation config; on CPU its
weight-only one: the weights are rounded alike); ``int8`` int8 with per-row scales; ``int4`` 4 bits in
groups of 128 input features with tinygemm's asymmetric scales (on CUDA its tile-packed layout, compute
capability 8.0 or newer, bf16; on CPU torchao's prototype ``Int4OpaqueTensor``, narrower layers in groups of 64
or 32). Then the language model's layers are re-packed once into our own layout (:func:`pack`,
:mod:`~vlm_demo.engine.weights.packed`): its decode step reads each weight once, in its stored width, through one
kernel per product with q/k/v and gate/up merged; torchao's kernels run only the vision tower (prefill). What
a GPU cannot do is refused before anything loads (:func:`problem`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from vlm_demo.engine.weights.packed import PackedLinear, from_torchao, pack_int4, packed_bytes

KINDS = ("none", "fp8", "int8", "int4")  # most precise first: ``auto`` takes the first that fits
CHOICES = (*KINDS, "auto")
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores (torch._scaled_mm)
INT4_CAPABILITY = (8, 0)  # tinygemm's int4 kernel (Ampere and newer)
INT4_GROUPS = (128, 64, 32)  # input features per int4 scale; CUDA's tinygemm packs 128 at a time
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TEXT, VISION = "model.language_model.", "model.vision_model."


def problem(kind: str, cuda: bool, capability: tuple[int, int] | None, gpu: str, dtype: torch.dtype) -> str | None:
    """Why ``kind`` cannot run on this device (one sentence, what to use instead), or ``None``."""
    if kind in ("fp8", "int8", "int4") and importlib.util.find_spec("torchao") is None:
        return f"--quantize {kind} needs torchao, which is not installed: pip install -r requirements.txt."
    if not cuda or kind not in ("fp8", "int4"):
        return None
    have = f"{gpu} has compute capability {capability[0]}.{capability[1]}" if capability else f"{gpu}"
    if kind == "fp8" and (capability is None or capability < FP8_CAPABILITY):
        return (
            f"--quantize fp8 needs a GPU with FP8 arithmetic (compute capability 8.9 or newer: L4, L40S, RTX 4090, "
            f"H100, H200) and {have}: use --quantize int8 (8 bits per weight too) or int4."
        )
    if kind == "int4" and (capability is None or capability < INT4_CAPABILITY):
        return f"--quantize int4 needs compute capability 8.0 or newer (torchao's int4 kernel) and {have}: use --quantize int8."
    if kind == "int4" and dtype != torch.bfloat16:
        return f"--quantize int4 runs bf16 activations on a GPU (torchao's int4 kernel), not {DTYPE_NAMES[dtype]}: use --dtype bfloat16 (or auto)."
    return None


def usable(cuda: bool, capability: tuple[int, int] | None, dtype: torch.dtype) -> tuple[str, ...]:
    """The kinds this device runs, most precise first (the order ``auto`` tries them in); only ``none`` without
    torchao."""
    if importlib.util.find_spec("torchao") is None:
        return ("none",)
    return tuple(kind for kind in KINDS if problem(kind, cuda, capability, "", dtype) is None)


# ---- which layer gets what --------------------------------------------------------------------------------


def int4_group(in_features: int, cuda: bool) -> int | None:
    """Input features per int4 scale for a layer this wide; ``None``: the layer stays unquantized."""
    groups = INT4_GROUPS[:1] if cuda else INT4_GROUPS
    return next((g for g in groups if in_features % g == 0), None)


def layer_format(kind: str, name: str, in_features: int, cuda: bool) -> tuple[str, int | None] | None:
    """``(format, int4 group)`` for the ``nn.Linear`` called ``name``, or ``None``: it stays in the model dtype."""
    if kind == "none":
        return None
    if name.startswith(VISION):
        return "int8", None
    if not name.startswith(TEXT):  # the LM head, the multimodal projector
        return None
    if kind == "int4":
        group = int4_group(in_features, cuda)
        return ("int4", group) if group else None
    return kind, None


def layer_configs(model: torch.nn.Module, kind: str, cuda: bool) -> dict[str, Any]:
    """Every quantized ``nn.Linear`` weight's name (``….weight``) -> its torchao config (a meta-device model will
    do). Keyed by the weight, not the module: transformers' loader, given a module's name, quantizes its bias too
    (the vision tower's MLPs have biases), which then breaks the layer's forward."""
    make = _config_makers(cuda)
    configs = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            chosen = layer_format(kind, name, module.in_features, cuda)
            if chosen is not None:
                configs[f"{name}.weight"] = make[chosen[0]](chosen[1])
    return configs


def _config_makers(cuda: bool) -> dict[str, Callable[[int | None], Any]]:
    import torchao.quantization as q
    from torchao.quantization import PerRow

    # set_inductor_config=False: no global torch.compile settings changed behind the engine's back.
    if cuda:
        fp8 = lambda _: q.Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)  # noqa: E731
        int4 = lambda g: q.Int4WeightOnlyConfig(  # noqa: E731
            group_size=g, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        )
    else:
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        fp8 = lambda _: q.Float8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)  # noqa: E731
        int4 = lambda g: PrototypeInt4WeightOnlyConfig(group_size=g, set_inductor_config=False)  # noqa: E731
    return {"fp8": fp8, "int8": lambda _: q.Int8WeightOnlyConfig(set_inductor_config=False), "int4": int4}


def load_config(meta_model: torch.nn.Module, kind: str, cuda: bool) -> Any:
    """``from_pretrained``'s ``quantization_config``: each listed weight is quantized as it loads."""
    from torchao.quantization import FqnToConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(quant_type=FqnToConfig(layer_configs(meta_model, kind, cuda)))


def quantize_model(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """Quantize a model already in memory, in place, where it is (a random-weight model, a test, a shapes-only
    model on ``meta``), and pack its language model. Its int4 layers are packed straight from their weights
    (torchao's int4 cannot quantize ``meta`` tensors; the grid is the same)."""
    if kind == "none":
        return model
    cuda = next(model.parameters()).device.type == "cuda"
    from torchao.quantization import quantize_

    for name, config in layer_configs(model, kind, cuda).items():  # layer by layer, as the loader does
        if kind == "int4" and name.startswith(TEXT):
            continue
        quantize_(model.get_submodule(name.removesuffix(".weight")), config, filter_fn=lambda module, fqn: True)
    return pack(model, kind, cuda)


def pack(model: torch.nn.Module, kind: str, cuda: bool) -> torch.nn.Module:
    """Replace each quantized ``nn.Linear`` of the language model by its :class:`PackedLinear` (in place; int8
    and fp8 keep torchao's bytes, int4 is read back and packed again, one layer at a time)."""
    for name, module in list(model.named_modules()):
        chosen = layer_format(kind, name, module.in_features, cuda) if isinstance(module, torch.nn.Linear) else None
        if chosen is None or not name.startswith(TEXT):
            continue
        fmt, group = chosen
        if type(module.weight.data) is torch.Tensor:  # not quantized yet: int4 from quantize_model
            assert fmt == "int4" and group is not None, name
            packed = pack_int4(module.weight, group, module.weight.dtype)
        else:
            packed = from_torchao(module, group if fmt == "int4" else None)
        parent, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), child, packed)
    return model


# ---- bytes --------------------------------------------------------------------------------------------------


def linear_bytes(fmt: str, out_features: int, in_features: int, dtype: torch.dtype, group: int | None) -> int:
    """A quantized weight's bytes as torchao stores them: its values plus its scales (and zero points)."""
    values = out_features * in_features
    if fmt == "int8":
        return values + out_features * (4 + 1)  # float32 scale and int8 zero point per row
    if fmt == "fp8":
        return values + out_features * 4  # float32 scale per row
    assert group is not None
    return values // 2 + (in_features // group) * out_features * 2 * dtype.itemsize  # scale and zero per group


def weight_bytes(
    model: torch.nn.Module, dtype: torch.dtype, kind: str, cuda: bool, include: Callable[[str], bool] | None = None
) -> int:
    """The model's weights in bytes once loaded as ``kind`` (shapes only: a meta-device model will do, unquantized);
    ``include`` keeps only the parameters it accepts by name."""
    quantized = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            chosen = layer_format(kind, name, module.in_features, cuda)
            if chosen is not None:
                count = packed_bytes if name.startswith(TEXT) else linear_bytes  # ours, or torchao's (vision)
                out_features, in_features = module.weight.shape
                quantized[f"{name}.weight"] = count(chosen[0], out_features, in_features, dtype, chosen[1])
    total = 0
    for name, param in model.named_parameters():
        if include is None or include(name):
            total += quantized.get(name, param.numel() * dtype.itemsize)
    return total


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor really holds: for a torchao weight, its inner tensors (values, scales, zero points)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    names, _ = flatten(tensor)
    return sum(stored_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)


def weights_label(model: torch.nn.Module) -> str:
    """What the language model's linear weights are stored as: ``fp8``, ``int8``, ``int4``, or the dtype
    (``bf16``, ``fp32``, …) when they are not quantized; read from the weights themselves, not the setting."""
    dtype = torch.float32
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear) and name.startswith(TEXT):
            return module.format
        if isinstance(module, torch.nn.Linear) and name.startswith(TEXT):
            kind = type(module.weight).__name__
            for prefix, label in (("Float8", "fp8"), ("Int8", "int8"), ("Int4", "int4")):
                if kind.startswith(prefix):
                    return label
            dtype = module.weight.dtype
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
