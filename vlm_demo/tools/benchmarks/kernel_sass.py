"""The decode kernels as a GPU would run them, read on a machine without one: ``bench --kernel-sass``.

Each kernel is compiled by Triton for each GPU target (its own compiler and ``ptxas``, both in its wheel), with the
arguments **a real launch passes at the 11B model's shapes**: the launchers themselves (``triton_kernels``,
``packed_kernels``) are called on shape-only (``meta``) tensors with each launch recorded, and the recorded
arguments are specialised as Triton's ``JITFunction`` specialises a launch (pointers and integers divisible by 16
carry a divisibility hint; integers equal to 1 become constants). Without those hints a kernel compiles to other
code (2-byte loads, twice the registers) than the GPU runs.

The machine code (SASS, read with the ``cuobjdump`` in Triton's wheel) is then measured where the time goes, the
kernel's **main loop** — the longest loop (a backward branch) that loads from global memory:

- ``loop_instructions``: instructions per warp per iteration; ``keys_per_iteration`` (attention) or
  ``weight_bytes_per_iteration`` (packed) what one iteration moves;
- ``async_copy``: the loop's loads are asynchronous copies (``LDGSTS``, or the bulk copy engine's ``UTMALDG`` /
  ``UBLKCP``), i.e. Triton's pipeliner issued them stages ahead; ``ldg128``: it loads 16 bytes a thread at a time;
- ``slow_conversions``: ``I2F``, ``F2F`` and ``F2FP`` instructions per warp per iteration (16 results per clock per
  SM, where most instructions issue at 32 per scheduler);
- ``registers``, ``spills`` (local-memory loads and stores in the whole kernel: 0 is none), ``shared_bytes``;
- ``ceiling_tb_s``: the bytes an iteration moves over the larger of its issue time (``loop_instructions × warps ÷
  4`` clocks: four schedulers per SM, one warp instruction each per clock) and its conversion time
  (``slow_conversions × warps × 32 ÷ 16`` clocks), times the target's SMs and clock — what the SMs could consume
  if memory kept up and enough programs were resident to hide its latency. Compare it with the memory's bandwidth
  (``memory_tb_s``): below it, the kernel is bound by its instructions, not by memory. For the packed products
  it is divided by ``row_blocks``, the programs that widen the same weight tile (a batch wider than one
  ``BLOCK_M``): what counts is the weight bytes first read (``tile_ceiling_tb_s``: one program's).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Target:
    """A GPU generation, as one of its common cards has it (SMs and boost clock: the ceiling's arithmetic)."""

    capability: int
    card: str
    sms: int
    ghz: float
    memory_tb_s: float


TARGETS: dict[str, Target] = {
    "sm_80": Target(80, "A100 SXM 80GB", 108, 1.41, 2.04),
    "sm_89": Target(89, "L40S", 142, 2.52, 0.864),
    "sm_90": Target(90, "H100 SXM", 132, 1.83, 3.35),  # the H200: the same SMs and clock, 4.8 TB/s
    "sm_120": Target(120, "RTX Pro 6000 Blackwell", 188, 2.6, 1.79),
}
ATTENTION = ("attention_text", "attention_image", "merge", "attention_text_fp8", "attention_image_fp8",
             "attention_picture_rows", "attention_picture_rows_fp8")  # fmt: skip
PACKED = ("packed_int8", "packed_fp8", "packed_int4")
KERNELS = ATTENTION + PACKED
PACKED_ROWS = (1, 16, 32, 64, 128, 256)
CONVERSIONS = ("I2F", "F2F", "F2FP")
ASYNC = ("LDGSTS", "UTMALDG", "UBLKCP")

# The 11B model's decode geometry (Llama-3.2-11B-Vision): 32 query heads over 8 key/value heads of 128, 40 text
# layers of which 8 cross-attend, a 4,096-wide model with a 14,336-wide MLP; a 4-tile picture is 6,404 states.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP = 32, 8, 128, 4096, 14336
TEXT_TOKENS, IMAGE_TOKENS = 600, 4 * 1601


@dataclass
class Launch:
    """One recorded launch: the kernel, and its arguments by name (constants and launch options included)."""

    fn: Any
    args: dict[str, Any]
    options: dict[str, int]


@contextlib.contextmanager
def recording(module: Any, *names: str) -> Iterator[list[Launch]]:
    """Replace ``module``'s kernels ``names`` with recorders for the duration: ``kernel[grid](...)`` records."""
    launches: list[Launch] = []
    originals = {name: getattr(module, name) for name in names}

    class Recorder:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                options: dict[str, int] = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
                launches.append(
                    Launch(self.fn, {**dict(zip(self.fn.arg_names, args, strict=False)), **kwargs}, options)
                )

            return launch

    try:
        for name, fn in originals.items():
            setattr(module, name, Recorder(fn))
        yield launches
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip


def specialise(launch: Launch) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], list[list[Any]]]]:
    """The signature, constants and attributes ``JITFunction`` gives this launch (see the module's docstring)."""
    fn = launch.fn
    constexprs = _constexprs(fn)
    signature: dict[str, str] = {}
    constants: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    hint = [["tt.divisibility", 16]]
    for i, name in enumerate(fn.arg_names):
        value = launch.args[name]
        if (
            name in constexprs
            or value is None
            or (isinstance(value, int) and not isinstance(value, bool) and value == 1)
        ):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = "*" + TYPES[value.dtype], hint
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = hint
        else:
            signature[name] = "fp32"
    return signature, constants, attrs


