"""How many kernels one decode step launches: ``python -m vlm_demo.tools.bench --count-kernels``.

On a GPU every operation of a decode step is a kernel launched from Python (5–10 µs of host time each),
so at small batch sizes their number, not the arithmetic, sets the speed. This counts them at the real
11B structure — 40 text layers, cross-attention at 3, 8, …, 38, 32 query and 8 key/value heads — at
narrow widths (head dim 8, random weights; the number of operations does not depend on the widths):

- ``by_decode_attention``: the engine's decode step with each decode-attention kernel — ``flash``
  (FlashAttention's paged call) and ``triton`` (our Triton kernel, its custom operators) as they run on CUDA,
  the real step code dispatched on shape-only (``meta``) tensors since neither runs on a CPU; ``reference``
  as it runs on a CPU. A kernel this torch cannot run is ``null``, and ``unavailable`` says why (torch 2.11 has
  no paged flash call);
- ``kernels_per_decode_step``: the step with the kernel ``auto`` takes on CUDA with this torch
  (``decode_attention`` names it): flash where its call exists, else triton;
- ``cpu``: the step as it runs on a CPU, with the reference attention (its torch operations): a step
  like the one before it, and ``after_rows_change`` the first step after rows joined or left, where the
  reference gathers its lines from the pool again;
- ``stock_forward``: the text model's own forward with a ``DynamicCache`` (what ``generate`` runs), for
  comparison;
- ``--quantize fp8|int8|int4``: all of the above with the language model's projections in that format (packed,
  :mod:`~vlm_demo.engine.weights.packed`), and beside them ``unquantized`` (the same counts in the model dtype) and
  ``kernels_over_unquantized``;
- ``weight_bytes_read_per_step``: the bytes the step's linear layers read from their weights, counted — every
  kernel's tensor arguments that are (views of) those weights, by their bytes as passed, and tensors computed
  from the weights alone, such as a per-call widened copy, as weights too — against ``weight_bytes``, those
  weights' own bytes as stored (values and scales). The linear weights are those a decode step multiplies
  by: the text decoder's projections but the cross-attention keys/values (cached at prefill), and the LM head.
  Counted on ``meta`` at the 11B model's real shapes in bf16 (``weights_counted_on``), with the kernel ``auto``
  takes on CUDA.
- ``attention_bytes_per_step``: the bytes of keys/values and picture states one decode step's attention reads, as
  the engine counts them from the layout its Triton kernel builds (``vlm_attention_read_bytes_total`` adds up the
  same), at the 11B shapes on the GPU's pages: 1, 32 and 128 rows of 600 text tokens with 4-tile pictures, every
  row its own picture (``distinct``) or all of them one (``shared``: the page table holds it once and the kernel
  reads it once per picture row of up to 8 rows), with the cache in bf16 and in fp8 (its scales counted).

Counted at the dispatcher (a ``TorchDispatchMode``): *kernels* are operations that produce a new tensor —
views and in-place operations (whose outputs alias an input) are not counted, as in the measurement this
replaces (so neither is an operation that may return its input, ``to``, when it casts: the step's one, its
positions to float, is not counted; its weight reads are); *aten_ops* are all operations; *in_place* (cache
writes, accumulations) are listed apart.
Sampling (two or three operations) is not part of the step.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REAL_CROSS_LAYERS = (3, 8, 13, 18, 23, 28, 33, 38)
ROWS = (1, 8)
ATTENTION_ROWS = (1, 32, 128)
TEXT_TOKENS = 600  # a question, the template and a long answer so far


@dataclass
class Counts:
    kernels: int = 0
    in_place: int = 0
    aten_ops: int = 0
    weight_bytes_read: int = 0  # bytes of the watched weights (and tensors made from them alone) kernels took
    by_op: collections.Counter = field(default_factory=collections.Counter)


def _storage(tensor: torch.Tensor) -> int:
    """Which memory a tensor (or a view of it) lives in; works on ``meta`` too."""
    return tensor.untyped_storage()._cdata


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _copied(args: tuple, kwargs: dict | None, out: Any) -> bool:
    """Whether an operation's outputs live in memory none of its inputs do."""
    inputs = {_storage(t) for t in _tensors((args, kwargs))}
    outputs = _tensors(out)
    return bool(outputs) and all(_storage(t) not in inputs for t in outputs)


