"""The GPUs people serve on, from their spec sheets: memory, bandwidth, compute capability.

``python -m vlm_demo.tools.fit --gpu NAME`` sizes the model for one of them, the README's "Which GPU?" table
lists the common ones, and the GPU check reads a card's bandwidth by its device name. Memory is the total
``nvidia-smi`` reports (MiB; a little under the marketed figure on most cards), bandwidth the vendor's
peak, SMs and boost clock the vendor's (the H100 and H200 at the ~1.83 GHz they hold under load), the compute
capability CUDA's (8.9 and newer have FP8 arithmetic, 8.0 and newer run torchao's
int4 kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024**2


@dataclass(frozen=True)
class GpuSpec:
    key: str  # what --gpu takes
    label: str  # what a table shows
    match: str  # found in torch.cuda.get_device_name (the first spec whose match is found wins)
    memory: int  # bytes
    bandwidth: float  # bytes/s
    capability: tuple[int, int]
    sms: int  # streaming multiprocessors
    ghz: float  # boost clock: with ``sms``, scales a compiled kernel's ceiling (tools.kernel_sass) to this card


GPUS: tuple[GpuSpec, ...] = (
    # A name contained in another comes after it: "A100" before "A10", "L40S" before "L4", "GH200" before "H200".
    GpuSpec("a100-80gb", "A100 80GB", "A100-SXM4-80GB", 81920 * MiB, 2.039e12, (8, 0), 108, 1.41),
    GpuSpec("a100-80gb-pcie", "A100 80GB PCIe", "A100 80GB PCIe", 81920 * MiB, 1.935e12, (8, 0), 108, 1.41),
    GpuSpec("a100-40gb", "A100 40GB", "A100", 40960 * MiB, 1.555e12, (8, 0), 108, 1.41),
    GpuSpec("a10g", "A10G", "A10G", 23028 * MiB, 0.6e12, (8, 6), 80, 1.71),
    GpuSpec("a10", "A10", "A10", 23028 * MiB, 0.6e12, (8, 6), 72, 1.695),
    GpuSpec("l40s", "L40S", "L40S", 46068 * MiB, 0.864e12, (8, 9), 142, 2.52),
    GpuSpec("l40", "L40", "L40", 46068 * MiB, 0.864e12, (8, 9), 142, 2.49),
    GpuSpec("l4", "L4", "L4", 23034 * MiB, 0.3e12, (8, 9), 58, 2.04),
    GpuSpec("rtx-4090", "RTX 4090", "RTX 4090", 24564 * MiB, 1.008e12, (8, 9), 128, 2.52),
    GpuSpec("rtx-6000-ada", "RTX 6000 Ada", "RTX 6000 Ada", 49140 * MiB, 0.96e12, (8, 9), 142, 2.505),
    GpuSpec("rtx-a6000", "RTX A6000", "RTX A6000", 49140 * MiB, 0.768e12, (8, 6), 84, 1.8),
    GpuSpec("gh200", "GH200", "GH200", 97871 * MiB, 4.0e12, (9, 0), 132, 1.83),
    GpuSpec("h200", "H200", "H200", 143771 * MiB, 4.8e12, (9, 0), 132, 1.83),
    GpuSpec("h100-nvl", "H100 NVL", "H100 NVL", 95830 * MiB, 3.9e12, (9, 0), 132, 1.785),
    GpuSpec("h100-pcie", "H100 PCIe", "H100 PCIe", 81559 * MiB, 2.0e12, (9, 0), 114, 1.755),
    GpuSpec("h100", "H100", "H100", 81559 * MiB, 3.35e12, (9, 0), 132, 1.83),
    GpuSpec("b200", "B200", "B200", 183359 * MiB, 8.0e12, (10, 0), 148, 1.965),
    GpuSpec("t4", "T4", "T4", 15360 * MiB, 0.32e12, (7, 5), 40, 1.59),
)
TABLE_ORDER = ("t4", "a10g", "l4", "l40s", "a100-40gb", "a100-80gb", "h100", "h200")


def by_key(key: str) -> GpuSpec:
    """The spec ``--gpu`` names (case and spaces ignored); ``KeyError`` lists the known ones."""
    wanted = key.strip().lower().replace(" ", "-")
    for spec in GPUS:
        if wanted in (spec.key, spec.label.lower().replace(" ", "-")):
            return spec
    raise KeyError(f"unknown GPU {key!r}; known: {', '.join(spec.key for spec in GPUS)}")


def by_device_name(name: str) -> GpuSpec | None:
    """The spec of a device CUDA names (``NVIDIA H100 80GB HBM3``), if known."""
    return next((spec for spec in GPUS if spec.match in name), None)


def table_gpus() -> list[GpuSpec]:
    """The README table's GPUs, smallest first."""
    return [by_key(key) for key in TABLE_ORDER]
