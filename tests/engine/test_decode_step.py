"""The continuous engine's decode step over the page pool, against the stock forward and against itself alone."""

from __future__ import annotations

import pytest
import torch
from support import checked, join_running

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.batching.rows import Row, RunningRows
from vlm_demo.engine.decoding.detokenizer import RowStreamer
from vlm_demo.engine.decoding.sampler import RowSampling
from vlm_demo.engine.executor.attention import fewest_bands
from vlm_demo.engine.executor.decode_step import TextDecodeStep
from vlm_demo.engine.weights import loader
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import SamplingParams

JOBS = [
    (solid_image("red", 300, 80), "What colour is this image? Describe it in detail."),
    (solid_image("green", 16, 16), "Colour?"),  # shorter prompt, one tile
    (solid_image("blue", 500, 500), "Describe it"),  # four tiles
]


def paged(worker, pages: int = 200) -> tuple[RunningRows, TextDecodeStep]:
    step = TextDecodeStep.over_pool(worker.model, worker.dtype, pages)
    return RunningRows(step.pool, step.attention, worker.device, worker.dtype), step


def requests(worker, jobs) -> list[Request]:
    out = []
    for image, question in jobs:
        request = Request(
            image=image, question=question, params=checked(SamplingParams(max_new_tokens=50, temperature=0))
        )
        request.inputs = worker.prepare(image, question)
        out.append(request)
    return out


def stock_step(worker, cache, token: torch.Tensor, position: int, inputs: dict) -> torch.Tensor:
    """One row's next logits through the model's own forward (what ``generate`` runs), extending ``cache``."""
    out = worker.model(
        input_ids=token.view(1, 1),
        position_ids=torch.tensor([[position]]),
        cross_attention_mask=inputs["cross_attention_mask"][:, -1:],
        cache=cache,
        use_cache=True,
    )
    return out.logits[:, -1].float()


@pytest.mark.parametrize(
    ("dense", "held", "padding"),
    [(True, True, float("inf")), (True, False, float("inf")), (True, True, 1.0), (False, False, float("inf"))],
    ids=["one-masked-product", "one-masked-product-gathered-each-step", "a-product-per-band", "block-by-block"],
)
@pytest.mark.parametrize("group", [1, 3], ids=["joined-one-by-one", "prefilled-together"])
def test_the_paged_step_follows_the_stock_forward_row_by_row(worker, group, dense, held, padding, monkeypatch) -> None:
    """90 steps (past several page boundaries, a row leaving mid-flight): every row's logits match its own
    stock forward to float precision and pick the same token, with each form of the reference attention
    (one product over lines kept between steps and written into, or over lines gathered every layer; with no
    padding allowed, one product per band of rows as long as each other, the bands changing as rows grow)."""
    monkeypatch.setattr("vlm_demo.engine.executor.attention.reference.DENSE_ROWS", 16 if dense else 0)
    # inf: one product whatever the padding
    monkeypatch.setattr("vlm_demo.engine.executor.attention.reference.DENSE_PADDING", padding)
    monkeypatch.setattr("vlm_demo.engine.executor.attention.reference.HELD_BYTES", 256 * 2**20 if held else 0)
    monkeypatch.setattr(worker, "vision_tiles", "all")  # the stock forward runs every tile the processor packed
    rows, step = paged(worker)
    batch = requests(worker, JOBS)
    for start in range(0, len(batch), group):
        join_running(worker, rows, batch[start : start + group])
    alone = []
    for request in batch:  # each row on its own, through the stock forward and a DynamicCache
        inputs = worker.to_device(request.inputs)
        with torch.inference_mode():
            out = worker.model(**inputs, use_cache=True, logits_to_keep=1)
        alone.append([out.cache, out.logits[:, -1].argmax(-1), request.prompt_tokens, inputs])
    live = [0, 1, 2]
    bands = set()
    for n in range(90):
        if n == 40:  # a row leaves mid-flight: the others' pages stay where they are
            pages_before = [list(r.place.pages) for r in rows.rows]
            rows.keep([0, 2])
            live = [0, 2]
            assert [r.place.pages[: len(p)] for r, p in zip(rows.rows, pages_before[::2], strict=True)] == pages_before[
                ::2
            ]
        with torch.inference_mode():
            inputs = rows.step_inputs()
            got = worker.decode(step, inputs)
            want = torch.cat([stock_step(worker, *alone[i][:1], alone[i][1], alone[i][2], alone[i][3]) for i in live])
        bands.add(len(inputs.layout.text_bands or ()))
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"step {n}: {(got - want).abs().max()}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {n}"
        tokens = want.argmax(-1)
        rows.advance(tokens)
        for j, i in enumerate(live):
            alone[i][1], alone[i][2] = tokens[j : j + 1], alone[i][2] + 1
    assert bands == {0} if not dense else bands == {1} if padding > 2 else max(bands) >= 2, bands  # each form ran


