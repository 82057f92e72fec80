"""CUDA graphs for the decode step: on a GPU, one launch per step instead of one per kernel.

Even at half the stock kernels, a decode step is a few hundred kernel launches from Python, 5–10 µs of host
time each: at small batches the GPU would wait for Python. A CUDA graph records one step's kernels once and
replays them with one launch. Graphs replay fixed shapes and fixed addresses, so (as nano-vllm does):

- the step reads its inputs from **static buffers** sized for the most rows and the widest page tables
  (``StaticInputs``); each step copies its inputs in, and nothing a kernel takes is a Python number that
  changes from step to step (the gates and the tables' widths are constants);
- rows come in **buckets** (1, 2, 4, 8, then every 16): a step of 11 rows replays the 16-row graph, the five
  extra rows *inert* — they write into and read from the pool's null pages, and their logits are dropped
  (``RunningRows.step_inputs(pad_to=...)``);
- graphs are captured at start, largest bucket first, after a warm-up, in one shared memory pool.

Sampling stays outside the graph: which rows sample, and with what temperature and seed, changes as rows
join and leave (a few kernels on the logits). Prefill, a step with more rows or longer page tables than the
buffers hold, and the reference attention (its gather plan is ragged) run eagerly. Both block-table kernels
(``flash`` and ``triton``) are captured: the Triton kernel is compiled by the warm-up before its capture.

The CPU runs the same static-buffer step eagerly — only capture and replay are CUDA's — so the tests cover
the code the GPU runs.
"""

from __future__ import annotations

import logging
import time
from typing import cast

import torch

from vlm_demo.config import Config
from vlm_demo.engine.batching.rows import StepInputs
from vlm_demo.engine.executor.attention.tables import TableAttention, Tables
from vlm_demo.engine.executor.decode_step import TextDecodeStep
from vlm_demo.errors import ModelLoadError

log = logging.getLogger(__name__)


GRAPH_PROMPT_TOKENS = 2048  # a row's prompt (a conversation's earlier turns included) a graph's tables hold


def decode_graphs(step: TextDecodeStep, max_rows: int, config: Config, worker: object) -> DecodeGraphs:
    """The continuous engine's decode path, with its graphs captured when ``--cuda-graphs`` says so (auto: on
    with CUDA and a block-table attention kernel, flash or triton, the model on one device); the log says why
    when they are not."""
    shape = step.attention.shape
    device, dtype = worker.device, worker.dtype  # type: ignore[attr-defined]
    text_width = shape.text_pages(config.max_new_tokens + GRAPH_PROMPT_TOKENS)
    image_width = shape.image_pages(shape.max_tiles * shape.patches)
    graphs = DecodeGraphs(step, max_rows, text_width, image_width, device, dtype)
    why = graphs_missing(step, device)
    if config.cuda_graphs == "on" and why:
        raise ModelLoadError(f"--cuda-graphs on {why}: use --cuda-graphs auto or off.")
    if config.cuda_graphs == "off":
        log.info("decode step: no CUDA graphs (--cuda-graphs off)")
    elif why:
        log.info("decode step: no CUDA graphs: replaying it %s", why)
    else:
        graphs.capture()
    return graphs


def graphs_missing(step: TextDecodeStep, device: torch.device | str) -> str:
    """What replaying the decode step from CUDA graphs needs that this engine lacks (empty: nothing)."""
    if torch.device(device).type != "cuda":
        return f"needs CUDA (this engine runs on {torch.device(device).type})"
    if not step.attention.graphable:
        return f"needs a block-table decode attention, flash or triton (this engine runs the {step.attention.kernel})"
    if len({str(layer.device) for layer in step.layers}) != 1:
        return "needs the text model on one device (it is spread over several)"
    return ""


def buckets(max_rows: int) -> list[int]:
    """The row counts graphs are captured for: 1, 2, 4, 8, then every 16 up to ``max_rows`` (and it)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(16, max_rows, 16)) + [max_rows]
    return sorted(set(sizes))


def bucket_for(rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``rows`` (``None``: more rows than the largest)."""
    return next((b for b in sizes if b >= rows), None)