def _constexprs(fn: Any) -> set[str]:
    """The kernel's ``tl.constexpr`` parameters (a compiled kernel's, or an interpreted one's from its annotations)."""
    if hasattr(fn, "params"):
        return {p.name for p in fn.params if p.is_constexpr}
    parameters = inspect.signature(fn.fn).parameters.values()
    return {p.name for p in parameters if "constexpr" in str(p.annotation)}


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_launch(launch: Launch, capability: int) -> tuple[bytes, int]:
    """The launch's kernel compiled for ``sm_<capability>``: its cubin, and the shared memory a launch takes (Triton's
    dynamic allocation, which the cubin's own figure leaves out)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs = specialise(launch)
    source = ASTSource(launch.fn, signature, constants, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(launch.options))
    return compiled.asm["cubin"], int(compiled.metadata.shared)


@dataclass
class Sass:
    """What the machine code says (see the module's docstring)."""

    registers: int
    spills: int
    shared_bytes: int
    warps: int
    loop_instructions: int | None
    async_copy: bool
    ldg128: bool
    slow_conversions: int | None
    mma: int | None  # tensor-core instructions (HMMA, HGMMA, …) per iteration


LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` in order, predicates dropped."""
    out = []
    for address, text in LINE.findall(sass):
        text = re.sub(r"^@!?U?P\w+\s+", "", text.strip())
        out.append((int(address, 16), text))
    return out


def main_loop(code: list[tuple[int, str]]) -> list[str] | None:
    """The instructions of the longest loop that loads from global memory (``None``: no such loop)."""
    loops = []
    for address, text in code:
        jump = re.match(r"BRA(?:\.\S+)?\s+(?:`\()?(?:\S+\s+)?0x([0-9a-f]+)", text)
        if jump and int(jump.group(1), 16) < address:
            start = int(jump.group(1), 16)
            body = [t for a, t in code if start <= a <= address and not t.startswith("NOP")]
            if any(t.split(" ")[0].split(".")[0] in ("LDG", *ASYNC) for t in body):
                loops.append(body)
    return max(loops, key=len) if loops else None


def opcode(text: str) -> str:
    return text.split(" ")[0].split(".")[0]


def read_cubin(cubin: bytes, shared: int, warps: int) -> Sass:
    """Registers, spills, shared memory (the cubin's own, or ``shared`` where larger) and the main loop's figures of
    one compiled kernel (``warps`` per program)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", file.name], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
        sass = subprocess.run([_tool("cuobjdump"), "-sass", file.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    field = {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", usage)}
    code = instructions(sass)
    loop = main_loop(code)
    ops = [opcode(t) for t in loop] if loop is not None else []
    return Sass(
        registers=field.get("REG", 0),
        spills=sum(opcode(t) in ("STL", "LDL") for _, t in code),
        shared_bytes=max(field.get("SHARED", 0), shared),
        warps=warps,
        loop_instructions=len(loop) if loop is not None else None,
        async_copy=any(o in ASYNC for o in ops),
        ldg128=any(opcode(t) in ("LDG", *ASYNC) and ".128" in t.split(" ")[0] for t in loop or []),
        slow_conversions=sum(o in CONVERSIONS for o in ops) if loop is not None else None,
        mma=sum(o in ("HMMA", "HGMMA", "IMMA", "QMMA", "UTCHMMA", "UTCQMMA", "OMMA") for o in ops)
        if loop is not None
        else None,
    )


def ceiling_tb_s(sass: Sass, bytes_per_iteration: float, target: Target) -> float | None:
    """Bytes per second the SMs could consume, in TB/s (see the module's docstring)."""
    if sass.loop_instructions is None or sass.slow_conversions is None:
        return None
    issue = sass.loop_instructions * sass.warps / 4
    conversion = sass.slow_conversions * sass.warps * 32 / 16
    return round(bytes_per_iteration / max(issue, conversion, 1e-9) * target.sms * target.ghz * 1e9 / 1e12, 3)


# ---- the launches, recorded at the 11B shapes ------------------------------------------------------------------


def attention_launches() -> dict[str, Launch]:
    """The decode attention's launches for one 600-token text row and one 4-tile picture, as the launcher makes
    them with an H100's split plan (the code compiled does not depend on the SM count or the rows); ``…_fp8``: the
    same over fp8 pages with their scales (``--kv-cache-dtype fp8``); ``attention_picture_rows``: a picture row's
    launch (the cascade: 8 rows about one picture, 256 query heads over its 8 key/value heads)."""
    launches: dict[str, Launch] = {}
    for suffix, kv_dtype in (("", None), ("_fp8", torch.float8_e4m3fn)):
        launches.update({name + suffix: launch for name, launch in _attention_launches(kv_dtype).items()})
    launches.pop("merge_fp8")  # the merge reads float32 parts either way
    return launches


def _attention_launches(kv_dtype: torch.dtype | None) -> dict[str, Launch]:
    from vlm_demo.engine.executor.attention import tiled_kernels as triton_kernels
    from vlm_demo.engine.executor.attention.tiled import CASCADE_SLOTS, SplitPlan
    from vlm_demo.engine.kv.pages import PagePool, PageShape

    meta = torch.device("meta")
    shape = PageShape(256, 1024, tuple(range(32)), tuple(range(32, 40)), KV_HEADS, HEAD_DIM, 1601, 4, torch.bfloat16,
                      kv_dtype)  # fmt: skip
    pool = PagePool(shape, 4096, dict.fromkeys(range(40), meta))
    plan = SplitPlan.for_device(meta, shape)
    query = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=meta)
    launches: dict[str, Launch] = {}
    for name, layer, tokens, page, image in (("attention_text", 0, TEXT_TOKENS, 256, False),
                                             ("attention_image", 32, IMAGE_TOKENS, 1024, True)):  # fmt: skip
        splits = plan.splits(tokens, image)
        least = plan.image_blocks if image else plan.text_blocks
        table = torch.empty(1, -(-tokens // page), dtype=torch.int32, device=meta)
        lengths = torch.empty(1, dtype=torch.int32, device=meta)
        parts = torch.empty(1, HEADS, splits, HEAD_DIM, dtype=torch.float32, device=meta)
        lse = torch.empty(1, HEADS, splits, dtype=torch.float32, device=meta)
        with recording(triton_kernels, "_split_attention", "_merge") as made:
            triton_kernels.split_attention(query, pool.keys[layer], pool.values[layer], table, lengths,
                                           HEAD_DIM**-0.5, plan.block, least, splits, parts, lse,
                                           pool.key_scales.get(layer), pool.value_scales.get(layer))  # fmt: skip
            if name == "attention_image":
                out = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=meta)
                triton_kernels.merge(parts, lse, lengths, plan.block, least, out)
        launches[name] = made[0]
        if len(made) > 1:
            launches["merge"] = made[1]
    # A picture row: 8 rows about one picture read its states once, all their query heads in one product
    grouped = torch.empty(1, HEADS * CASCADE_SLOTS, HEAD_DIM, dtype=torch.bfloat16, device=meta)
    splits, layer = plan.splits(IMAGE_TOKENS, True), 32
    table = torch.empty(1, -(-IMAGE_TOKENS // 1024), dtype=torch.int32, device=meta)
    lengths = torch.empty(1, dtype=torch.int32, device=meta)
    parts = torch.empty(1, HEADS * CASCADE_SLOTS, splits, HEAD_DIM, dtype=torch.float32, device=meta)
    lse = torch.empty(1, HEADS * CASCADE_SLOTS, splits, dtype=torch.float32, device=meta)
    with recording(triton_kernels, "_split_attention") as made:
        triton_kernels.split_attention(grouped, pool.keys[layer], pool.values[layer], table, lengths, HEAD_DIM**-0.5,
                                       plan.block, plan.image_blocks, splits, parts, lse, pool.key_scales.get(layer),
                                       pool.value_scales.get(layer))  # fmt: skip
    launches["attention_picture_rows"] = made[0]
    return launches


def packed_launch(fmt: str, rows: int, capability: int = 90) -> Launch:
    """The weight-only product's launch for the gate/up projection (28,672 × 4,096: 60 % of a step's weight bytes
    with down; the loop is the same for every shape) at ``rows`` rows."""
    from vlm_demo.engine.weights import packed_kernels
    from vlm_demo.engine.weights.quantize import int4_group

    meta = torch.device("meta")
    columns = 2 * MLP
    x = torch.empty(rows, HIDDEN, dtype=torch.bfloat16, device=meta)
    out = torch.empty(rows, columns, dtype=torch.bfloat16, device=meta)
    if fmt == "int4":
        group = int4_group(HIDDEN, True) or 128
        values = torch.empty(columns, HIDDEN // 2, dtype=torch.uint8, device=meta)
        scale = torch.empty(HIDDEN // group, columns, dtype=torch.bfloat16, device=meta).t()  # group-major, as packed
        zero: torch.Tensor | None = torch.empty_like(scale)
    else:
        values = torch.empty(columns, HIDDEN, dtype=torch.int8 if fmt == "int8" else torch.float8_e4m3fn, device=meta)
        scale, zero = torch.empty(columns, 1, dtype=torch.float32, device=meta), None
    with recording(packed_kernels, "_weight_only_matmul") as made:
        packed_kernels.weight_only_matmul(x, values, scale, zero, None, 1.0, out, capability)
    return made[0]


def _moved(name: str, launch: Launch) -> tuple[str, float] | None:
    """What one main-loop iteration moves: ``("keys_per_iteration", keys)`` for attention,
    ``("weight_bytes_per_iteration", bytes)`` for the packed products (``None``: the merge has no such loop)."""
    a = launch.args
    if name.startswith("attention"):
        return "keys_per_iteration", a["BLOCK_N"]
    if name.startswith("packed"):
        per_weight = 0.5 if a["INT4"] else 1
        step = a["GROUP"] if a["INT4"] else a["BLOCK_K"]
        return "weight_bytes_per_iteration", a["BLOCK_N"] * step * per_weight
    return None


def entry(name: str, launch: Launch, target_name: str, rows: int) -> dict[str, Any]:
    """One kernel at one target: the figures, or why it does not compile there."""
    target = TARGETS[target_name]
    row: dict[str, Any] = {"kernel": name, "target": target_name, "card": target.card, "rows": rows,
                           "memory_tb_s": target.memory_tb_s}  # fmt: skip
    moved = _moved(name, launch)
    if moved is not None:
        row[moved[0]] = moved[1]
    try:
        sass = read_cubin(*compile_launch(launch, target.capability), launch.options.get("num_warps", 4))
    except Exception as exc:  # noqa: BLE001 - a target that cannot compile it says why
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"
        return row
    row.update(registers=sass.registers, spills=sass.spills, shared_bytes=sass.shared_bytes, warps=sass.warps,
               loop_instructions=sass.loop_instructions, async_copy=sass.async_copy, ldg128=sass.ldg128,
               slow_conversions=sass.slow_conversions, mma_per_iteration=sass.mma)  # fmt: skip
    if moved is not None:
        kv_bytes = 2 * (HEAD_DIM + 4) if name.endswith("_fp8") else 2 * HEAD_DIM * 2  # a key and a value of a head
        per_iteration = moved[1] * kv_bytes if name.startswith("attention") else moved[1]
        row["ceiling_tb_s"] = ceiling_tb_s(sass, per_iteration, target)
        if name.startswith("attention") and sass.loop_instructions is not None:
            row["instructions_per_32_keys"] = round(sass.loop_instructions * 32 / moved[1], 1)
    else:
        row["ceiling_tb_s"] = None
    return row


def report(targets: tuple[str, ...] = tuple(TARGETS), kernels: tuple[str, ...] = KERNELS,
           rows: tuple[int, ...] = PACKED_ROWS) -> dict[str, Any]:  # fmt: skip
    """``{"triton": version, "kernels": [...]}``: every kernel asked for at every target (the packed ones at every
    row count; rows that share a tile configuration are compiled once)."""
    import triton

    os.environ.pop("TRITON_INTERPRET", None)  # compiled, never interpreted
    out: list[dict[str, Any]] = []
    attention = attention_launches() if any(k in ATTENTION for k in kernels) else {}
    compiled: dict[tuple[Any, ...], dict[str, Any]] = {}  # (kernel, target, tile, stages, words)
    for target in targets:
        for name in kernels:
            if name in ATTENTION:
                out.append(entry(name, attention[name], target, 1))
                continue
            for m in rows:
                launch = packed_launch(name.removeprefix("packed_"), m, TARGETS[target].capability)
                tile = tuple(launch.args[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
                key = (name, target, tile, launch.options.get("num_stages"), launch.args["WORDS"])
                if key not in compiled:
                    compiled[key] = entry(name, launch, target, m)
                out.append(packed_row(compiled[key], m, launch))
    return {"triton": triton.__version__, "shapes": _shapes(), "ceiling": CEILING, "kernels": out}


def packed_row(compiled: dict[str, Any], rows: int, launch: Launch) -> dict[str, Any]:
    """A packed kernel's entry at ``rows``: its tile's figures, with ``row_blocks`` programs widening each weight
    tile (the batch in ``BLOCK_M`` blocks) — the tile's ceiling is then shared by that many: ``ceiling_tb_s`` is
    weight bytes first read per second (``tile_ceiling_tb_s`` ÷ ``row_blocks``), ``split_k`` the programs per tile
    along the inputs."""
    a = launch.args
    blocks = -(-rows // a["BLOCK_M"])
    row = {**compiled, "rows": rows, "tile": [a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_K"]], "row_blocks": blocks,
           "split_k": a["SPLIT_K"]}  # fmt: skip
    if compiled.get("ceiling_tb_s") is not None:
        row["tile_ceiling_tb_s"] = compiled["ceiling_tb_s"]
        row["ceiling_tb_s"] = round(compiled["ceiling_tb_s"] / blocks, 3)
    return row


CEILING = ("ceiling_tb_s = bytes per main-loop iteration / max(loop_instructions * warps / 4, slow_conversions * "
           "warps * 32 / 16) clocks * SMs * clock, over the row blocks that widen the same weights (packed) "
           "(docs/BENCHMARKS.md, 'Reading the kernels')")  # fmt: skip


# ``ceiling_tb_s`` of the packed kernels at the gate/up shape (``bench --kernel-sass``, Triton 3.9.0, 2026-12-06):
# target → format → rows → TB/s of weight bytes the SMs could widen and multiply (the row blocks that share a
# weight tile counted). A decode step's packed products read at most ``min(memory_tb_s, ceiling)``; the test
# ``test_kernel_sass`` keeps the sm_89/sm_90 decode rows equal to a fresh compile.
PACKED_CEILINGS: dict[str, dict[str, dict[int, float]]] = {
    "sm_80": {
        "int8": {1: 3.735, 16: 3.735, 32: 3.437, 64: 3.028, 128: 1.902, 256: 1.499},
        "fp8": {1: 4.655, 16: 4.655, 32: 3.769, 64: 3.257, 128: 1.902, 256: 1.218},
        "int4": {1: 2.61, 16: 2.61, 32: 2.076, 64: 1.004, 128: 0.502, 256: 0.251},
    },
    "sm_89": {
        "int8": {1: 8.777, 16: 8.777, 32: 7.988, 64: 7.115, 128: 4.469, 256: 3.523},
        "fp8": {1: 10.938, 16: 10.938, 32: 8.751, 64: 7.714, 128: 4.261, 256: 2.955},
        "int4": {1: 6.107, 16: 6.107, 32: 4.927, 64: 2.297, 128: 1.149, 256: 0.574},
    },
    "sm_90": {
        "int8": {1: 7.884, 16: 7.884, 32: 5.803, 64: 7.67, 128: 4.055, 256: 3.585},
        "fp8": {1: 7.17, 16: 7.17, 32: 5.978, 64: 6.777, 128: 4.089, 256: 3.276},
        "int4": {1: 4.302, 16: 4.302, 32: 3.54, 64: 1.767, 128: 0.883, 256: 0.442},
    },
    "sm_120": {
        "int8": {1: 16.967, 16: 16.967, 32: 11.376, 64: 7.7, 128: 3.525, 256: 2.677},
        "fp8": {1: 15.283, 16: 15.283, 32: 12.513, 64: 10.971, 128: 6.376, 256: 4.26},
        "int4": {1: 8.762, 16: 8.762, 32: 6.928, 64: 3.422, 128: 1.711, 256: 0.856},
    },
}


def packed_bandwidth(fmt: str, target: str, rows: int) -> float:
    """TB/s a decode step's ``fmt`` products can read at ``rows`` rows on ``target``'s card: the smaller of its
    memory bandwidth and the compiled ceiling of the smallest row tier at or above ``rows`` (``bf16``: the memory's)."""
    card = TARGETS[target]
    return card_bandwidth(fmt, card.capability, card.sms, card.ghz, card.memory_tb_s, rows)


def card_bandwidth(fmt: str, capability: int, sms: int, ghz: float, memory_tb_s: float, rows: int) -> float:
    """``packed_bandwidth`` for any card: the ceilings of the newest compiled target it can run (compute
    capability at or below its own: an A10G's 86 reads sm_80's), scaled by its SMs × clock (the ceiling is bytes
    per SM clock × SMs × clock), under its memory's bandwidth. ``bf16``: the memory's."""
    if fmt == "bf16":
        return memory_tb_s
    compiled = [name for name, t in TARGETS.items() if t.capability <= capability]
    if not compiled:
        raise ValueError(f"no compiled target at or below compute capability {capability}")
    name = max(compiled, key=lambda n: TARGETS[n].capability)
    tiers = PACKED_CEILINGS[name][fmt]
    ceiling = tiers[min((r for r in tiers if r >= rows), default=max(tiers))]
    return min(memory_tb_s, ceiling * sms * ghz / (TARGETS[name].sms * TARGETS[name].ghz))


def _shapes() -> dict[str, Any]:
    return {
        "attention": f"1 row: {TEXT_TOKENS} text tokens (256-token pages), a 4-tile picture ({IMAGE_TOKENS} states, "
        f"1,024-token pages); {HEADS} query heads over {KV_HEADS} key/value heads of {HEAD_DIM}, bf16",
        "packed": f"gate/up projection {2 * MLP} x {HIDDEN}, bf16 activations",
        "targets": {name: vars(t) for name, t in TARGETS.items()},
    }


def chosen(targets: str, kernels: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``--sass-targets`` and ``--sass-kernels`` (comma-separated; empty: all), checked."""

    def pick(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip()) or known
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"unknown {what} {', '.join(unknown)}: choose from {', '.join(known)}")
        return names

    return pick(targets, tuple(TARGETS), "target"), pick(kernels, KERNELS, "kernel")