def test_bands_are_the_fewest_that_keep_the_padding_allowed() -> None:
    """Rows longest first (blocks each): the fewest bands whose lines fit the budget, the fewest blocks among those."""
    assert fewest_bands([5, 5, 5], 15, 4) == [3]
    assert fewest_bands([10, 9, 2, 2], 40, 4) == [4]  # one band: every row as long as the longest
    assert fewest_bands([10, 9, 2, 2], 24, 4) == [2, 2]  # 2 × 10 + 2 × 2
    assert fewest_bands([10, 9, 2, 2], 23, 4) == [1, 1, 2]  # no padding left at all
    assert fewest_bands([10, 9, 2, 2], 23, 2) is None  # two bands read at least 24
    assert fewest_bands([10, 9, 2, 2], 22, 4) is None  # less than the rows' own blocks
    assert fewest_bands([], 0, 4) == []


@pytest.mark.parametrize("weights", ["fp32", "int8", "fp8", "int4"])
def test_a_row_in_a_batch_gets_its_logits_alone(worker, tiny_dir, weights) -> None:
    """A row's attention reads only its own pages, so its logits in a batch are its logits alone, up to the
    rounding of the batch's matrix products (fp32), and the same token: what makes batched answers equal
    single ones; with the language model's projections packed too (merged, residuals inside the products)."""
    if weights != "fp32":
        worker = loader.load(tiny_dir, device="cpu", quantize=weights)
    together, step = paged(worker)
    join_running(worker, together, requests(worker, JOBS))
    singles = []
    for job in JOBS:
        rows, own = paged(worker)
        join_running(worker, rows, requests(worker, [job]))
        singles.append((rows, own))
    for n in range(40):
        with torch.inference_mode():
            got = worker.decode(step, together.step_inputs())
            want = [worker.decode(own, rows.step_inputs()) for rows, own in singles]
        want = torch.cat(want)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"step {n}: {(got - want).abs().max()}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {n}"
        together.advance(got.argmax(-1))
        for (rows, _), logits in zip(singles, want.split(1), strict=True):
            rows.advance(logits.argmax(-1))


def test_image_states_take_only_the_tiles_a_picture_shows(worker) -> None:
    rows, _ = paged(worker)
    batch = requests(worker, JOBS)
    join_running(worker, rows, batch)
    shape = rows.shape
    tiles = [r.place.tiles for r in rows.rows]
    assert tiles == [r.tiles for r in batch] and tiles[1] == 1 and tiles[2] == 4
    for row in rows.rows:
        assert len(row.place.image_pages) == shape.image_pages(row.place.tiles * shape.patches)
    assert len(rows.rows[1].place.image_pages) < len(rows.rows[2].place.image_pages)
    inputs = rows.step_inputs()
    assert inputs.layout.tile_rows.tolist() == [0] * tiles[0] + [1] + [2] * 4  # the step reads those tiles only


def test_a_cache_kept_aside_is_shared_not_copied(worker) -> None:
    """A snapshot shares a row's pages up to its last token (the snapshot's next input); forks share its full
    pages and copy only the partly filled last one."""
    rows, step = paged(worker)
    (request,) = requests(worker, JOBS[:1])
    prefill = worker.prefill([request])
    sampling = RowSampling([request.params], prefill.logits.device)
    first = sampling.sample(prefill.logits)
    row = Row(request, RowStreamer(worker.tokenizer, request, worker.eos_ids))
    row.streamer.feed(int(first))
    rows.join([row], rows.place(prefill, [0]), first, sampling)
    pool = rows.pool
    for _ in range(5):
        with torch.inference_mode():
            tokens = worker.decode(step, rows.step_inputs()).argmax(-1)
        rows.advance(tokens)
        row.streamer.accept(int(tokens))
    snapshot = rows.snapshot(0)
    assert snapshot.length == request.prompt_tokens + len(row.streamer.ids) - 1  # the last token is its next input
    assert int(snapshot.next_token) == row.streamer.ids[-1]
    place = rows.rows[0].place
    assert all(pool.owners(p) == 2 for p in place.pages + place.image_pages)
    rows.keep([])  # the row leaves; the snapshot keeps its pages
    assert all(pool.owners(p) == 1 for p in place.pages + place.image_pages)
    forks = rows.table.fork(snapshot, 3)
    partial = snapshot.length % rows.shape.page_tokens
    assert partial and rows.table.copied_bytes == 3 * partial * rows.shape.text_bytes_per_token
    for fork in forks:
        assert fork.pages[:-1] == snapshot.place.pages[:-1] and fork.pages[-1] != snapshot.place.pages[-1]
        assert fork.image_pages == snapshot.place.image_pages
        last = fork.pages[-1]
        for layer in rows.shape.self_layers:
            assert torch.equal(pool.keys[layer][last, :partial], pool.keys[layer][snapshot.place.pages[-1], :partial])
    free = pool.free_pages
    snapshot.release()
    assert pool.free_pages == free + 1  # only the last page was its alone; the rest the forks share
    pool.release([p for f in forks for p in f.pages + f.image_pages])
    assert pool.free_pages == pool.pages