class Counter(TorchDispatchMode):
    """Counts the operations dispatched while it is active, and the bytes of ``weights`` their kernels read."""

    def __init__(self, weights: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.counts = Counts()
        self.weights = {_storage(w) for w in weights}
        self._made: list[torch.Tensor] = []  # tensors made from weights alone, kept so their memory is not reused

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        counts = self.counts
        counts.aten_ops += 1
        aliasing = [r.alias_info for r in func._schema.returns if r.alias_info is not None]
        if not aliasing:
            counts.kernels += 1
            counts.by_op[str(func.overloadpacket.__name__)] += 1
            self._read(args, kwargs, out)
        elif any(a.is_write for a in aliasing):
            counts.in_place += 1
        elif _copied(args, kwargs, out):  # may return its input (``to``) but made a new tensor: a cast reads too
            self._read(args, kwargs, out)
        return out

    def _read(self, args: tuple, kwargs: dict | None, out: Any) -> None:
        """A kernel's reads of weights; its outputs count as weights when weights were all it read."""
        if not self.weights:
            return
        inputs = _tensors((args, kwargs))
        read = [t for t in inputs if _storage(t) in self.weights]
        self.counts.weight_bytes_read += sum(t.numel() * t.element_size() for t in read)
        if read and len(read) == len(inputs):
            made = _tensors(out)
            self.weights |= {_storage(t) for t in made}
            self._made += made


def count(run: Any, weights: Iterable[torch.Tensor] = ()) -> Counts:
    with torch.inference_mode(), Counter(weights) as counter:
        run()
    return counter.counts


def step_weights(model: Any) -> list[torch.Tensor]:
    """The weights of the linear layers a decode step multiplies by (their values and scales): the text decoder's
    projections but those :func:`~vlm_demo.engine.kv.memory.read_by_decode` leaves out, and the LM head."""
    from vlm_demo.engine.kv.memory import read_by_decode
    from vlm_demo.engine.weights.packed import PackedLinear

    found: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, PackedLinear)) and read_by_decode(f"{name}.weight"):
            if name.startswith("model.language_model.") or name == "lm_head":
                found += [p for p in module.parameters(recurse=False)]
    return found


def narrow_model(device: str, quantize: str = "none") -> Any:
    """The real depth and heads at narrow widths, in float32, its language model's projections in ``quantize``."""
    from vlm_demo.engine.weights.quantize import quantize_model
    from vlm_demo.models import realshape

    config = realshape.narrow_config(hidden=256, layers=40, cross_layers=REAL_CROSS_LAYERS)
    return quantize_model(realshape.build_model(config, torch.float32, device, attn_implementation="sdpa"), quantize)


def full_shape_model(quantize: str = "none") -> Any:
    """The 11B model's real shapes in bf16 on ``meta`` (nothing allocated), in ``quantize``: for bytes."""
    from vlm_demo.engine.weights.quantize import quantize_model
    from vlm_demo.models import realshape

    model = realshape.build_model(realshape.full_config(), torch.bfloat16, "meta", attn_implementation="sdpa")
    return quantize_model(model, quantize)


def synthetic_rows(decoder: Any, rows: int, device: torch.device, length: int = 5, dtype: Any = torch.float32,
                   tiles: int = 1) -> Any:  # fmt: skip
    """``rows`` running rows over the decoder's pool, each ``length`` tokens in and a picture of ``tiles`` tiles
    (whatever the pages hold: for counting and timing steps, not for answers)."""
    from vlm_demo.engine.batching.job import Request
    from vlm_demo.engine.batching.rows import Row, RunningRows
    from vlm_demo.request import SamplingParams

    running = RunningRows(decoder.pool, decoder.attention, device, dtype)
    places = running.table.allocate([length + 1] * rows, [tiles] * rows, [True] * rows)  # room for the next token
    assert places is not None, "the pool is too small for these rows"
    for place in places:
        place.length = length
        request = Request(image=None, question="", params=SamplingParams(8, 0.0).validated(8))
        running.rows.append(Row(request, None, place=place))  # type: ignore[arg-type]
    running.next_tokens = torch.zeros(rows, dtype=torch.long, device=device)
    return running


