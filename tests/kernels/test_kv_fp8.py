"""``--kv-cache-dtype fp8``: the page pool stores keys/values as float8 e4m3 with one float32 scale per token per KV
head; the reference and the (interpreted) Triton kernel read them widened; the engine answers on the tiny model;
the flag, its variable and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import door, four_stages
from test_triton_attention import JOBS, SMALL_SPLITS

from vlm_demo.config import load_config
from vlm_demo.engine.executor.attention import VERSIONS, StepRows, decide, probe
from vlm_demo.engine.executor.attention.flash import flash_missing
from vlm_demo.engine.executor.attention.probe import _Place, fill
from vlm_demo.engine.executor.attention.reference import ReferenceAttention
from vlm_demo.engine.executor.attention.tiled import TritonAttention
from vlm_demo.engine.kv.memory import KVShape
from vlm_demo.engine.kv.pages import FP8, PagePool, PageShape, dequantize, kv_dtype_for
from vlm_demo.errors import ModelLoadError
from vlm_demo.models import realshape
from vlm_demo.request import SamplingParams

CPU = torch.device("cpu")


def shape_of(dtype: torch.dtype, kv_dtype: torch.dtype | None = FP8) -> PageShape:
    """test_triton_attention's pages (16 text tokens, 40-token image pages that tiles of 17 cross, 8 heads over 2,
    head dim 24), stored as ``kv_dtype``."""
    return PageShape(16, 40, (0,), (1,), kv_heads=2, head_dim=24, patches=17, max_tiles=4, dtype=dtype,
                     kv_dtype=kv_dtype)  # fmt: skip


def pool_of(shape: PageShape, pages: int = 64) -> PagePool:
    return PagePool(shape, pages, {0: CPU, 1: CPU})


def read(pool: PagePool, layer: int, where: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    keys = dequantize(pool.keys[layer][where], pool.key_scales[layer][where], pool.shape.dtype)
    return keys, dequantize(pool.values[layer][where], pool.value_scales[layer][where], pool.shape.dtype)


# ---- the pool ----------------------------------------------------------------------------------------------------


def test_a_written_token_reads_back_within_e4m3s_rounding_with_its_scale() -> None:
    """Per token per head: ranges from 1e-3 to 1e3 apart, each within 2^-4 of its value (3 mantissa bits) or half a
    subnormal step; the scale is the head's amax ÷ 448; an all-zero token reads zeros; ``write`` returns what the
    pool now holds."""
    pool = pool_of(shape_of(torch.float32), 8)
    g = torch.Generator().manual_seed(0)
    ranges = 10.0 ** torch.empty(6, 2, 1).uniform_(-3, 3, generator=g)
    keys, values = (torch.randn(6, 2, 24, generator=g) * ranges for _ in range(2))
    keys[2] = 0.0
    where = (torch.tensor([1, 1, 2, 2, 3, 3]), torch.tensor([0, 1, 0, 5, 15, 7]))
    held = pool.write(0, where, keys, values)
    assert pool.keys[0].dtype == FP8 and pool.key_scales[0].shape == (8, 16, 2)
    for x, scales, got, back in zip((keys, values), (pool.key_scales, pool.value_scales), read(pool, 0, where), held,
                                    strict=True):  # fmt: skip
        scale = scales[0][where]
        assert torch.allclose(scale[[0, 1, 3, 4, 5]], x.abs().amax(-1)[[0, 1, 3, 4, 5]] / 448, rtol=1e-6)
        assert bool(((got - x).abs() <= x.abs() / 16 + scale[..., None] * 2**-10).all())
        assert torch.equal(got, back)
    assert torch.equal(read(pool, 0, where)[0][2], torch.zeros(2, 24)) and bool(
        torch.isfinite(pool.key_scales[0]).all()
    )


def test_copy_page_copies_the_scales_and_store_load_keep_any_tensor_bit_for_bit() -> None:
    """A fork's page copy takes the tokens' scales too; the image-state cache keeps bf16 and float32 states in an
    fp8 arena's pages as bytes."""
    pool = pool_of(shape_of(torch.float32), 16)
    fill(pool, torch.Generator().manual_seed(1))
    pool.copy_page(3, 9, 5, text=True)
    pool.copy_page(4, 10, 30, text=False)
    for layer, (source, target, tokens) in ((0, (3, 9, 5)), (1, (4, 10, 30))):
        for store in (pool.keys, pool.values, pool.key_scales, pool.value_scales):
            assert torch.equal(store[layer][target, :tokens].float(), store[layer][source, :tokens].float())
    for dtype in (torch.bfloat16, torch.float32):
        states = torch.randn(3, 17, 40, generator=torch.Generator().manual_seed(2)).to(dtype)
        count = pool.pages_for(states)
        assert count == -(-states.numel() * states.element_size() // pool._bytes(CPU).shape[1])
        pages = pool.take(count)
        assert pages is not None
        pool.store(pages, states)
        got = pool.load(pages, states.shape, CPU, dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), states.view(torch.uint8))
        pool.release(pages)