class StaticInputs:
    """A step's input tensors in buffers that never move: the largest shape of each, allocated once; a step's
    inputs are copied into the front of each."""

    def __init__(self, rows: int, tables: Tables | None, device: torch.device, dtype: torch.dtype) -> None:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.rows = rows
        self.input_ids, self.positions, self.write_pages, self.write_offsets = (longs(rows) for _ in range(4))
        self.row_mask = torch.zeros(rows, dtype=dtype, device=device)
        self.tables = tables  # the attention's block tables (None: a kernel with ragged inputs, passed through)

    def fits(self, inputs: StepInputs) -> bool:
        layout = inputs.layout
        if layout.rows > self.rows:
            return False
        return self.tables is None or self.tables.fits(cast(Tables, layout))  # tables: a kernel with Tables layouts

    def view(self, rows: int, like: StepInputs | None = None) -> StepInputs:
        """The first ``rows`` rows of every buffer, as the step's inputs: the block tables from the buffers (with
        ``like``'s bounds when it runs eagerly); another kernel's ragged inputs, which no graph takes, passed
        through from ``like``."""
        if self.tables is None:
            assert like is not None, "a kernel with ragged inputs is never captured"
            layout = like.layout
        else:
            layout = self.tables.view(rows, cast(Tables, like.layout) if like is not None else None)
        return StepInputs(
            self.input_ids[:rows],
            self.positions[:rows],
            self.write_pages[:rows],
            self.write_offsets[:rows],
            self.row_mask[:rows],
            layout,
        )

    def load(self, inputs: StepInputs) -> None:
        """Copy a step's inputs in (tables into their left columns: columns past a row's pages are never read)."""
        n, layout = inputs.layout.rows, inputs.layout
        for name in ("input_ids", "positions", "write_pages", "write_offsets", "row_mask"):
            getattr(self, name)[:n].copy_(getattr(inputs, name), non_blocking=True)
        if self.tables is not None:
            self.tables.load(cast(Tables, layout))


class DecodeGraphs:
    """The decode step through static buffers: replayed from a captured graph per bucket on CUDA, run eagerly
    elsewhere (and for whatever no graph takes)."""

    def __init__(self, step: TextDecodeStep, max_rows: int, text_width: int, image_width: int,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        self.step = step
        self.shape = step.attention.shape
        self.sizes = buckets(max_rows)
        attention = step.attention
        tables = (
            attention.static(max_rows, text_width, image_width, device)
            if isinstance(attention, TableAttention)
            else None
        )
        self.static = StaticInputs(max_rows, tables, device, dtype)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0
        self.replays = 0
        self.eager_steps = 0

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def pad_to(self, rows: int) -> int | None:
        """The rows a step of ``rows`` rows runs as (its bucket), when graphs are captured; else ``None``."""
        return bucket_for(rows, self.sizes) if self.graphs else None

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        """``[rows, vocab]`` logits (padded rows included: the caller keeps its own)."""
        rows = inputs.layout.rows
        if not self.static.fits(inputs):
            self.eager_steps += 1
            return self.step(inputs)
        self.static.load(inputs)
        captured = self.graphs.get(rows)
        if captured is not None:
            graph, logits = captured
            graph.replay()
            self.replays += 1
            return logits
        self.eager_steps += 1
        return self.step(self.static.view(rows, inputs))

    def capture(self) -> None:
        """Record one graph per bucket, largest first, in one memory pool, after a warm-up each (CUDA, with a
        block-table attention kernel: the inputs are the null pages', so the pool's contents are not touched)."""
        device = self.static.input_ids.device
        torch.cuda.synchronize(device)
        start, before = time.perf_counter(), torch.cuda.memory_allocated(device)
        pool = torch.cuda.graph_pool_handle()
        null = self.step.pool.null_pages()
        self.static.write_pages.fill_(null[0])
        assert self.static.tables is not None
        self.static.tables.point_at(null)
        side = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            inputs = self.static.view(size)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(2):
                    self.step(inputs)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                logits = self.step(inputs)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_allocated(device) - before
        log.info("captured %d decode graphs (1 to %d rows) in %.1f s, %.0f MiB", len(self.graphs), self.sizes[-1],
                 self.capture_s, self.pool_bytes / 2**20)  # fmt: skip