def engine_step(model: Any, rows: int, kernel: str, after_a_change: bool = False) -> Counts:
    """One decode step of ``rows`` rows as the engine runs it (``kernel``: the decode attention's): a step like
    the one before it, or with ``after_a_change`` the first after rows joined or left (where the CPU's reference
    attention gathers its lines from the pool again)."""
    from vlm_demo.engine.executor.attention import KERNELS
    from vlm_demo.engine.executor.decode_step import TextDecodeStep, layer_devices

    device = next(iter(layer_devices(model).values()))
    dtype = model.lm_head.weight.dtype
    # the kernel itself, not a --decode-attention choice: on meta the fast kernels run shapes only (no probe)
    decoder = TextDecodeStep.over_pool(model, dtype, 8 + rows * 80, kernel=KERNELS[kernel])
    running = synthetic_rows(decoder, rows, device, dtype=dtype)
    with torch.inference_mode():
        inputs = running.step_inputs()
        if not after_a_change:
            decoder(inputs)
    return count(lambda: decoder(inputs), step_weights(model))  # after the step merged its weights


def stock_step(model: Any, rows: int) -> Counts:
    """One decode step of the text model's own forward with a ``DynamicCache`` of 5 tokens and one tile."""
    from transformers.cache_utils import DynamicCache

    text = model.model.language_model
    config = text.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    vision = model.config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2 + 1
    layers = []
    for index in range(config.num_hidden_layers):
        length = patches if index in config.cross_attention_layers else 5
        layers.append((torch.randn(rows, heads, length, dim), torch.randn(rows, heads, length, dim)))
    cache = DynamicCache(ddp_cache_data=layers)
    inputs = torch.zeros(rows, 1, dtype=torch.long)
    positions = torch.full((rows, 1), 5)
    cross = torch.zeros(rows, 1, 1, patches)
    row_mask = torch.ones(rows, 1, 1, 1)

    def run() -> None:
        hidden = text(input_ids=inputs, position_ids=positions, cross_attention_mask=cross,
                      full_text_row_masked_out_mask=row_mask, cache=cache, use_cache=True).last_hidden_state  # fmt: skip
        model.lm_head(hidden[:, -1]).float()

    return count(run)


def figures(counts: dict[int, Counts]) -> dict[str, Any]:
    return {
        "kernels_per_decode_step": {str(n): c.kernels for n, c in counts.items()},
        "aten_ops_per_decode_step": {str(n): c.aten_ops for n, c in counts.items()},
        "in_place_per_decode_step": {str(n): c.in_place for n, c in counts.items()},
    }


def kernel_counts(quantize: str = "none") -> dict[str, Any]:
    """The step's operations with the language model's projections in ``quantize``: on CUDA with each decode
    attention (shapes only), on the CPU, and the stock forward's."""
    from vlm_demo.engine.executor.attention.flash import paged_call_missing

    cpu_model = narrow_model("cpu", quantize)
    meta_model = narrow_model("meta", quantize)
    missing = paged_call_missing()
    unavailable = {"flash": missing} if missing else {}
    by_kernel: dict[str, dict[int, Counts] | None] = {
        "flash": None if "flash" in unavailable else {n: engine_step(meta_model, n, "flash") for n in ROWS},
        "triton": {n: engine_step(meta_model, n, "triton") for n in ROWS},
    }
    auto = "flash" if by_kernel["flash"] is not None else "triton"
    cuda = by_kernel[auto]
    assert cuda is not None
    cpu = {n: engine_step(cpu_model, n, "reference") for n in ROWS}
    by_kernel["reference"] = cpu
    cpu_changed = {n: engine_step(cpu_model, n, "reference", after_a_change=True) for n in ROWS}
    stock = {n: stock_step(narrow_model("cpu", quantize), n) for n in ROWS}
    return {
        **figures(cuda),
        "decode_attention": auto,
        "by_decode_attention": {
            name: None if counts is None else {str(n): c.kernels for n, c in counts.items()}
            for name, counts in by_kernel.items()
        },
        "unavailable": unavailable,
        "torch": torch.__version__,
        "counted_on": "meta (the CUDA step's operations, shapes only); reference: cpu",
        "by_op": dict(cuda[ROWS[0]].by_op.most_common()),
        "cpu": {
            **figures(cpu),
            "decode_attention": "reference",
            "by_op": dict(cpu[ROWS[0]].by_op.most_common()),
            "after_rows_change": figures(cpu_changed),
        },
        "stock_forward": figures(stock),
        "structure": {"text_layers": 40, "cross_attention_layers": list(REAL_CROSS_LAYERS), "heads": 32, "kv_heads": 8},
    }