def test_fp8_pages_hold_about_1_94_times_the_tokens_and_the_memory_plan_counts_them() -> None:
    """The 11B model's pages: 128 values of a head at 1 byte + a 4-byte scale against 2 bytes each (bf16)."""
    config = realshape.full_config()
    bf16, fp8 = (PageShape.of(config, torch.bfloat16, 256, kv) for kv in (None, FP8))
    assert bf16.kv_dtype == torch.bfloat16 and fp8.dtype == torch.bfloat16 and fp8.scaled and not bf16.scaled
    assert bf16.text_bytes_per_token / fp8.text_bytes_per_token == pytest.approx(256 / 132)
    assert bf16.page_bytes / fp8.page_bytes == pytest.approx(256 / 132, rel=1e-3)
    assert KVShape.of(config, torch.bfloat16, FP8).bytes_per_token == fp8.text_bytes_per_token
    assert KVShape.of(config, torch.bfloat16).bytes_per_token == bf16.text_bytes_per_token
    pool = PagePool(fp8, 2, dict.fromkeys(range(40), torch.device("meta")))  # the arenas are exactly page_bytes
    arenas = sum(b.numel() * b.element_size() for b in (*pool.buffers.values(), *pool.scale_buffers.values()))
    assert arenas == 2 * fp8.page_bytes
    assert kv_dtype_for("auto", torch.float16) == torch.float16 and kv_dtype_for("fp8", torch.bfloat16) == FP8


# ---- the kernels -------------------------------------------------------------------------------------------------

PLACES = [_Place([3], 4, [10], 1), _Place([5, 6, 7, 8], 60, [11, 12, 13, 14], 3), _Place([9, 2], 16, [20, 21], 2)]


def attend(kernel, places: list[_Place], query: torch.Tensor) -> torch.Tensor:
    """Self- then cross-attention of one step (the kernel's own inputs), the rows in the given order."""
    from vlm_demo.engine.executor.staging import Staging

    staging = Staging(CPU)
    order = kernel.order(places, len(places), version := next(VERSIONS), staging)
    mine = places if order is None else [places[i] for i in order.rank]
    lengths = np.asarray([p.length for p in mine], dtype=np.int64)
    _, layout = kernel.prepare(StepRows(mine, len(mine), lengths, version, staging), [])
    q = query if order is None else query[order.order]
    out = torch.cat([kernel.self_attention(0, q, layout), kernel.cross_attention(1, q, layout)], dim=-1)
    return out if order is None else out[order.restore[: len(places)]]


def pools(dtype: torch.dtype) -> tuple[PagePool, PagePool, PagePool]:
    """The same random keys/values three ways: as drawn (``dtype``), in an fp8 pool, and the fp8 pool's values
    widened into a ``dtype`` pool."""
    plain, fp8, widened = pool_of(shape_of(dtype, None)), pool_of(shape_of(dtype)), pool_of(shape_of(dtype, None))
    fill(plain, torch.Generator().manual_seed(4))
    for layer, keys in plain.keys.items():
        pages, tokens = keys.shape[:2]
        where = (torch.arange(pages).repeat_interleave(tokens), torch.arange(tokens).repeat(pages))
        held = fp8.write(layer, where, keys[where], plain.values[layer][where])
        widened.write(layer, where, *held)
    return plain, fp8, widened


@pytest.mark.parametrize("rows", [PLACES, PLACES[:1]], ids=["dense-lines", "one-row"])
def test_the_reference_reads_fp8_pages_as_their_dequantised_values(rows) -> None:
    """Equal (to float32 rounding) to float attention over the widened values; close to it over the values before
    quantisation (e4m3's 3 mantissa bits; measured ~2e-2 on standard normal keys/values)."""
    plain, fp8, widened = pools(torch.float32)
    query = torch.randn(len(rows), 8, 24, generator=torch.Generator().manual_seed(5))
    got = attend(ReferenceAttention(fp8, 8, 24**-0.5), rows, query)
    assert (got - attend(ReferenceAttention(widened, 8, 24**-0.5), rows, query)).abs().max() <= 1e-6
    exact = attend(ReferenceAttention(plain, 8, 24**-0.5), rows, query)
    assert 0 < (got - exact).abs().max() <= 0.08, (got - exact).abs().max()


