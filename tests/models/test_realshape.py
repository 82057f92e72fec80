"""The engine at Llama-3.2-11B-Vision's real shapes (narrow widths, random weights, fp32 on CPU).

The tiny model has 16-px tiles and a 1k vocabulary; these tests run the real structure: vocabulary
128256 with the real special-token ids, 560-px tiles (1-4 per image), 32/8 grouped-query heads,
llama3 rope scaling, cross-attention layers with open gates. "Batched == single" is claimed for fp32
only: in bf16 on a GPU the kernels depend on the batch shape and equality is not bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from support import checked, door, wait_until

from vlm_demo.config import Config
from vlm_demo.cot.stages import parse_stages
from vlm_demo.engine import make_engine
from vlm_demo.engine.batching.dynamic import DynamicEngine
from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.batching.rows import Row, RunningRows
from vlm_demo.engine.decoding.sampler import RowSampling
from vlm_demo.engine.executor.decode_step import TextDecodeStep
from vlm_demo.engine.executor.worker import Worker
from vlm_demo.engine.weights.placement import meta_model
from vlm_demo.models import realshape
from vlm_demo.request import SamplingParams

N = 8  # tokens per answer: enough to cross padding, cheap at a 128k vocabulary
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=N, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)

# (width, height) -> 1, 2, 3, 4 tiles of 560 px; prompts of different lengths (left padding in a batch).
CASES = [
    ((50, 50), "Hi"),
    ((300, 900), "What is in this image?"),
    ((1200, 400), "Describe the picture in one sentence, please, with as much detail as you can manage."),
    ((1120, 1120), "Colour?"),
]


def noise_image(index: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = [noise_image(i, w, h) for i, ((w, h), _) in enumerate(CASES)]


@pytest.fixture(scope="module")
def processor():
    return realshape.real_processor()


def narrow_worker(processor, text_attention: str) -> Worker:
    model = realshape.build_model(realshape.narrow_config(), torch.float32, "cpu", attn_implementation="sdpa")
    # The text model's attention kernel is the one that takes the padding mask; the vision tower
    # stays on sdpa (eager over 6404 image tokens per image only costs CI time).
    model.config.text_config._attn_implementation = text_attention
    return Worker(model, processor, f"narrow-{text_attention}")


@pytest.fixture(scope="module")
def worker(processor) -> Worker:
    return narrow_worker(processor, "sdpa")


@pytest.fixture(scope="module")
def sampled_alone(worker) -> list[int]:
    """The seeded sampled row run on its own (dynamic batch of one)."""
    engine = DynamicEngine(worker, Config(batching="dynamic", max_batch_size=1, batch_window_ms=0.0)).start()
    try:
        handle = engine.submit(door(IMAGES[2], CASES[2][1], SAMPLED))
        handle.result(timeout=300)
        return handle.token_ids
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def references(worker) -> list[list[int]]:
    """Each case alone through plain ``model.generate`` (greedy, no padding, no engine code)."""
    refs = []
    for image, (_, question) in zip(IMAGES, CASES, strict=True):
        inputs = worker.to_device(worker.prepare(image, question))
        with torch.inference_mode():
            out = worker.model.generate(**inputs, generation_config=worker.generation_config(N))
        refs.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return refs


def test_the_narrow_model_has_the_real_structure(worker, processor) -> None:
    tokenizer = processor.tokenizer
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|begin_of_text|>", "<|finetune_right_pad_id|>")}
    ids |= {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|eom_id|>", "<|eot_id|>", "<|image|>")}
    assert ids == {
        "<|begin_of_text|>": 128000,
        "<|finetune_right_pad_id|>": 128004,
        "<|eom_id|>": 128008,
        "<|eot_id|>": 128009,
        "<|image|>": 128256,
    }
    assert len(tokenizer) == 128257 and worker.pad_id == 128004 and {128001, 128008, 128009} <= set(worker.eos_ids)
    text, vision = worker.model.config.text_config, worker.model.config.vision_config
    assert text.vocab_size == 128256 and worker.model.lm_head.out_features == 128256
    assert text.num_attention_heads // text.num_key_value_heads == 4  # 32 / 8
    assert text.rope_parameters["rope_type"] == "llama3" and text.rope_parameters["factor"] == 8.0
    assert set(text.cross_attention_layers) < set(range(text.num_hidden_layers))
    assert (vision.image_size, vision.max_num_tiles) == (560, 4)
    gates = [p for n, p in worker.model.named_parameters() if n.endswith(("cross_attn_attn_gate", "gate_attn"))]
    assert gates and all(bool((g == 1).all()) for g in gates)
    tiles = [int(worker.prepare(img, q)["aspect_ratio_mask"].sum()) for img, (_, q) in zip(IMAGES, CASES, strict=True)]
    assert tiles == [1, 2, 3, 4]
    prompt = worker.prepare(IMAGES[0], "Hi")["input_ids"][0].tolist()
    assert prompt.count(128000) == 1 and prompt.count(128256) == 1  # one BOS, one image token


def test_full_config_is_the_11b_architecture() -> None:
    config = realshape.full_config()
    assert (
        10.6e9 < sum(p.numel() for p in meta_model(config).parameters()) < 10.7e9
    )  # Llama-3.2-11B-Vision: 10,670,220,835
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, len(text.cross_attention_layers)) == (4096, 40, 8)


@pytest.fixture(scope="module")
def real_alone(worker) -> list[list[int]]:
    """Each case (and the sampled row last) alone through the continuous engine with ``--vision-tiles real``."""
    engine = make_engine(Config(batching="continuous", max_batch_size=1, batch_window_ms=0.0), worker)
    try:
        jobs = [door(img, q, GREEDY) for img, (_, q) in zip(IMAGES, CASES, strict=True)]
        handles = [engine.submit(job) for job in [*jobs, door(IMAGES[2], CASES[2][1], SAMPLED)]]
        return [h.result(timeout=300) and h.token_ids for h in handles]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("batching", "tiles"), [("dynamic", "all"), ("continuous", "all"), ("continuous", "real")])
def test_batched_rows_equal_single_runs_at_real_shapes(
    worker, references, sampled_alone, real_alone, batching, tiles
) -> None:
    """fp32: every row of a batch (1-4 tiles, left-padded prompts, a seeded sampled row beside them) gives the
    tokens of its single run: plain ``generate``'s with every tile run (dynamic batching, ``--vision-tiles
    all``), or, with real tiles only, the same engine's alone, a 4-tile picture's still equal to ``generate``'s."""
    if tiles == "real":
        assert real_alone[3] == references[3]  # a 4-tile picture has no padding tile: the stock answer
        references, sampled_alone = real_alone[:-1], real_alone[-1]
    config = Config(batching=batching, max_batch_size=5, batch_window_ms=3000.0, vision_tiles=tiles, prefill_share=0)
    engine = make_engine(config, worker)
    tiles_before = worker.vision_tiles_run
    try:
        if batching == "continuous":  # one row runs first; the others join it mid-flight, prefilled together
            first = engine.submit(door(IMAGES[0], CASES[0][1], GREEDY))
            wait_until(lambda: len(first.token_ids) >= 2, 120, every=0.01, what="the first row's second token")
            with engine.scheduler._cond:  # hold the queue: they arrive at the same step boundary
                rest = [engine.submit(door(img, q, GREEDY)) for img, (_, q) in zip(IMAGES[1:], CASES[1:], strict=True)]
                sampled = engine.submit(door(IMAGES[2], CASES[2][1], SAMPLED))
            handles = [first, *rest]
        else:
            handles = [engine.submit(door(img, q, GREEDY)) for img, (_, q) in zip(IMAGES, CASES, strict=True)]
            sampled = engine.submit(door(IMAGES[2], CASES[2][1], SAMPLED))
        results = [h.result(timeout=300) for h in handles]
        sampled_result = sampled.result(timeout=300)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert [h.token_ids for h in handles] == references
    assert max(r.batch_size for r in results) >= 4
    assert sampled.token_ids == sampled_alone and sampled_result.batch_size > 1
    if tiles == "all" and batching == "continuous":
        assert stats.prefills_run == 2  # the first row alone, then four newcomers in one forward pass
    elif tiles == "real":  # the first row alone, then one pass per tile count (2, 3 with the sampled row, 4)
        assert stats.prefills_run == 4
        assert stats.vision_tiles - tiles_before == 1 + 2 + 3 + 4  # real tiles only; the sampled row's picture once


