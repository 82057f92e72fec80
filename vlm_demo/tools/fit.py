"""Will it fit? ``python -m vlm_demo.tools.fit --gpu-memory 24GiB [--quantize int8] [--max-new-tokens N] [--json]``.

For each ``--quantize`` choice, the 11B model's weights in bytes (counted per layer from the real
architecture, as the loader stores them), whether they load, how many answers of ``--max-new-tokens``
tokens then fit at once (the engine's own memory plan: :mod:`vlm_demo.engine.kv.memory`), what ``auto`` would
pick, and the batch-1 decode bound: the bytes a decode step reads, once, at the card's memory bandwidth — the
packed layers' bytes (``--quantize`` int8/fp8/int4) at the smaller of that and what our weight-only kernel's
compiled loop can consume on this card (:func:`vlm_demo.tools.benchmarks.kernel_sass.card_bandwidth`: its ceiling at the
newest compiled target the card runs, scaled by SMs × clock). A bound, not a promise; see docs/quantization.md. ``--gpu NAME`` takes memory, bandwidth and compute
capability from :mod:`vlm_demo.tools.gpu.cards`; ``--readme-table`` prints the README's "Which GPU?" table.

Nothing is allocated: the model is built on the meta device. The GPU is taken to have its memory less
``CUDA_OVERHEAD`` free when the server starts (the driver's reservation, the CUDA context and cuBLAS's
workspace; what ``torch.cuda.mem_get_info`` shows on an idle card).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

import vlm_demo.engine.weights.quantize as quantize
from vlm_demo.config import Config
from vlm_demo.engine.kv.memory import (
    AUTO_TOKENS,
    PROMPT_TOKENS,
    KVShape,
    most_precise_that_fits,
    plan,
    read_by_decode,
    rows_that_fit,
)
from vlm_demo.engine.kv.pages import FP8, KV_CACHE_DTYPES, kv_dtype_for
from vlm_demo.engine.weights.placement import LOAD_MARGIN, meta_model
from vlm_demo.errors import ModelLoadError
from vlm_demo.models import realshape
from vlm_demo.tools.gpu.cards import GPUS, GpuSpec, by_key, table_gpus

GiB = 1024**3
CUDA_OVERHEAD = 1 * GiB
DTYPE = torch.bfloat16  # the model dtype on a GPU
CONTEXT_TOKENS = 256  # the text cache a batch-1 decode step reads, for the bound (as the GPU check counts it)
UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1024, "mib": 1024**2, "gib": GiB}
MODEL = "Llama-3.2V-11B-cot (Llama-3.2-11B-Vision's architecture)"


@dataclass(frozen=True)
class Fit:
    """One ``--quantize`` choice on one GPU."""

    quantize: str
    weight_bytes: int
    runs: bool  # the GPU runs this format (compute capability)
    fits: bool  # loads, and at least one answer of max_new_tokens fits next to it
    rows: int  # answers of max_new_tokens tokens that fit at once (uncapped; 0 when it does not fit)
    max_batch_size: int  # what the server would batch (the memory plan: at most 256); 0 when it does not fit
    kv_budget_bytes: int
    decode_read_bytes: int  # what one batch-1 decode step reads
    packed_read_bytes: int  # of which the packed layers' (read by our weight-only kernel)
    kernel_bytes_per_s: float | None  # what that kernel can read here (None: the memory's bandwidth, or unknown)
    batch1_bound_tokens_per_s: float | None  # 1 / (other bytes / bandwidth + packed bytes / the kernel's rate)
    why: str  # why it does not fit or run ("" when it does)


def parse_size(text: str) -> int:
    """``24GiB``, ``24 GB``, ``23028MiB`` or a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 24GiB, 24GB, 23028MiB)")
    return int(float(match.group(1)) * UNITS[unit])


def parse_bandwidth(text: str) -> float:
    """``600GB/s``, ``3.35TB/s`` or a plain number of GB/s."""
    number = text.strip().lower().removesuffix("/s")
    return float(number) * 1e9 if re.fullmatch(r"[0-9]*\.?[0-9]+", number) else float(parse_size(number))


