"""Where the weights go on CUDA: decided before loading, checked after.

A GPU that can hold the whole model should hold all of it. accelerate's ``device_map="auto"``
caps a GPU at about 90 % of its memory and silently spills the rest to the CPU; an 11B model in
bf16 (~20 GiB of weights) on a 24 GB card then runs part of every step from host memory, and the
engine's written-out decode step switches itself off. So: a model that fits on one GPU is placed
wholly on it (``device_map={"": index}``); it is spread over several GPUs only when it fits on
none alone, and never onto the CPU; after loading, every weight is checked to be on a GPU. When
it does not fit, the operator gets one sentence with the numbers and what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import vlm_demo.engine.weights.quantize as quantize
from vlm_demo.errors import ModelLoadError

GiB = 1024**3
# CUDA context, cuBLAS workspaces and allocator slack on top of the weights while loading.
LOAD_MARGIN = 2 * GiB


@dataclass(frozen=True)
class Gpu:
    """One visible GPU and its memory as CUDA reports it (bytes)."""

    index: int
    name: str
    free: int
    total: int
    capability: tuple[int, int] | None = None  # (major, minor): which quantized formats it runs


def visible_gpus() -> list[Gpu]:
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        name, capability = torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)
        gpus.append(Gpu(index, name, free, total, tuple(capability)))  # type: ignore[arg-type]
    return gpus


def meta_model(config: Any) -> torch.nn.Module:
    """An Mllama architecture on the meta device: every shape, no memory, a fraction of a second."""
    from transformers import MllamaForConditionalGeneration

    with torch.device("meta"):
        return MllamaForConditionalGeneration(config)


def weight_bytes(config: Any, dtype: torch.dtype, kind: str = "none", cuda: bool = True) -> int:
    """The model's weight size in ``dtype``, its linear layers as ``kind`` stores them, from its architecture."""
    return quantize.weight_bytes(meta_model(config), dtype, kind, cuda)


def too_big(weights: int, where: str, free: int, dtype: torch.dtype) -> ModelLoadError:
    need = (weights + LOAD_MARGIN) / GiB
    return ModelLoadError(
        f"The model's weights ({dtype_name(dtype)}, as --quantize stores them) need {weights / GiB:.1f} GiB (and "
        f"{LOAD_MARGIN / GiB:.0f} GiB more while loading) but {where} has only {free / GiB:.1f} GiB free, and a model spilled to the CPU decodes many times slower: "
        f"use a GPU with well over {need:.0f} GB, or fewer bits per weight (--quantize int8 or int4; "
        f"python -m vlm_demo.tools.fit says what fits)."
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_kwargs(device: str, weights: int, gpus: list[Gpu], dtype: torch.dtype) -> dict[str, Any]:
    """``from_pretrained`` placement arguments for ``device`` (``cuda`` or ``cuda:N``).

    ``cuda:N`` puts everything on GPU N; ``cuda`` on the first GPU that holds the model alone, else
    spreads it over all GPUs with no CPU share. Raises :class:`ModelLoadError` when it cannot fit.
    """
    if not gpus:
        raise ModelLoadError(f"--device {device} needs a CUDA GPU, and none is visible.")
    if device != "cuda":
        index = int(device.split(":", 1)[1])
        gpu = next((g for g in gpus if g.index == index), None)
        if gpu is None:
            raise ModelLoadError(f"--device {device}: there is no GPU {index} (GPUs visible: {len(gpus)}).")
        if weights + LOAD_MARGIN > gpu.free:
            raise too_big(weights, f"GPU {index} ({gpu.name})", gpu.free, dtype)
        return {"device_map": {"": index}}
    for gpu in gpus:
        if weights + LOAD_MARGIN <= gpu.free:
            return {"device_map": {"": gpu.index}}
    spare = {g.index: g.free - LOAD_MARGIN for g in gpus if g.free > LOAD_MARGIN}
    if len(gpus) > 1 and sum(spare.values()) >= weights:
        return {"device_map": "auto", "max_memory": spare}  # no "cpu" entry: nothing may spill to the host
    total_free = sum(g.free for g in gpus)
    where = f"GPU {gpus[0].index} ({gpus[0].name})" if len(gpus) == 1 else f"the {len(gpus)} GPUs together"
    raise too_big(weights, where, total_free, dtype)


def check_on_gpus(model: torch.nn.Module) -> None:
    """Every weight on a GPU, or a loud error naming how much is elsewhere (never a silent slow path)."""
    elsewhere: dict[str, int] = {}
    first = ""
    for name, param in model.named_parameters():
        if param.device.type != "cuda":
            kind = "the CPU or disk (offloaded)" if param.device.type == "meta" else param.device.type
            elsewhere[kind] = elsewhere.get(kind, 0) + quantize.stored_bytes(param)
            first = first or name
    if elsewhere:
        spread = ", ".join(f"{size / GiB:.2f} GiB on {kind}" for kind, size in elsewhere.items())
        raise ModelLoadError(
            f"Some weights did not land on the GPU ({spread}; first: {first}), so every step would run partly "
            f"from host memory: free GPU memory (other processes?), use a bigger GPU, or quantised weights."
        )
