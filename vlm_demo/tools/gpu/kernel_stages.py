"""The GPU check's kernel stages: each operator alone at the 11B model's real shapes, before any engine runs.

A decode step is ~2 × 40 attention calls and ~4 × 40 weight products; whether those kernels are fast is what a
short loan of a GPU must learn first. So, right after the model is built (``vlm_demo.tools.gpucheck``):

- :func:`measure_bandwidth`: what the device's memory moves, from timed ``copy_`` of 2 GiB buffers (bytes read
  plus bytes written, per second): the yardstick of every GB/s below and of the batch-1 decode bound;
- :func:`attention_op`: the decode attention alone over a page pool of the model's own page geometry (query
  heads, key/value heads, head dim, page sizes from :class:`~vlm_demo.engine.kv.pages.PageShape`), at 1-210 rows of
  ~600 text tokens with 1- and 4-tile pictures, for every kernel that runs here, through the kernels' public
  methods: µs per layer for self- and cross-attention, GB/s (key/value bytes read ÷ time), the largest
  difference from the reference kernel's output;
- :func:`weights_op`: the weight-only product (``vlm_demo::weight_only_linear``) for every packed format the device
  runs, on the text model's four projection shapes (q/k/v merged, o, gate/up merged, down, read from its config) at
  ``WEIGHT_ROWS`` rows, against ``F.linear`` on the model dtype's weight: µs, GB/s of weight bytes, and the
  error relative to the exact product of the stored weight (each row count falls in one of the kernel's tile
  tiers, so every tier is compared); under Triton's interpreter on a CPU also the Triton kernel itself;
- :func:`kernel_times`: a profiler's device time per kernel (name → total µs, calls).

Each figure is timed over copies of its data that together exceed the GPU's L2 cache (the real step reads
every layer's weights and keys once), with a few warm-up calls first (Triton compiles there), the timed calls
replayed from one CUDA graph (the device's time, as the engine's graphs run them; the reference attention, which
the engine never captures, eagerly). The decisions the
check takes on these figures are plain functions at the end (:func:`packed_slower`, :func:`op_errors`,
:func:`graphs_problems`, :func:`below_bound`), tested on a CPU with made-up figures.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vlm_demo.engine.executor.attention import KERNELS, VERSIONS
from vlm_demo.engine.executor.attention.base import PagedAttention, StepRows
from vlm_demo.engine.executor.attention.flash import flash_missing
from vlm_demo.engine.executor.attention.probe import tolerance
from vlm_demo.engine.executor.attention.tiled import triton_missing
from vlm_demo.engine.executor.staging import Staging
from vlm_demo.engine.kv.page_table import Placement
from vlm_demo.engine.kv.pages import PagePool, PageShape

log = logging.getLogger(__name__)

GB = 1e9
L2_SPAN = 128 * 2**20  # each timing rotates over copies of its data at least this large (an H100's L2: 50 MB)
MOST_COPIES = 64
# The attention op: the rows the engine runs at (210: an H200's planned limit), ~600-token rows, 1 and 4 tiles.
ATTENTION_ROWS = (1, 8, 32, 128, 210)
ATTENTION_TILES = (1, 4)
TEXT_TOKENS = 600
# The weight-only op: decode (1), the kernel's tile tiers (16, 32, 64, >64) and its last row count (256).
WEIGHT_ROWS = (1, 16, 32, 64, 128, 256)
CPU_WEIGHT_ROWS = (1, 16, 32, 64, 128)  # every tile tier
INTERPRETED_SHAPE = "o"  # under Triton's interpreter its kernel runs on this projection only (the CPU's time)
PACKED_TOLERANCE = 2e-2  # relative to the product's largest value: bf16 rounding of the output, not more
FREE_SHARE = 0.8  # an op's data may take this share of the free device memory


@dataclass(frozen=True)
class Timing:
    """How each figure is timed: ``warmups`` calls (Triton compiles in the first), then ``iterations`` timed."""

    warmups: int
    iterations: int


# Sized so that the kernel stages end within ~3 minutes of the start on an H100 (docs/gpu.md has the sum).
CUDA_TIMING = Timing(warmups=3, iterations=20)
CPU_TIMING = Timing(warmups=0, iterations=1)  # a dry run: every path once, numbers not meant


def timing_for(device: torch.device) -> Timing:
    return CUDA_TIMING if device.type == "cuda" else CPU_TIMING


def time_us(call: Callable[[int], Any], device: torch.device, timing: Timing,
            graph: bool = False) -> tuple[float, Any, str]:  # fmt: skip
    """Mean µs of ``call(i)`` over ``timing.iterations`` calls (``i``: which copy of the data; copies the warm-ups did
    not touch), after the warm-ups; what the first call returned (without warm-ups, a timed one: the CPU runs each
    once); and how it was timed. On CUDA with ``graph`` the timed calls are captured in one CUDA graph and replayed
    (the device's time alone, as the engine's graphs run them: a custom operator's ~20 µs of Python per call would
    otherwise exceed a 5 µs kernel), else timed eagerly with CUDA events; a capture that fails falls back to that."""
    timed = range(timing.warmups, timing.warmups + timing.iterations)
    if device.type != "cuda":
        first = call(0) if timing.warmups else None
        for i in range(1, timing.warmups):
            call(i)
        start = time.perf_counter()
        for i in timed:
            out = call(i)
            first = out if first is None else first
        return (time.perf_counter() - start) / timing.iterations * 1e6, first, "cpu"
    side, main = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):  # warm-ups (Triton compiles) off the stream a graph is captured from
        first = call(0)
        for i in range(1, max(timing.warmups, 1)):
            call(i)
    main.wait_stream(side)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graph:
        try:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                for i in timed:
                    call(i)
            captured.replay()
            begin.record()
            captured.replay()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) * 1e3 / timing.iterations, first, "graph"
        except Exception as exc:  # noqa: BLE001 - timed eagerly instead, and said so
            log.warning("timing from a CUDA graph failed (%s: %s); timing eagerly", type(exc).__name__, exc)
            torch.cuda.synchronize(device)
    begin.record()
    for i in timed:
        call(i)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / timing.iterations, first, "eager"


def copies_for(nbytes: int, device: torch.device) -> int:
    """Copies of ``nbytes`` of data a timing rotates over on a GPU, so that no call finds the last one's data in
    L2 (a CPU: one, its timings are not meant)."""
    if device.type != "cuda":
        return 1
    return max(1, min(MOST_COPIES, math.ceil(L2_SPAN / max(nbytes, 1))))


def free_bytes(device: torch.device) -> int | None:
    """Free device memory (``None``: not counted, a CPU)."""
    if device.type != "cuda":
        return None
    gc.collect()  # an earlier stage's pool held only by a reference cycle is freed first
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def measure_bandwidth(device: torch.device, size: int = 2 * 1024**3, repeats: int = 10) -> float:
    """Device memory bandwidth, bytes/s: ``dst.copy_(src)`` of ``size``-byte buffers, timed with CUDA events after
    one untimed copy; each copy counts ``2 × size`` bytes (it reads ``size`` and writes ``size``)."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_us(lambda i: dst.copy_(src), device, Timing(1, repeats))[0] / 1e6
    return 2 * size / seconds