def evaluate(
    kind: str,
    weights: int,
    read: tuple[int, int],
    kv: KVShape,
    memory: int,
    capability: tuple[int, int] | None,
    bandwidth: float | None,
    max_new_tokens: int,
    cores: tuple[int, float] | None = None,
) -> Fit:
    """Whether ``kind``'s weights load on a GPU of ``memory`` bytes and how many rows the plan then gives;
    ``read``: the bytes a batch-1 step reads and the packed layers' share of them; ``cores``: the card's SMs and
    clock (the kernel's ceiling; None: the memory's bandwidth alone)."""
    free = memory - CUDA_OVERHEAD
    problem = quantize.problem(kind, True, capability, "this GPU", DTYPE) if capability else None
    total, packed = read
    rate = kernel_rate(kind, capability, bandwidth, cores) if not problem and packed else None
    bound = 1 / ((total - packed) / bandwidth + packed / (rate or bandwidth)) if bandwidth else None
    figures = (total, packed, rate)
    if problem:
        return Fit(kind, weights, False, False, 0, 0, 0, *figures, bound, clause(problem))
    if weights + LOAD_MARGIN > free:
        why = (
            f"the weights need {weights / GiB:.1f} GiB, and {LOAD_MARGIN / GiB:.0f} GiB more while they load, but the "
            f"card has {free / GiB:.1f} GiB free when the server starts"
        )
        return Fit(kind, weights, True, False, 0, 0, 0, *figures, bound, why)
    try:
        memory_plan = plan(kv, Config(max_new_tokens=max_new_tokens), cuda=True, free=free - weights, total=memory)
    except ModelLoadError as err:
        return Fit(kind, weights, True, False, 0, 0, 0, *figures, bound, clause(str(err)))
    rows = rows_that_fit(kv, free - weights, memory, max_new_tokens)
    return Fit(
        kind, weights, True, True, rows, memory_plan.max_batch_size, memory_plan.kv_budget_bytes, *figures, bound, ""
    )


def kernel_rate(
    kind: str, capability: tuple[int, int] | None, bandwidth: float | None, cores: tuple[int, float] | None
) -> float | None:
    """Bytes/s our weight-only kernel reads ``kind``'s packed layers at on this card at batch 1, where its compiled
    ceiling is below the memory's bandwidth (None: the memory's bandwidth sets it, or the card is unknown)."""
    if not (capability and bandwidth and cores) or kind not in ("int8", "fp8", "int4") or capability < (8, 0):
        return None  # below 8.0 no target is compiled: the memory's bandwidth stands
    from vlm_demo.tools.benchmarks.kernel_sass import card_bandwidth

    capped = card_bandwidth(kind, capability[0] * 10 + capability[1], *cores, bandwidth / 1e12, 1) * 1e12
    return capped if capped < bandwidth else None


def clause(message: str) -> str:
    """A server's one-sentence start-up error, as a clause of this tool's line: without the advice to run this tool
    and without the full stop (the line goes on)."""
    return message.replace("; python -m vlm_demo.tools.fit says what fits", "").rstrip(".")