def weight_figures(quantize: str, kernel: str) -> dict[str, Any]:
    """What the step's linear layers read from their weights at 1 and 8 rows, and those weights' bytes, at the
    11B model's shapes in bf16 with ``quantize``'s weights and decode attention ``kernel``."""
    from vlm_demo.engine.weights.quantize import stored_bytes

    model = full_shape_model(quantize)
    counts = {n: engine_step(model, n, kernel) for n in ROWS}
    return {
        "weight_bytes_read_per_step": {str(n): c.weight_bytes_read for n, c in counts.items()},
        "weight_bytes": sum(stored_bytes(w) for w in step_weights(model)),
    }


def attention_read(rows: int, shared: bool, kv_cache_dtype: str) -> int:
    """Bytes one decode step's attention reads at ``rows`` rows of ``TEXT_TOKENS`` tokens and 4-tile pictures (one
    each, or one for all), as the engine counts them from the Triton kernel's layout at the 11B shapes."""
    from vlm_demo.engine.executor.attention.base import VERSIONS, StepRows
    from vlm_demo.engine.executor.attention.tiled import TritonAttention
    from vlm_demo.engine.executor.staging import Staging
    from vlm_demo.engine.kv.page_table import PageTable
    from vlm_demo.engine.kv.pages import CUDA_PAGE_TOKENS, PagePool, PageShape
    from vlm_demo.models import realshape

    meta = torch.device("meta")
    config = realshape.full_config()
    kv_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else None
    shape = PageShape.of(config, torch.bfloat16, CUDA_PAGE_TOKENS, kv_dtype=kv_dtype)
    tiles = shape.max_tiles
    pages = rows * shape.row_pages(TEXT_TOKENS + 1, tiles) + 8
    pool = PagePool(shape, pages, dict.fromkeys(range(config.get_text_config().num_hidden_layers), meta))
    table = PageTable(pool)
    pictures = [("one" if shared else f"picture {r}", tiles, tuple(range(tiles))) for r in range(rows)]
    places = table.allocate([TEXT_TOKENS + 1] * rows, [tiles] * rows, [True] * rows, pictures)
    assert places is not None
    for place in places:
        place.length = TEXT_TOKENS
    attention = TritonAttention(pool, config.get_text_config().num_attention_heads, shape.head_dim**-0.5)
    lengths = np.full(rows, TEXT_TOKENS, dtype=np.int64)
    _, layout = attention.prepare(StepRows(places, rows, lengths, next(VERSIONS), Staging(meta)), [])
    text, image = layout.read
    return text * shape.text_bytes_per_token + image * shape.image_bytes_per_token


@functools.cache  # the same figures for every --quantize (the tests ask for three reports in one process)
def attention_figures() -> dict[str, Any]:
    """``attention_bytes_per_step``: bf16 and fp8 caches, distinct and shared pictures, at 1, 32 and 128 rows."""
    return {
        label: {
            sharing: {str(n): attention_read(n, sharing == "shared", kv) for n in ATTENTION_ROWS}
            for sharing in ("distinct", "shared")
        }
        for label, kv in (("bf16", "auto"), ("fp8", "fp8"))
    }


def report(quantize: str = "none") -> dict[str, Any]:
    """The counts as ``bench --count-kernels [--quantize KIND]`` prints them (JSON)."""
    counted = kernel_counts(quantize)
    auto = counted["decode_attention"]
    weights = weight_figures(quantize, auto)
    out = {
        "quantize": quantize,
        "kernels_per_decode_step": counted.pop("kernels_per_decode_step"),
        **weights,
        "weights_counted_on": "meta, the 11B model's shapes in bf16: its text decoder's projections but the "
        "cross-attention keys/values, and the LM head",
        **counted,
        "attention_bytes_per_step": attention_figures(),
        "attention_bytes_counted_on": f"the engine's Triton layout at the 11B shapes on the GPU's pages: rows of "
        f"{TEXT_TOKENS} text tokens, 4-tile pictures; shared: every row shows one picture",
    }
    if quantize != "none":
        meta_model = narrow_model("meta")
        plain = {str(n): engine_step(meta_model, n, auto).kernels for n in ROWS}
        out["unquantized"] = {"kernels_per_decode_step": plain, **weight_figures("none", auto)}
        out["kernels_over_unquantized"] = {n: round(out["kernels_per_decode_step"][n] / plain[n], 3) for n in plain}
    return out