@pytest.mark.parametrize(("attention", "tiles"), [("sdpa", "all"), ("eager", "all"), ("sdpa", "real")])
def test_rows_prefilled_together_step_like_single_rows(processor, worker, attention, tiles) -> None:
    """Rows prefilled together (left-padded among themselves, by either of the model's attention kernels)
    and one joining later step over the page pool as each does alone: the prefill's padding never reaches
    a row's pages, and each row's decode attention reads only its own tokens and tiles. With real tiles
    only, the rows prefilled together are two 2-tile pictures (a prefill takes one tile count)."""
    worker = worker if attention == "sdpa" else narrow_worker(processor, attention)
    worker.vision_tiles = tiles
    cases = [(IMAGES[i], CASES[i][1]) for i in range(3)]
    if tiles == "real":
        cases[2] = (noise_image(9, 900, 300), CASES[2][1])  # 2 tiles, like case 1

    def requests(indices):
        out = []
        for i in indices:
            request = Request(image=cases[i][0], question=cases[i][1], params=checked(GREEDY))
            request.inputs = worker.prepare(*cases[i])
            out.append(request)
        return out

    def running():
        step = TextDecodeStep.over_pool(worker.model, worker.dtype, pages=2048)  # 4 tiles: ~270 pages of 24
        return RunningRows(step.pool, step.attention, worker.device, worker.dtype), step

    def join(rows, group):
        prefill = worker.prefill(group)
        sampling = RowSampling([r.params for r in group], prefill.logits.device)
        rows.join([Row(r, None) for r in group], rows.place(prefill, list(range(len(group)))),
                  sampling.sample(prefill.logits), sampling)  # fmt: skip

    batch, step = running()
    join(batch, requests([1, 2]))  # prefilled together: the shorter prompt is left-padded
    join(batch, requests([0]))  # joins later
    singles = []
    for i in (1, 2, 0):
        alone = running()
        join(alone[0], requests([i]))
        singles.append(alone)
    for n in range(3):
        got = worker.decode(step, batch.step_inputs())
        alone_logits = [worker.decode(own, rows.step_inputs()) for rows, own in singles]
        want = torch.cat(alone_logits)
        assert (got - want).abs().max() < 1e-3, f"{attention} step {n}: {(got - want).abs().amax(-1)}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        batch.advance(batch.sampling.sample(got))
        for (rows, _), logits in zip(singles, alone_logits, strict=True):
            rows.advance(rows.sampling.sample(logits))