def test_the_references_kept_lines_take_the_new_token_as_the_pool_holds_it() -> None:
    """Two steps of the same rows: the dense lines gathered at the first are kept, and each step's new token is
    written into them through the kernel; the step's attention then equals a fresh gather's, exactly."""
    from vlm_demo.engine.executor.staging import Staging

    _, fp8, _ = pools(torch.float32)
    kept, staging, version = ReferenceAttention(fp8, 8, 24**-0.5), Staging(CPU), next(VERSIONS)
    rows = [_Place([5, 6, 7, 8], 58, [11], 2), _Place([9, 2], 16, [20], 2), _Place([3], 4, [10], 2)]  # dense lines
    g = torch.Generator().manual_seed(6)
    for step in range(2):
        places = [_Place(p.pages, p.length + step, p.image_pages, p.tiles) for p in rows]
        lengths = np.asarray([p.length for p in places], dtype=np.int64)
        assert kept.order(places, 3, version, staging) is None  # longest first already
        _, layout = kept.prepare(StepRows(places, 3, lengths, version, staging), [])
        pages = torch.tensor([p.pages[p.length // 16] for p in places])
        offsets = torch.tensor([p.length % 16 for p in places])
        new = [torch.randn(3, 2, 24, generator=g) * 3 for _ in range(2)]
        kept.write(0, pages, offsets, *new, layout)
        query = torch.randn(3, 8, 24, generator=g)
        got = kept.self_attention(0, query, layout)
        assert kept._kept(0, layout.text_epoch) is not None  # the lines were kept (and written into)
        fresh = ReferenceAttention(fp8, 8, 24**-0.5)
        _, again = fresh.prepare(StepRows(places, 3, lengths, next(VERSIONS), staging), [])
        assert torch.equal(got, fresh.self_attention(0, query, again)), step


@pytest.mark.parametrize("splits", [None, SMALL_SPLITS], ids=["one-split", "splits-merged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_triton_kernel_reads_fp8_pages_as_the_reference_does(dtype, splits, monkeypatch) -> None:
    """The probe's random steps over fp8 pages (text and image, tiles across pages), the interpreted kernel against
    the reference reading the same pages: as close as over 16-bit pages."""
    if splits:
        monkeypatch.setitem(TritonAttention.PLANS, "cpu", splits)
    result = probe(TritonAttention, shape_of(dtype), 8, CPU, steps=3, seed=3)
    assert result.failure == "" and result.steps == 3 and result.nan_steps == 0
    assert result.max_error <= (2e-6 if dtype == torch.float32 else 2e-2), result.max_error


def test_the_triton_kernel_over_fp8_pages_gives_a_row_the_same_bits_alone_or_batched(monkeypatch) -> None:
    monkeypatch.setitem(TritonAttention.PLANS, "cpu", SMALL_SPLITS)
    _, fp8, _ = pools(torch.float32)
    kernel = TritonAttention(fp8, 8, 24**-0.5)
    query = torch.randn(len(PLACES), 8, 24, generator=torch.Generator().manual_seed(7))
    together = attend(kernel, PLACES, query)
    assert (together - attend(ReferenceAttention(fp8, 8, 24**-0.5), PLACES, query)).abs().max() <= 2e-6
    for r, place in enumerate(PLACES):
        assert torch.equal(attend(kernel, [place], query[r : r + 1])[0], together[r]), r


# ---- the engine --------------------------------------------------------------------------------------------------


def test_the_engine_with_an_fp8_cache_answers_in_four_stages_like_the_default_cache(engines) -> None:
    """The tiny model in fp32, greedy, four rows of 1-4 tiles together (the reference on a CPU), then the first
    picture again (its vision states from the image-state cache, kept as bytes in the fp8 pool's pages)."""
    answers, stats = {}, {}
    for cache in ("auto", "fp8"):
        engine = engines(kv_cache_dtype=cache)
        results = engine.run_batch([door(*job, SamplingParams(80, 0.0)) for job in JOBS])
        again = engine.run_batch([door(*JOBS[0], SamplingParams(80, 0.0))])[0]
        stats[cache] = engine.stats()
        assert next(iter(engine.decoder.pool.keys.values())).dtype == (FP8 if cache == "fp8" else torch.float32)
        answers[cache] = [r.text for r in results]
        assert again.text == answers[cache][0] and stats[cache].image_cache_hits >= 1
    assert all(four_stages(text) for text in answers["fp8"]), answers["fp8"]
    assert answers["fp8"] == answers["auto"]
    assert stats["fp8"].kv_cache_dtype == "fp8" and stats["auto"].kv_cache_dtype == "auto"
    assert stats["fp8"].kv_bytes_per_token * 3 < stats["auto"].kv_bytes_per_token  # fp32 model: 4 bytes -> 1 + scale


# ---- the flag ----------------------------------------------------------------------------------------------------


def test_the_flag_and_its_variable_parse_and_a_bad_value_is_refused(capsys) -> None:
    assert load_config([]).kv_cache_dtype == "auto"
    assert load_config(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert load_config([], environ={"VLM_KV_CACHE_DTYPE": "fp8"}).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        load_config(["--kv-cache-dtype", "int8"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(ValueError, match="choose one of auto, fp8"):
        kv_dtype_for("fp16", torch.float32)


def test_flash_cannot_read_fp8_pages_and_asking_for_it_stops_the_start() -> None:
    """Said without touching a GPU: the reason auto logs, and --decode-attention flash's error."""
    cuda = torch.device("cuda")
    assert "--kv-cache-dtype fp8" in flash_missing(cuda, torch.bfloat16, FP8)  # type: ignore[operator]
    assert flash_missing(CPU, torch.bfloat16, FP8) == "needs CUDA"
    with pytest.raises(ModelLoadError, match="--decode-attention flash: cannot read float8_e4m3fn pages"):
        decide(shape_of(torch.bfloat16), 8, cuda, "flash")
    kernel, passed_over = decide(shape_of(torch.float32), 8, CPU)  # a CPU: the reference, which reads fp8
    assert kernel is ReferenceAttention and passed_over[0] == "flash: needs CUDA"
