"""How many rows fit: the cache in bytes, the page pool it becomes, and the batch size that follows.

A row's cache has two parts. Its text keys/values grow with every token (Llama-3.2-11B-Vision,
bf16: 2 × 32 self-attention layers × 8 heads × 128 × 2 bytes = 128 KiB per token). Its picture's
cross-attention keys/values are fixed: 8 cross-attention layers × 1601 patches per tile it shows,
~52 MB a tile, ~210 MB for four, whatever the answer's length. Counting rows × tokens alone, as a
token budget does, misses the second part, which dominates short answers.

The plan is made where the model is loaded (the engine process) and published in
``Engine.stats()``: on CUDA the byte budget is the memory free after loading minus a reserve for
activations; the continuous engine allocates it once as its page pool (``pool_pages``), which also
keeps the image-state cache in pages rows do not need, and admits rows by the pages they really take.
The default batch size is the number of rows of ``max_new_tokens`` tokens with a one-tile picture that
budget holds (the most it can hold; four-tile pictures fill the pages sooner). On CPU there is no budget
and the batch size defaults to a small number. The same arithmetic runs before loading, on the bytes
each ``--quantize`` choice would leave free, counting four-tile rows (what one answer may need): ``auto``
picks by it (:func:`most_precise_that_fits`) and ``python -m vlm_demo.tools.fit`` prints it for any GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from vlm_demo.config import Config
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.kv.pages import CPU_PAGE_TOKENS, PageShape, kv_dtype_for
from vlm_demo.engine.weights.placement import LOAD_MARGIN
from vlm_demo.errors import ModelLoadError

log = logging.getLogger(__name__)

GiB = 1024**3
CPU_BATCH_SIZE = 8  # default on CPU: Python overhead, not memory, limits a CPU batch
MAX_AUTO_BATCH_SIZE = 256  # past this the host-side work per step (streaming 256 rows) dominates
PROMPT_TOKENS = 128  # a question and the chat template, for sizing rows
MIN_ROWS = 4  # fewer rows than this at full length: warn, the GPU is too small for serving
AUTO_ROWS, AUTO_TOKENS = 8, 1024  # --quantize auto: the most precise weights that leave room for this many rows


@dataclass(frozen=True)
class KVShape:
    """Bytes the cache holds per text token, per tile a picture shows, and for a four-tile picture."""

    bytes_per_token: int
    bytes_per_row: int  # a picture of every tile (the most one row's image states take)
    bytes_per_tile: int = 0

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> KVShape:
        """From the model's config, by the page pool's own geometry (:class:`~vlm_demo.engine.kv.pages.PageShape`;
        ``kv_dtype``: how the pool stores keys/values, fp8's scales counted)."""
        shape = PageShape.of(config, dtype, CPU_PAGE_TOKENS, kv_dtype)  # the page size does not change a token's bytes
        tile = shape.image_bytes_per_token * shape.patches
        return cls(shape.text_bytes_per_token, tile * shape.max_tiles, tile)

    def batch_bytes(self, rows: int, length: int, tiles: int | None = None) -> int:
        """``rows`` rows of ``length`` tokens each, with pictures of ``tiles`` tiles (default: every tile)."""
        image = self.bytes_per_row if tiles is None else tiles * self.bytes_per_tile
        return rows * (length * self.bytes_per_token + image)


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine may hold: ``kv_budget_bytes`` (0 = no limit) and ``max_batch_size``."""

    kv: KVShape
    max_batch_size: int
    kv_budget_bytes: int
    source: str  # where the numbers came from, for the log and stats
    row_tokens: int = PROMPT_TOKENS  # a full-length row's tokens (its prompt and --max-new-tokens)

    def pool_pages(self, shape: PageShape) -> int:
        """Pages of the continuous engine's pool (which also holds the image-state cache, in pages rows do
        not need): the budget, or with no budget (CPU) room for every row at full length with a four-tile
        picture, and a quarter more for Think harder's kept stage starts and the image-state cache."""
        if self.kv_budget_bytes > 0:
            return max(1, self.kv_budget_bytes // shape.page_bytes)
        row = shape.row_pages(self.row_tokens, shape.max_tiles)
        return self.max_batch_size * row + max(row, self.max_batch_size * row // 4)

    def stats(self) -> dict[str, Any]:
        return {
            "max_batch_size": self.max_batch_size,
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_bytes_per_token": self.kv.bytes_per_token,
            "kv_bytes_per_row": self.kv.bytes_per_row,
            "memory_plan": self.source,
        }


def activation_reserve(total: int) -> int:
    """GPU memory kept out of the KV budget: prefill activations (vision tower over a group of
    4-tile images), logits and sampling buffers, the decode step's CUDA graphs (one memory pool for every
    bucket: about the largest bucket's activations, ~0.3 GB at 256 rows of the 11B model; gpucheck measures
    it), allocator fragmentation."""
    return max(4 * GiB, total // 20)


def read_by_decode(name: str) -> bool:
    """Whether a decode step reads the parameter called ``name``: the text decoder and the LM head do; the
    vision tower and its projector (they run at prefill), the input embedding table (one row per token) and
    the cross-attention key/value projections and their norm (the image's keys and values are cached) do not."""
    if "vision_model." in name or "multi_modal_projector" in name or "embed_tokens" in name:
        return False
    return not (".cross_attn." in name and any(part in name for part in (".k_proj.", ".v_proj.", ".k_norm.")))


def row_bytes(kv: KVShape, new_tokens: int) -> int:
    """One row's cache at its longest: a prompt and ``new_tokens`` answer tokens and a four-tile picture."""
    return kv.batch_bytes(1, new_tokens + PROMPT_TOKENS)


def rows_that_fit(kv: KVShape, free: int, total: int, new_tokens: int) -> int:
    """Rows of ``new_tokens`` tokens the cache budget holds when ``free`` bytes of a ``total``-byte GPU are
    free after loading (the working reserve kept out), uncapped; 0 when not even one."""
    return max(0, (free - activation_reserve(total)) // row_bytes(kv, new_tokens))


def most_precise_that_fits(weights: dict[str, int], kv: KVShape, free: int, total: int) -> tuple[str, int]:
    """``--quantize auto``: of ``weights`` (each choice's weight bytes, most precise first), the first that
    loads into ``free`` bytes and then leaves room for ``AUTO_ROWS`` rows of ``AUTO_TOKENS`` tokens; when
    none does, the one that leaves the most rows. Returns the choice and its rows (0: nothing fits)."""
    rows = {
        kind: rows_that_fit(kv, free - size, total, AUTO_TOKENS) if size + LOAD_MARGIN <= free else 0
        for kind, size in weights.items()
    }
    enough = [kind for kind in weights if rows[kind] >= AUTO_ROWS]
    best = enough[0] if enough else max(rows, key=lambda kind: rows[kind])
    return best, rows[best]


def _budget(kv: KVShape, config: Config, cuda: bool, free: int, total: int) -> tuple[int, str]:
    """The KV budget in bytes and where it came from: ``--kv-budget-gb``, else what the GPU has free after
    loading beside its working memory (an error when not even one answer fits), else none (the CPU)."""
    if config.kv_budget_gb > 0:
        return int(config.kv_budget_gb * GiB), "--kv-budget-gb"
    if not cuda:
        return 0, "CPU: no budget"
    reserve = activation_reserve(total)
    if rows_that_fit(kv, free, total, config.max_new_tokens) < 1:
        one_row = row_bytes(kv, config.max_new_tokens)
        raise ModelLoadError(
            f"After loading, the GPU has {free / GiB:.1f} GiB free, not enough for even one answer of "
            f"{config.max_new_tokens} tokens ({one_row / GiB:.2f} GiB of cache) next to "
            f"{reserve / GiB:.1f} GiB of working memory: use a bigger GPU, fewer bits per "
            f"weight (--quantize int8 or int4; python -m vlm_demo.tools.fit says what fits), or a lower "
            f"--max-new-tokens."
        )
    return free - reserve, f"{free / GiB:.1f} GiB free on the GPU after loading, {reserve / GiB:.1f} GiB reserved"


def plan(
    kv: KVShape,
    config: Config,
    cuda: bool,
    free: int = 0,
    total: int = 0,
    working_per_row: int = 0,
) -> MemoryPlan:
    """The plan for a model whose cache has shape ``kv``: from ``config`` where it says, else from
    ``free`` GPU memory (bytes, measured after loading) on CUDA, else CPU defaults. ``working_per_row``: what
    the decode attention takes per row beyond the activations (the reference's gathers), reserved on CUDA
    for every row the plan admits."""
    row_tokens = config.max_new_tokens + PROMPT_TOKENS
    one_row = row_bytes(kv, config.max_new_tokens)  # a four-tile picture: the most one answer can need
    small_row = kv.batch_bytes(1, row_tokens, tiles=1) if kv.bytes_per_tile else one_row
    budget, source = _budget(kv, config, cuda, free, total)
    if config.max_batch_size > 0:
        rows = config.max_batch_size
        if budget and rows * one_row > budget:
            log.warning(
                "--max-batch-size %d: only %d rows of %d tokens fit in the %.1f GiB KV budget; continuous mode "
                "admits by the budget, dynamic batches of long answers may run out of memory and be split",
                rows,
                budget // one_row,
                row_tokens,
                budget / GiB,
            )
    elif budget > 0:
        rows = max(1, min(MAX_AUTO_BATCH_SIZE, budget // small_row))
        source += (
            f"; {budget // small_row} rows of {row_tokens} tokens fit with one-tile pictures, "
            f"{budget // one_row} with four"
        )
    else:
        rows = CPU_BATCH_SIZE
    if cuda and working_per_row and config.kv_budget_gb <= 0:
        if config.max_batch_size <= 0:  # the rows that fit with their working memory beside their cache
            rows = max(1, min(MAX_AUTO_BATCH_SIZE, budget // (small_row + working_per_row)))
        budget -= rows * working_per_row
        source += f"; {rows * working_per_row / GiB:.1f} GiB kept for the decode attention's gathers ({rows} rows)"
        if budget < one_row:
            raise ModelLoadError(
                f"After loading and the decode attention's working memory ({rows * working_per_row / GiB:.1f} GiB "
                f"at {rows} rows), the GPU has no room for even one answer of {config.max_new_tokens} tokens: "
                f"use a faster decode attention (--decode-attention auto), a lower --max-batch-size or fewer bits "
                f"per weight."
            )
    if cuda and budget and budget // one_row < MIN_ROWS:
        log.warning(
            "only %d rows of %d tokens fit in %.1f GiB: this GPU is too small to serve a batch usefully",
            budget // one_row,
            row_tokens,
            budget / GiB,
        )
    return MemoryPlan(kv, rows, budget, source, row_tokens)


def plan_for(worker: Worker, config: Config, working_per_row: int = 0) -> MemoryPlan:
    """The plan for a loaded worker (the engine process calls this once, after loading)."""
    paged = config.batching == "continuous"  # the dynamic engine keeps the stock cache, in the model's dtype
    kv_dtype = kv_dtype_for(config.kv_cache_dtype, worker.dtype) if paged else None
    kv = KVShape.of(worker.model.config, worker.dtype, kv_dtype)
    device = torch.device(worker.device)
    if device.type != "cuda":
        return plan(kv, config, cuda=False)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    # Blocks PyTorch's allocator holds but no tensor uses (an earlier engine's cache) are ours too.
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    memory = plan(kv, config, cuda=True, free=free, total=total, working_per_row=working_per_row)
    log.info(
        "memory plan: %s -> %d rows, KV budget %.1f GiB",
        memory.source,
        memory.max_batch_size,
        memory.kv_budget_bytes / GiB,
    )
    return memory
