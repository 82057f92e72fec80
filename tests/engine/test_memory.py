"""Memory-sized batches and weight placement, with the real 11B architecture's numbers.

GPU memory figures are what ``torch.cuda.mem_get_info`` reports on those cards (bytes); the rest is
arithmetic on the real config, so these run on CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vlm_demo.config import Config
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.kv.memory import CPU_BATCH_SIZE, MAX_AUTO_BATCH_SIZE, KVShape, plan
from vlm_demo.engine.weights.placement import Gpu, check_on_gpus, load_kwargs, weight_bytes
from vlm_demo.errors import ModelLoadError
from vlm_demo.models import realshape

GiB = 1024**3
FULL = realshape.full_config()
WEIGHTS = weight_bytes(FULL, torch.bfloat16)
KV = KVShape.of(FULL, torch.bfloat16)
H200 = Gpu(0, "NVIDIA H200", 139 * GiB, 140 * GiB)
H100 = Gpu(0, "NVIDIA H100 80GB HBM3", 78 * GiB, 79 * GiB)
A10 = Gpu(0, "NVIDIA A10", int(21.5 * GiB), int(22.1 * GiB))
L40S = Gpu(0, "NVIDIA L40S", 44 * GiB, int(44.4 * GiB))


def test_the_11b_cache_costs_128_kib_per_token_and_52_mb_per_tile() -> None:
    assert KV.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert KV.bytes_per_tile == 2 * 8 * 8 * 128 * 1601 * 2  # ~52 MB of cross-attention states a tile
    assert KV.bytes_per_row == 4 * KV.bytes_per_tile  # ~210 MB for a four-tile picture
    assert 19.8 * GiB < WEIGHTS < 20.0 * GiB  # 10.67 B parameters in bf16 (21.3 GB)
    # A row of 2k tokens: ~0.45 GB with a four-tile picture, ~0.3 GB with one.
    assert 0.44 * GiB < KV.batch_bytes(1, 2048) < 0.45 * GiB
    assert 0.29 * GiB < KV.batch_bytes(1, 2048, tiles=1) < 0.30 * GiB


def after_loading(gpu: Gpu) -> tuple[int, int]:
    """Free and total memory once the weights sit on ``gpu``."""
    return gpu.free - WEIGHTS, gpu.total


def test_an_h200_batches_about_200_rows_of_2k_tokens() -> None:
    free, total = after_loading(H200)
    memory = plan(KV, Config(max_new_tokens=2048), cuda=True, free=free, total=total)
    assert memory.max_batch_size == MAX_AUTO_BATCH_SIZE  # 356 rows with one-tile pictures fit, 243 with four
    assert "356 rows of 2176 tokens fit with one-tile pictures, 243 with four" in memory.source
    assert 100 * GiB < memory.kv_budget_bytes < free
    longer = plan(KV, Config(max_new_tokens=4096), cuda=True, free=free, total=total)
    assert 180 <= longer.max_batch_size < memory.max_batch_size  # longer answers: fewer rows
    assert longer.max_batch_size * KV.batch_bytes(1, 4096 + 128, tiles=1) <= longer.kv_budget_bytes


def test_an_h100_batches_over_a_hundred_rows() -> None:
    free, total = after_loading(H100)
    memory = plan(KV, Config(), cuda=True, free=free, total=total)
    assert memory.max_batch_size == 172 and "117 with four" in memory.source


def test_an_a10_does_not_fit_bf16_usefully_and_says_what_to_do() -> None:
    with pytest.raises(ModelLoadError, match="--quantize int8 or int4") as info:
        load_kwargs("cuda", WEIGHTS, [A10], torch.bfloat16)  # 21.3 GB of weights + CUDA's own on 22 GiB
    assert "19.9 GiB" in str(info.value) and "A10" in str(info.value)
    # Even with the weights squeezed in, the cache would have no room: the plan refuses too.
    with pytest.raises(ModelLoadError, match="not enough for even one answer.*--quantize int8 or int4"):
        plan(KV, Config(), cuda=True, free=int(1.5 * GiB), total=A10.total)


def test_explicit_settings_win_over_the_memory_plan() -> None:
    free, total = after_loading(H200)
    config = Config(max_batch_size=16, kv_budget_gb=20.0)
    memory = plan(KV, config, cuda=True, free=free, total=total)
    assert (memory.max_batch_size, memory.kv_budget_bytes) == (16, 20 * GiB)


def test_cpu_keeps_a_small_batch_and_no_budget() -> None:
    memory = plan(KV, Config(), cuda=False)
    assert (memory.max_batch_size, memory.kv_budget_bytes) == (CPU_BATCH_SIZE, 0)


def test_one_gpu_holds_the_whole_model() -> None:
    assert load_kwargs("cuda", WEIGHTS, [H100], torch.bfloat16) == {"device_map": {"": 0}}
    second = dataclasses.replace(L40S, index=1)
    assert load_kwargs("cuda:1", WEIGHTS, [H100, second], torch.bfloat16) == {"device_map": {"": 1}}
    # A full first GPU: the model goes wholly to the next one that holds it, not split.
    busy = dataclasses.replace(H100, free=5 * GiB)
    assert load_kwargs("cuda", WEIGHTS, [busy, second], torch.bfloat16) == {"device_map": {"": 1}}


def test_two_small_gpus_share_the_model_and_the_cpu_gets_none() -> None:
    kwargs = load_kwargs("cuda", WEIGHTS, [A10, dataclasses.replace(A10, index=1)], torch.bfloat16)
    assert kwargs["device_map"] == "auto" and set(kwargs["max_memory"]) == {0, 1}


def test_weights_off_the_gpu_are_a_loud_error(worker) -> None:
    """The tiny model on the CPU stands for a model accelerate spilled: loading must not go on."""
    with pytest.raises(ModelLoadError, match="did not land on the GPU"):
        check_on_gpus(worker.model)


def test_the_engine_publishes_its_memory_plan(worker) -> None:
    engine = DynamicEngine(worker, Config(batching="dynamic")).start()
    try:
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.max_batch_size == CPU_BATCH_SIZE and stats.kv_budget_bytes == 0
    assert stats.kv_bytes_per_token == KVShape.of(worker.model.config, worker.dtype).bytes_per_token > 0


def test_the_plan_keeps_the_reference_attentions_gathers_out_of_the_cache_budget() -> None:
    """On an H100 with the reference decode attention (a torch without a fast kernel): each row's peak gathers
    (a cross layer's four tiles: keys and values, gathered then made head-major) are reserved beside its cache,
    so the rows and the budget shrink; flash and triton read in place and reserve nothing."""
    from vlm_demo.engine.executor.attention import KERNELS
    from vlm_demo.engine.kv.pages import PageShape

    shape = PageShape.of(FULL, torch.bfloat16, 256)
    working = KERNELS["reference"].working_bytes(shape, 32, 1, 4, 2048 + 128)
    assert working == 3 * 4 * 1601 * (8 * 128 + 32) * 2  # ~39 MB a row: 8.2 GB at 210 rows, as measured on paper
    assert all(KERNELS[k].working_bytes(shape, 32, 210, 4, 2176) == 0 for k in ("flash", "triton"))
    free, total = after_loading(H100)
    fast = plan(KV, Config(max_new_tokens=2048), cuda=True, free=free, total=total)
    slow = plan(KV, Config(max_new_tokens=2048), cuda=True, free=free, total=total, working_per_row=working)
    assert slow.max_batch_size < fast.max_batch_size and slow.kv_budget_bytes < fast.kv_budget_bytes
    reserved = slow.max_batch_size * working
    assert slow.kv_budget_bytes + reserved <= fast.kv_budget_bytes  # the gathers fit beside the cache
    assert slow.max_batch_size * (KV.batch_bytes(1, 2176, tiles=1) + working) <= fast.kv_budget_bytes
    assert f"GiB kept for the decode attention's gathers ({slow.max_batch_size} rows)" in slow.source
    fixed = plan(KV, Config(max_batch_size=64), cuda=True, free=free, total=total, working_per_row=working)
    assert fixed.max_batch_size == 64 and fixed.kv_budget_bytes == fast.kv_budget_bytes - 64 * working