@pytest.mark.parametrize("batching", ["dynamic", "continuous"])
def test_structured_rows_equal_single_runs_at_real_shapes(worker, batching) -> None:
    """With the stage structure on, random weights write nothing like the format, so the tracker replaces
    and redraws tokens all the time: in fp32 every batched row still gives its single run's tokens (its
    corrections are a function of its own tokens), and the answer opens with its SUMMARY (16 tokens hold no
    more at a 128k vocabulary; the four stages and the CONCLUSION's reserve are tested on the tiny model)."""
    params = SamplingParams(max_new_tokens=2 * N, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=2 * N, temperature=0.9, top_p=0.9, seed=7)
    jobs = [door(img, q, params) for img, (_, q) in zip(IMAGES, CASES, strict=True)]
    jobs.append(door(IMAGES[2], CASES[2][1], sampled))
    alone_engine = make_engine(Config(batching=batching, max_batch_size=1, batch_window_ms=0.0), worker)
    try:
        alone = []
        for job in jobs:
            handle = alone_engine.submit(job)
            handle.result(timeout=300)
            alone.append(handle.token_ids)
    finally:
        alone_engine.shutdown()
    engine = make_engine(Config(batching=batching, max_batch_size=5, batch_window_ms=3000.0), worker)
    try:
        handles = [engine.submit(job) for job in jobs]
        texts = [h.result(timeout=300).text for h in handles]
    finally:
        engine.shutdown()
    assert [h.token_ids for h in handles] == alone
    assert all(parse_stages(text, final=True).seen[:1] == ("summary",) for text in texts), texts