def fit_report(
    memory: int,
    kinds: tuple[str, ...] = quantize.KINDS,
    max_new_tokens: int = 2048,
    capability: tuple[int, int] | None = None,
    bandwidth: float | None = None,
    gpu: str = "",
    cores: tuple[int, float] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Everything ``fit`` says about one GPU, as the JSON it prints (``cores``: its SMs and clock, if known;
    ``kv_dtype``: how the page pool stores keys/values, ``--kv-cache-dtype``: ``None`` in the model's dtype)."""
    config = realshape.full_config()
    model = meta_model(config)
    kv = KVShape.of(config, DTYPE, kv_dtype)
    context = CONTEXT_TOKENS * kv.bytes_per_token + kv.bytes_per_row
    results = {}
    for kind in kinds:
        weights = quantize.weight_bytes(model, DTYPE, kind, cuda=True)
        read = quantize.weight_bytes(model, DTYPE, kind, cuda=True, include=read_by_decode) + context
        names = packed_weights(model, kind)
        packed = quantize.weight_bytes(
            model,
            DTYPE,
            kind,
            cuda=True,
            include=lambda n, names=names: n in names and read_by_decode(n),  # type: ignore[misc]
        )
        results[kind] = evaluate(kind, weights, (read, packed), kv, memory, capability, bandwidth, max_new_tokens,
                                 cores)  # fmt: skip
    usable = {k: results[k].weight_bytes for k in kinds if results[k].runs}
    auto, auto_rows = most_precise_that_fits(usable, kv, memory - CUDA_OVERHEAD, memory) if usable else ("", 0)
    return {
        "model": MODEL,
        "parameters": sum(p.numel() for p in model.parameters()),
        "gpu": gpu,
        "gpu_memory_bytes": memory,
        "free_at_start_bytes": memory - CUDA_OVERHEAD,
        "compute_capability": ".".join(map(str, capability)) if capability else None,
        "bandwidth_bytes_per_s": bandwidth,
        "max_new_tokens": max_new_tokens,
        "kv_cache_dtype": "fp8" if kv_dtype is not None and kv_dtype != DTYPE else "auto",
        "row_tokens": max_new_tokens + PROMPT_TOKENS,
        "results": {kind: asdict(result) for kind, result in results.items()},
        "auto": auto if auto_rows else None,  # what --quantize auto loads; None: nothing this GPU runs fits
        "auto_rows_of_1024": auto_rows,
    }


def packed_weights(model: torch.nn.Module, kind: str) -> set[str]:
    """The weights ``kind`` stores packed, read by our weight-only kernel (the language model's projections)."""
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and name.startswith(quantize.TEXT)
        and quantize.layer_format(kind, name, module.in_features, True) is not None
    }


def words(report: dict[str, Any]) -> str:
    """The report as a person reads it."""
    gpu = f"{report['gpu']}: " if report["gpu"] else ""
    cc = f", compute capability {report['compute_capability']}" if report["compute_capability"] else ""
    bw = f", {report['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s" if report["bandwidth_bytes_per_s"] else ""
    lines = [
        f"{gpu}{report['gpu_memory_bytes'] / GiB:.1f} GiB{cc}{bw}; {report['model']}, "
        f"{report['parameters'] / 1e9:.2f} B parameters; answers of up to {report['max_new_tokens']} tokens; "
        f"{'an fp8' if report['kv_cache_dtype'] == 'fp8' else 'a bf16'} key/value cache"
    ]
    for kind, r in report["results"].items():
        head = f"  {kind:>4}: weights {r['weight_bytes'] / GiB:5.1f} GiB ({r['weight_bytes'] / 1e9:.1f} GB)"
        if r["fits"]:
            cap = f" (the server batches {r['max_batch_size']})" if r["max_batch_size"] < r["rows"] else ""
            head += f", fits: {r['rows']} rows{cap}"
        else:
            head += f", does not fit: {r['why']}"
        if r["batch1_bound_tokens_per_s"]:
            head += f"; batch-1 decode at most {r['batch1_bound_tokens_per_s']:.0f} tokens/s"
            if r["kernel_bytes_per_s"]:
                head += f" (its kernel reads the packed weights at {r['kernel_bytes_per_s'] / 1e12:.2f} TB/s here)"
        lines.append(head)
    if not report["compute_capability"]:
        lines.append("  (compute capability unknown: fp8 counted as available; --compute-capability 8.6 or --gpu NAME)")
    if not report["bandwidth_bytes_per_s"]:
        lines.append("  (--bandwidth 600GB/s or --gpu NAME adds the batch-1 decode bound)")
    if report["auto"]:
        lines.append(
            f"  --quantize auto loads {report['auto']} ({report['auto_rows_of_1024']} rows of {AUTO_TOKENS} tokens)"
        )
    else:
        lines.append("  --quantize auto: nothing this GPU runs fits")
    return "\n".join(lines)


def spec_report(spec: GpuSpec, max_new_tokens: int = 2048, kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
    return fit_report(spec.memory, quantize.KINDS, max_new_tokens, spec.capability, spec.bandwidth, spec.label,
                      (spec.sms, spec.ghz), kv_dtype)  # fmt: skip


def readme_table(max_new_tokens: int = 2048) -> str:
    """The README's "Which GPU?" table: every common GPU, every format: rows of ``max_new_tokens`` (and with
    ``--kv-cache-dtype fp8``) and the batch-1 bound, or why not."""
    reports = [(spec, spec_report(spec, max_new_tokens)) for spec in table_gpus()]
    fp8 = {spec.key: spec_report(spec, max_new_tokens, FP8)["results"] for spec in table_gpus()}
    first = reports[0][1]["results"]
    names = {"none": "bf16"}
    header = ["GPU (memory, bandwidth)"]
    header += [f"{names.get(k, k)} ({r['weight_bytes'] / 1e9:.1f} GB)" for k, r in first.items()]
    lines = ["| " + " | ".join([*header, "`auto` loads"]) + " |", "|" + "---|" * (len(header) + 1)]
    for spec, report in reports:
        cells = [f"{spec.label} ({spec.memory / GiB:.1f} GiB, {spec.bandwidth / 1e9:.0f} GB/s)"]
        for kind, r in report["results"].items():
            if not r["runs"]:
                cells.append("needs CC 8.9" if kind == "fp8" else "needs CC 8.0")
            elif not r["fits"]:
                cells.append("does not fit")
            else:
                more = fp8[spec.key][kind]["rows"]
                cells.append(f"{r['rows']} rows ({more} at fp8) · ≤ {r['batch1_bound_tokens_per_s']:.0f} tok/s")
        cells.append(names.get(report["auto"], report["auto"]) if report["auto"] else "nothing fits")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlm_demo.tools.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory", type=parse_size, help="the card's memory (24GiB, 24GB, 23028MiB)")
    parser.add_argument(
        "--gpu", help=f"a known card (memory, bandwidth, compute capability): {', '.join(g.key for g in GPUS)}"
    )
    parser.add_argument(
        "--quantize",
        default=",".join(quantize.KINDS),
        help="which choices to report, comma-separated (default all: none,fp8,int8,int4; auto: the one it loads)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=Config.max_new_tokens, help="tokens per answer (default 2048)"
    )
    parser.add_argument("--bandwidth", type=parse_bandwidth, help="memory bandwidth for the decode bound (600GB/s)")
    parser.add_argument("--compute-capability", help="e.g. 8.6 (with --gpu: the card's; unknown: every format counts)")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_CACHE_DTYPES),
        default="auto",
        help="how the key/value cache is stored, as the server's flag: auto (bf16) or fp8 (about half the bytes a row)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--readme-table", action="store_true", help="print the README's table of common GPUs")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.getLogger("vlm_demo.engine.kv.memory").setLevel(logging.ERROR)  # its "too few rows" warning is a row here
    if args.readme_table:
        print(readme_table(args.max_new_tokens))
        return 0
    try:
        spec = by_key(args.gpu) if args.gpu else None
    except KeyError as err:
        parser.error(str(err.args[0]))
    memory = args.gpu_memory or (spec.memory if spec else None)
    if memory is None:
        parser.error("say how much memory the GPU has: --gpu-memory 24GiB (or --gpu NAME)")
    asked = tuple(k.strip() for k in args.quantize.split(",") if k.strip())
    if not asked or any(k not in quantize.CHOICES for k in asked):
        parser.error(f"--quantize: choose from {', '.join(quantize.CHOICES)}, comma-separated (not {args.quantize!r})")
    capability = spec.capability if spec else None
    if args.compute_capability:
        match = re.fullmatch(r"(\d+)\.(\d+)", args.compute_capability.strip())
        if not match:
            parser.error(f"--compute-capability: expected MAJOR.MINOR such as 8.6, not {args.compute_capability!r}")
        capability = (int(match.group(1)), int(match.group(2)))
    bandwidth = args.bandwidth or (spec.bandwidth if spec else None)
    kinds = quantize.KINDS if "auto" in asked else asked  # auto: weigh them all, show its pick
    cores = (spec.sms, spec.ghz) if spec else None
    kv_dtype = kv_dtype_for(args.kv_cache_dtype, DTYPE)
    report = fit_report(memory, kinds, args.max_new_tokens, capability, bandwidth, spec.label if spec else "", cores,
                        None if kv_dtype == DTYPE else kv_dtype)  # fmt: skip
    shown = {k for k in asked if k != "auto"} | ({report["auto"]} if "auto" in asked else set())
    report["results"] = {k: r for k, r in report["results"].items() if k in shown}
    print(json.dumps(report, indent=1) if args.json else words(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