# ---- the decode attention alone ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionGeometry:
    """What the attention stage runs: the rows, tiles and text tokens, and how it is timed."""

    rows: tuple[int, ...]
    tiles: tuple[int, ...]
    text_tokens: int
    timing: Timing

    @classmethod
    def for_device(cls, device: torch.device, shape: PageShape) -> AttentionGeometry:
        """The real one on a GPU; a cut-down one on a CPU (the dry run, and Triton's interpreter)."""
        tiles = tuple(t for t in ATTENTION_TILES if t <= shape.max_tiles)
        if device.type == "cuda":
            return cls(ATTENTION_ROWS, tiles, TEXT_TOKENS, CUDA_TIMING)
        return cls((1, 3), tiles, 2 * shape.page_tokens + 5, CPU_TIMING)


def kernel_missing(name: str, shape: PageShape, device: torch.device) -> str | None:
    """Why decode attention ``name`` cannot run here (``None``: it can). No probe: this stage compares every kernel
    with the reference itself (the engine's choice, with its probe, is the decode-step stage's)."""
    if name == "flash":
        return flash_missing(device, shape.dtype)
    if name == "triton":
        return triton_missing(device)
    return None


def read_bytes(shape: PageShape, rows: int, tokens: int) -> int:
    """Bytes of keys and values ``rows`` rows of ``tokens`` tokens each read in one layer."""
    return 2 * rows * tokens * shape.token_elements * shape.dtype.itemsize


