"""Decode-step attention over the page pool: each row reads its own tokens and its own tiles, nothing else.

A padded batch makes every row read as many keys as the longest one, and every picture four tiles of image
states. Here a step's rows are ragged: row ``r`` attends to its text tokens spread over its pages (its new token
included) and to the image-state tokens of the tiles it sees. Three kernels, one contract
(:class:`~vlm_demo.engine.executor.attention.base.PagedAttention`: each builds its own inputs from the rows' pages):

- ``flash`` (:mod:`.flash`): FlashAttention's paged kernel from torch itself — CUDA, 16-bit, torch ≥ 2.12;
- ``triton`` (:mod:`.tiled`): our paged kernel in Triton — CUDA with any torch (on a CPU only under Triton's
  interpreter, for tests);
- ``reference`` (:mod:`.reference`): torch operations any device runs — the CPU's kernel.

``--decode-attention auto`` takes, on CUDA, ``flash`` where this torch has the paged call and a probe of a few
hundred random steps finds no NaN and agrees with the reference, else ``triton`` where its probe passes, else
the reference; on a CPU the reference. One log line names the kernel and why each faster one was not taken.
"""

from __future__ import annotations

import logging

import torch

from vlm_demo.engine.executor.attention.base import VERSIONS, Layout, PagedAttention, StepOrder, StepRows, moved
from vlm_demo.engine.executor.attention.flash import FlashAttention, flash_missing
from vlm_demo.engine.executor.attention.probe import ProbeResult, probe, tolerance
from vlm_demo.engine.executor.attention.reference import ReferenceAttention, fewest_bands
from vlm_demo.engine.executor.attention.tiled import TritonAttention, interpreted, triton_missing
from vlm_demo.engine.kv.pages import PageShape
from vlm_demo.errors import ModelLoadError

__all__ = ["CHOICES", "KERNELS", "VERSIONS", "Layout", "PagedAttention", "ProbeResult", "StepOrder", "StepRows",
           "check", "choose", "decide", "fewest_bands", "moved"]  # fmt: skip

log = logging.getLogger(__name__)

KERNELS: dict[str, type[PagedAttention]] = {
    "flash": FlashAttention,
    "triton": TritonAttention,
    "reference": ReferenceAttention,
}
CHOICES = ("auto", *KERNELS)
FASTEST_FIRST = ("flash", "triton")
PROBE_STEPS = {"flash": 256, "triton": 32}  # the interpreter runs 2 (each step takes it ~a second)
_PROBED: dict[tuple[object, ...], ProbeResult] = {}  # (kernel, page shape, heads, device, steps) -> its probe


def check(name: str, shape: PageShape, heads: int, device: torch.device,
          asked: bool = False) -> tuple[str | None, ProbeResult | None]:  # fmt: skip
    """Why kernel ``name`` cannot run here (``None``: it can, and passed its probe), and the probe's figures.
    ``asked``: named by ``--decode-attention`` (a CPU then runs Triton under its interpreter when
    ``TRITON_INTERPRET=1``)."""
    if name == "reference":
        return None, None
    if name == "flash":
        missing = flash_missing(device, shape.dtype, shape.kv_dtype)
    else:
        missing = triton_missing(device)
        if missing is None and device.type != "cuda" and not asked:
            missing = "on a CPU only its interpreter runs it (--decode-attention triton with TRITON_INTERPRET=1)"
    if missing is not None:
        return missing, None
    steps = 2 if name == "triton" and interpreted() else PROBE_STEPS[name]
    key = (name, shape, heads, str(device), steps)
    if key not in _PROBED:  # a process probes a kernel once: every engine it builds (gpucheck's many) reuses it
        _PROBED[key] = probe(KERNELS[name], shape, heads, device, steps)
    result = _PROBED[key]
    return result.why(tolerance(shape.dtype)) or None, result


def decide(shape: PageShape, heads: int, device: torch.device | str,
           choice: str = "auto") -> tuple[type[PagedAttention], list[str]]:  # fmt: skip
    """The decode attention for ``--decode-attention choice``, and why each faster kernel was passed over; a kernel
    named there that cannot run stops the start (``ModelLoadError``, saying why). Logs the choice in one line."""
    device = torch.device(device)
    if choice not in CHOICES:
        raise ModelLoadError(f"--decode-attention {choice!r}: choose one of {', '.join(CHOICES)}")
    if choice != "auto":
        missing, _ = check(choice, shape, heads, device, asked=True)
        if missing is not None:
            raise ModelLoadError(f"--decode-attention {choice}: {missing}; use --decode-attention auto")
        log.info("decode attention: %s (as --decode-attention asks)", choice)
        return KERNELS[choice], []
    passed_over: list[str] = []
    chosen = "reference"
    for name in FASTEST_FIRST:
        missing, _ = check(name, shape, heads, device)
        if missing is None:
            chosen = name
            break
        passed_over.append(f"{name}: {missing}")
    reasons = f" ({'; '.join(passed_over)})" if passed_over else ""
    slow = chosen == "reference" and device.type == "cuda"
    (log.warning if slow else log.info)("decode attention: %s%s", chosen, reasons)
    return KERNELS[chosen], passed_over


def choose(shape: PageShape, heads: int, device: torch.device | str, choice: str = "auto") -> type[PagedAttention]:
    """``decide``'s kernel."""
    return decide(shape, heads, device, choice)[0]
