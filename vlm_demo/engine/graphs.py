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
buffers hold, and the reference attention (its gather plan is ragged) run eagerly.

The CPU runs the same static-buffer step eagerly — only capture and replay are CUDA's — so the tests cover
the code the GPU runs.
"""

from __future__ import annotations

import logging
import time

import torch

from vlm_demo.config import Config
from vlm_demo.engine.attention import Layout
from vlm_demo.engine.decode_step import TextDecodeStep
from vlm_demo.engine.rows import StepInputs
from vlm_demo.errors import ModelLoadError

log = logging.getLogger(__name__)


GRAPH_PROMPT_TOKENS = 2048  # a row's prompt (a conversation's earlier turns included) a graph's tables hold


def decode_graphs(step: TextDecodeStep, max_rows: int, config: Config, worker: object) -> DecodeGraphs:
    """The continuous engine's decode path, with its graphs captured when ``--cuda-graphs`` says so (auto: on
    with CUDA and the fast attention kernel, the model on one device)."""
    shape = step.attention.shape
    device, dtype = worker.device, worker.dtype  # type: ignore[attr-defined]
    text_width = shape.text_pages(config.max_new_tokens + GRAPH_PROMPT_TOKENS)
    image_width = shape.image_pages(shape.max_tiles * shape.patches)
    graphs = DecodeGraphs(step, max_rows, text_width, image_width, device, dtype)
    single = len({str(layer.device) for layer in step.layers}) == 1
    able = torch.device(device).type == "cuda" and step.attention.kernel == "flash" and single
    if config.cuda_graphs == "on" and not able:
        raise ModelLoadError(
            f"--cuda-graphs on needs CUDA, FlashAttention's paged kernel and the text model on one device; this "
            f"engine runs on {device} with the {step.attention.kernel} attention: use --cuda-graphs auto or off."
        )
    if config.cuda_graphs != "off" and able:
        graphs.capture()
    return graphs


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

    def __init__(self, rows: int, text_width: int, image_width: int, device: torch.device, dtype: torch.dtype) -> None:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        self.rows, self.text_width, self.image_width = rows, text_width, image_width
        self.input_ids, self.positions, self.write_pages, self.write_offsets = (longs(rows) for _ in range(4))
        self.row_mask = torch.zeros(rows, dtype=dtype, device=device)
        self.text_table, self.text_lengths = ints(rows, text_width), ints(rows)
        self.image_table, self.image_lengths = ints(rows, image_width), ints(rows)
        self.query_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)

    def fits(self, inputs: StepInputs) -> bool:
        layout = inputs.layout
        if layout.rows > self.rows:
            return False
        return layout.text_table is None or (
            layout.text_table.shape[1] <= self.text_width and layout.image_table.shape[1] <= self.image_width  # type: ignore[union-attr]
        )

    def view(self, rows: int, page_tokens: int, image_page_tokens: int, like: Layout | None = None) -> StepInputs:
        """The first ``rows`` rows of every buffer, as the step's inputs: the fast kernel's tables from the buffers;
        the reference attention's ragged plan, which no graph takes, passed through from ``like``."""
        if like is not None and like.text_table is None:
            layout = like
        else:
            layout = Layout(
                rows,
                max_text=self.text_width * page_tokens,
                max_image=self.image_width * image_page_tokens,
                text_table=self.text_table[:rows],
                text_lengths=self.text_lengths[:rows],
                image_table=self.image_table[:rows],
                image_lengths=self.image_lengths[:rows],
                query_starts=self.query_starts[: rows + 1],
            )
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
        if layout.text_table is None:
            return
        self.text_table[:n, : layout.text_table.shape[1]].copy_(layout.text_table, non_blocking=True)
        self.text_lengths[:n].copy_(layout.text_lengths, non_blocking=True)
        self.image_table[:n, : layout.image_table.shape[1]].copy_(layout.image_table, non_blocking=True)  # type: ignore[union-attr]
        self.image_lengths[:n].copy_(layout.image_lengths, non_blocking=True)  # type: ignore[arg-type]


class DecodeGraphs:
    """The decode step through static buffers: replayed from a captured graph per bucket on CUDA, run eagerly
    elsewhere (and for whatever no graph takes)."""

    def __init__(self, step: TextDecodeStep, max_rows: int, text_width: int, image_width: int,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        self.step = step
        self.shape = step.attention.shape
        self.sizes = buckets(max_rows)
        self.static = StaticInputs(max_rows, text_width, image_width, device, dtype)
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
        return self.step(self.static.view(rows, self.shape.page_tokens, self.shape.image_page_tokens, inputs.layout))

    def capture(self) -> None:
        """Record one graph per bucket, largest first, in one memory pool, after a warm-up each (CUDA, with the
        fast attention kernel: the inputs are the null pages', so the pool's contents are not touched)."""
        device = self.static.input_ids.device
        torch.cuda.synchronize(device)
        start, before = time.perf_counter(), torch.cuda.memory_allocated(device)
        pool = torch.cuda.graph_pool_handle()
        null = self.step.pool.null_pages()
        self.static.write_pages.fill_(null[0])
        self.static.text_table.fill_(null[0])
        self.static.image_table[:, : len(null) - 1].copy_(torch.tensor(null[1:], dtype=torch.int32))
        self.static.text_lengths.fill_(1)
        self.static.image_lengths.fill_(1)
        side = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            inputs = self.static.view(size, self.shape.page_tokens, self.shape.image_page_tokens)
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