def attention_op(shape: PageShape, heads: int, device: torch.device, geometry: AttentionGeometry | None = None,
                 kernels: tuple[str, ...] = tuple(KERNELS)) -> dict[str, Any]:  # fmt: skip
    """Each decode attention kernel alone, at every row count of ``geometry`` that fits in memory: µs per layer,
    GB/s and the largest difference from the reference for self-attention (``self``) and cross-attention per
    tile count (``cross_1_tiles``, ``cross_4_tiles``). A kernel that cannot run here is ``{"skipped": why}``.

    The pool holds one self- and one cross-attention layer of the model's page geometry (a page of it is a page
    of the engine's pool with the other layers' parts left out: the same tokens per page, read the same way)."""
    geometry = geometry or AttentionGeometry.for_device(device, shape)
    text_page_count = shape.text_pages(geometry.text_tokens + 1)
    row_pages = text_page_count + shape.image_pages(max(geometry.tiles) * shape.patches)
    page_bytes = 2 * max(shape.page_tokens, shape.image_page_tokens) * shape.token_elements * shape.dtype.itemsize

    def copies(rows: int) -> int:  # for the call that reads the fewest bytes at this row count: self-attention
        return copies_for(read_bytes(shape, rows, geometry.text_tokens + 1), device)

    free = free_bytes(device)
    rows_skipped: dict[str, str] = {}
    fitting = []
    for rows in geometry.rows:
        need = rows * copies(rows) * row_pages * page_bytes
        need += KERNELS["reference"].working_bytes(shape, heads, rows, max(geometry.tiles), geometry.text_tokens)
        if free is not None and need > FREE_SHARE * free:
            rows_skipped[str(rows)] = f"needs ~{need / GB:.1f} GB, {free / GB:.1f} GB free"
        else:
            fitting.append(rows)
    result: dict[str, Any] = {
        "geometry": {"heads": heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                     "page_tokens": shape.page_tokens, "image_page_tokens": shape.image_page_tokens,
                     "patches": shape.patches, "text_tokens": geometry.text_tokens, "tiles": list(geometry.tiles),
                     "rows": fitting, "dtype": str(shape.dtype).removeprefix("torch."),
                     "timing": vars(geometry.timing)},
        "rows_skipped": rows_skipped,
        "kernels": {},
    }  # fmt: skip
    if not fitting:
        return result
    pages = max(rows * copies(rows) for rows in fitting) * row_pages
    pool = PagePool(shape, pages, {shape.self_layers[0]: device, shape.cross_layers[0]: device})
    generator = torch.Generator(device=device).manual_seed(0)
    for buffer in pool.buffers.values():
        buffer.normal_(generator=generator)
    order = np.random.default_rng(0).permutation(pages).tolist()  # the rows' pages scattered over the pool

    def places(rows: int, tiles: int, copy: int) -> list[Placement]:
        out = []
        for r in range(rows):
            start = (copy * rows + r) * row_pages
            own = order[start : start + row_pages]
            image = own[text_page_count : text_page_count + shape.image_pages(tiles * shape.patches)]
            out.append(Placement(own[:text_page_count], geometry.text_tokens, image, tiles, True))
        return out

    queries = {rows: torch.randn(rows, heads, shape.head_dim, generator=generator, device=device).to(shape.dtype)
               for rows in fitting}  # fmt: skip
    wanted: dict[tuple[int, str], torch.Tensor] = {}  # the reference's outputs, by rows and part
    for name in sorted(kernels, key=lambda k: k != "reference"):  # the reference first: the others' yardstick
        missing = kernel_missing(name, shape, device)
        if missing is not None:
            result["kernels"][name] = {"skipped": missing}
            continue
        kernel = KERNELS[name](pool, heads, shape.head_dim**-0.5)
        mine = geometry
        if name == "triton" and device.type != "cuda":  # its interpreter takes seconds a call: one row, one tile
            mine = AttentionGeometry(tuple(fitting[:1]), geometry.tiles[:1], geometry.text_tokens, geometry.timing)
        figures: dict[str, Any] = {}
        try:
            for rows in (r for r in fitting if r in mine.rows):
                count = 1 if name == "reference" else copies(rows)  # the reference keeps its gathers: as a step
                figures[str(rows)] = _attention_rows(kernel, rows, count, mine, places, queries[rows], wanted)
            result["kernels"][name] = {"rows": figures}
        except Exception as exc:  # noqa: BLE001 - recorded; the other kernels still run
            failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            result["kernels"][name] = {"rows": figures, "failure": failure}
    return result


def _attention_rows(kernel: PagedAttention, rows: int, copies: int, geometry: AttentionGeometry,
                    places: Callable[[int, int, int], list[Placement]], query: torch.Tensor,
                    wanted: dict[tuple[int, str], torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    """One kernel at ``rows`` rows: self-attention (timed with the first tile count's layout) and cross-attention
    at each tile count, each timed over ``copies`` copies of the rows' pages; the reference's outputs are kept in
    ``wanted``, the other kernels' compared with them."""
    shape, device, staging = kernel.shape, query.device, Staging(query.device)
    figures: dict[str, Any] = {}
    for tiles in geometry.tiles:
        layouts = []
        for copy in range(copies):
            mine = places(rows, tiles, copy)
            step_order = kernel.order(mine, rows, next(VERSIONS), staging)
            ranked = mine if step_order is None else [mine[i] for i in step_order.rank]
            lengths = np.asarray([p.length for p in ranked], dtype=np.int64)
            _, layout = kernel.prepare(StepRows(ranked, rows, lengths, next(VERSIONS), staging), [])
            q = query if step_order is None else query[step_order.order]
            layouts.append((q, layout, None if step_order is None else step_order.restore[:rows]))
        parts = [("self", geometry.text_tokens + 1)] if tiles == geometry.tiles[0] else []
        parts.append((f"cross_{tiles}_tiles", tiles * shape.patches))
        for part, tokens in parts:

            def run(i: int, part: str = part, layouts: list = layouts) -> torch.Tensor:
                q, layout, _ = layouts[i % copies]
                if part == "self":
                    return kernel.self_attention(shape.self_layers[0], q, layout)
                return kernel.cross_attention(shape.cross_layers[0], q, layout)

            with torch.inference_mode():
                micros, out, how = time_us(run, device, geometry.timing, graph=kernel.graphable)
                restore = layouts[0][2]
                out = out.float() if restore is None else out.float()[restore]
            nbytes = read_bytes(shape, rows, tokens)
            entry: dict[str, Any] = {"us": round(micros, 2), "bytes": nbytes, "gb_s": round(nbytes / micros / 1e3, 1),
                                     "timed": how}  # fmt: skip
            if kernel.name == "reference":
                wanted[(rows, part)] = out
            elif (rows, part) in wanted:
                entry["max_error"] = _difference(out, wanted[(rows, part)])
            figures[part] = entry
        staging.recycle()
    return figures


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference (NaN if ``got`` has a non-finite value)."""
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return float((got - want).abs().max())


# ---- the weight-only product alone ---------------------------------------------------------------------------


def projections(config: Any) -> dict[str, tuple[int, int]]:
    """The text model's four products of a decode step, ``(out, in)`` features, from its config: q/k/v merged,
    o, gate/up merged, down."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    hidden, inner = text.hidden_size, text.intermediate_size
    return {
        "qkv": ((text.num_attention_heads + 2 * text.num_key_value_heads) * head_dim, hidden),
        "o": (hidden, text.num_attention_heads * head_dim),
        "gate_up": (2 * inner, hidden),
        "down": (hidden, inner),
    }


def formats_here(device: torch.device) -> dict[str, str | None]:
    """Each packed format, and why the device cannot run it (``None``: it can): fp8 needs compute capability 8.9."""
    fp8 = None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        fp8 = f"needs compute capability 8.9 or newer (this GPU has {major}.{minor})"
    return {"int8": None, "fp8": fp8, "int4": None}


def packed_weight(fmt: str, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor | None]:  # fmt: skip
    """``weight`` ``[out, in]`` (float32) packed as ``fmt`` stores it: values, scale, zero (int4 only)."""
    from vlm_demo.engine.weights.packed import pack_int4
    from vlm_demo.engine.weights.quantize import int4_group

    if fmt == "int4":
        group = int4_group(weight.shape[1], weight.device.type == "cuda") or weight.shape[1]
        packed = pack_int4(weight, group, dtype)
        return packed.weight.detach(), packed.scale.detach(), packed.zero.detach()  # type: ignore[union-attr]
    top = 127.0 if fmt == "int8" else float(torch.finfo(torch.float8_e4m3fn).max)
    scale = weight.abs().amax(dim=1).clamp_min(1e-8) / top
    scaled = weight / scale[:, None]
    values = scaled.round().clamp(-127, 127).to(torch.int8) if fmt == "int8" else scaled.to(torch.float8_e4m3fn)
    return values, scale.float(), None


def stored(values: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in (values, scale, zero) if t is not None)


def weights_op(config: Any, device: torch.device, dtype: torch.dtype, rows: tuple[int, ...] | None = None,
               timing: Timing | None = None) -> dict[str, Any]:  # fmt: skip
    """The weight-only product per projection and row count: ``dtype`` (``F.linear``) and each packed format the
    device runs, each ``{"us", "bytes", "gb_s", "rel_error"}``; on a CPU with Triton's interpreter also
    ``triton_rel_error`` (the Triton kernel itself; the CPU's operator is torch's arithmetic)."""
    from vlm_demo.engine.executor.attention.tiled import interpreted
    from vlm_demo.engine.weights.packed import triton_matmul, weight_only_linear, widened

    rows = rows or (WEIGHT_ROWS if device.type == "cuda" else CPU_WEIGHT_ROWS)
    timing = timing or timing_for(device)
    base = str(dtype).removeprefix("torch.")
    kinds = formats_here(device)
    interpreter = device.type == "cpu" and interpreted() and triton_missing(device) is None
    result: dict[str, Any] = {
        "dtype": base, "rows": list(rows), "timing": vars(timing),
        "formats_skipped": {k: why for k, why in kinds.items() if why}, "shapes": {},
    }  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(0)
    for name, (out_features, in_features) in projections(config).items():
        weight = torch.randn(out_features, in_features, generator=generator, device=device) * in_features**-0.5
        variants: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {
            base: (weight.to(dtype), None, None)
        }
        for fmt, why in kinds.items():
            if why is None:
                variants[fmt] = packed_weight(fmt, weight, dtype)
        del weight
        shape_figures: dict[str, Any] = {"out_features": out_features, "in_features": in_features, "rows": {}}
        for fmt, (values, scale, zero) in variants.items():
            nbytes = stored(values, scale, zero)
            copies = [(values, scale, zero)] + [
                (values.clone(), scale.clone() if scale is not None else None, zero.clone() if zero is not None else None)
                for _ in range(copies_for(nbytes, device) - 1)
            ]  # fmt: skip
            exact = values.float() if scale is None else widened(values, scale, zero, torch.float32)
            for m in rows:
                x = torch.randn(m, in_features, generator=generator, device=device).to(dtype)

                def call(i: int, c: list = copies, x: torch.Tensor = x) -> torch.Tensor:
                    v, s, z = c[i % len(c)]
                    return F.linear(x, v) if s is None else weight_only_linear(x, v, s, z, None, 1.0)

                with torch.inference_mode():
                    want = F.linear(x.float(), exact)
                    micros, out, how = time_us(call, device, timing, graph=True)
                    entry = {"rel_error": _relative(out, want), "timed": how}
                    if interpreter and scale is not None and name == INTERPRETED_SHAPE:
                        out = x.new_empty(m, out_features)
                        triton_matmul(x, values, scale, zero, None, 1.0, out)
                        entry["triton_rel_error"] = _relative(out, want)
                entry.update(us=round(micros, 2), bytes=nbytes, gb_s=round(nbytes / micros / 1e3, 1))
                shape_figures["rows"].setdefault(str(m), {})[fmt] = entry
            del copies, exact
        result["shapes"][name] = shape_figures
    return result


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the product's largest value (NaN if ``got`` is not finite)."""
    got = got.float()
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# ---- what the profiler saw ----------------------------------------------------------------------------------


def kernel_times(prof: Any, cuda: bool, most: int = 40) -> dict[str, dict[str, float]]:
    """A profile's kernels (on a CPU: operators), longest first, at most ``most``: name → total µs of device time
    (CPU time on a CPU) and calls."""
    rows = []
    for event in prof.key_averages():
        micros = _device_us(event) if cuda else event.self_cpu_time_total
        if micros > 0 and (not cuda or _device_us(event) > 0):
            rows.append((event.key, float(micros), int(event.count)))
    rows.sort(key=lambda row: -row[1])
    return {name: {"us": round(micros, 1), "calls": calls} for name, micros, calls in rows[:most]}


def _device_us(event: Any) -> float:
    """An event's own device time (kernels), in µs: ``self_device_time_total`` in torch ≥ 2.4, else CUDA's."""
    for attribute in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attribute, None)
        if value is not None:
            return float(value)
    return 0.0


# ---- the decisions --------------------------------------------------------------------------------------------


def packed_slower(figures: dict[str, Any]) -> list[str]:
    """Each (projection, rows, format) where a packed format reads fewer bytes than the model dtype's weight yet
    takes longer: what packing is for, not delivered (one sentence each)."""
    base = figures.get("dtype")
    slower = []
    for name, shape in (figures.get("shapes") or {}).items():
        for m, entries in shape["rows"].items():
            plain = entries.get(base)
            if not plain:
                continue
            for fmt, entry in entries.items():
                if fmt != base and entry["bytes"] < plain["bytes"] and entry["us"] > plain["us"]:
                    slower.append(
                        f"weight-only {fmt} is slower than {base} on {name} at {m} rows ({entry['us']:.1f} against "
                        f"{plain['us']:.1f} µs) though it reads {entry['bytes'] / 1e6:.1f} MB against "
                        f"{plain['bytes'] / 1e6:.1f}"
                    )
    return slower


def op_errors(attention: dict[str, Any] | None, weights: dict[str, Any] | None,
              dtype: torch.dtype) -> list[str]:  # fmt: skip
    """Each kernel whose output differs from its reference by more than the tolerance (or is not finite): the
    attention kernels against the reference kernel (``probe.tolerance``, absolute), the weight-only product
    against the exact product of the stored weight (``PACKED_TOLERANCE``, relative)."""
    problems = []
    limit = tolerance(dtype)
    for name, kernel in ((attention or {}).get("kernels") or {}).items():
        if "failure" in kernel:
            problems.append(f"decode attention {name} failed: {kernel['failure']}")
        for rows, figures in (kernel.get("rows") or {}).items():
            for part, entry in figures.items():
                error = entry.get("max_error")
                if error is not None and not error <= limit:
                    problems.append(f"decode attention {name} at {rows} rows ({part}) differs from the reference "
                                    f"by {error:.3g} (more than {limit:g})")  # fmt: skip
    for name, shape in ((weights or {}).get("shapes") or {}).items():
        for m, entries in shape["rows"].items():
            for fmt, entry in entries.items():
                for key in ("rel_error", "triton_rel_error"):
                    error = entry.get(key)
                    if error is not None and not error <= PACKED_TOLERANCE:
                        problems.append(f"weight-only {fmt} on {name} at {m} rows: {key} {error:.3g} (more than "
                                        f"{PACKED_TOLERANCE:g})")  # fmt: skip
    return problems


def graphs_problems(figures: dict[str, Any], cuda: bool, graphable: bool) -> list[str]:
    """What is wrong with a kernel's decode-step stage: NaN logits; on CUDA, a block-table kernel (which graphs
    can replay) that captured no graph, or replayed logits that differ from the eager step's."""
    problems = []
    if figures.get("nan_steps"):
        problems.append(f"{figures['nan_steps']} of {figures['steps']} decode steps gave NaN logits")
    if cuda and graphable and not figures.get("captured"):
        problems.append("CUDA captured no decode graph")
    for rows, entry in (figures.get("rows") or {}).items():
        diff = entry.get("graphs_vs_eager")
        if diff is not None and not diff <= PACKED_TOLERANCE:
            problems.append(f"logits replayed from the graph at {rows} rows differ from the eager step's by "
                            f"{diff:.3g} of their largest (more than {PACKED_TOLERANCE:g})")  # fmt: skip
    return problems


BOUND_SHARE = 0.4  # batch-1 decode must reach this share of the bound from the bytes a step reads


def below_bound(tokens_per_s: float | None, bound: float | None, share: float = BOUND_SHARE) -> str | None:
    """Why batch-1 decode is too slow (``None``: it is not, or either figure is missing): below ``share`` of
    ``bound``, the tokens/s a device could reach if a step only read its bytes once at the measured copy
    bandwidth."""
    if not tokens_per_s or not bound or tokens_per_s >= share * bound:
        return None
    return (f"decode at batch 1 reaches {tokens_per_s:.1f} tokens/s, {tokens_per_s / bound:.0%} of the "
            f"{bound:.1f} tokens/s its bytes allow at the measured bandwidth (at least {share:.0%} expected)")  # fmt: skip
