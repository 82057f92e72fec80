"""The continuous engine's step: written-out decode vs the stock forward, and the slack KV layer."""

from __future__ import annotations

import pytest
import torch

from vlm_demo.engine.batch_state import Row, RunningBatch, SlackLayer
from vlm_demo.engine.request import Request
from vlm_demo.engine.sampler import RowSampling
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import SamplingParams


def running_batch(worker, jobs, group: int = 1) -> RunningBatch:
    """Prefill the jobs ``group`` at a time and join them, as the continuous engine does."""
    batch = RunningBatch(cross_layers=worker.cross_attention_layers)
    requests = []
    for image, question in jobs:
        request = Request(image=image, question=question, params=SamplingParams(max_new_tokens=50, temperature=0))
        request.inputs = worker.prepare(image, question)
        requests.append(request)
    for start in range(0, len(requests), group):
        chunk = requests[start : start + group]
        prefill = worker.prefill(chunk)
        sampling = RowSampling([r.params for r in chunk], prefill.logits.device)
        batch.join([Row(r, None) for r in chunk], prefill, sampling.sample(prefill.logits), sampling)
    return batch


@pytest.mark.parametrize("group", [1, 3], ids=["joined-one-by-one", "prefilled-together"])
def test_written_out_step_equals_the_stock_forward_bit_for_bit(worker, group) -> None:
    assert worker.decode_step is not None  # a one-device model takes the written-out step
    jobs = [
        (solid_image("red", 300, 80), "What colour is this image? Describe it in detail."),
        (solid_image("green", 16, 16), "Colour?"),  # shorter prompt: left-padded in the batch
        (solid_image("blue", 500, 500), "Describe it"),  # different tile count
    ]
    written, stock = running_batch(worker, jobs, group), running_batch(worker, jobs, group)
    step = worker.decode_step
    for n in range(90):  # past SlackLayer.MIN_SPARE: the buffers regrow on the way
        if n == 40:  # a row leaves mid-flight; padding columns are trimmed
            written.keep([0, 2])
            stock.keep([0, 2])
        inputs = written.step_inputs()
        assert (inputs["attention_mask"] is None) == (not written.padded)
        got = worker.decode(inputs)
        worker.decode_step = None
        try:
            want = worker.decode(stock.step_inputs())
        finally:
            worker.decode_step = step
        assert torch.equal(got, want), f"step {n}"
        tokens = want.argmax(-1)
        written.advance(tokens)
        stock.advance(tokens)
    for a, b in zip(written.cache.layers, stock.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_lone_unpadded_row_needs_no_mask(worker) -> None:
    batch = running_batch(worker, [(solid_image("white", 64, 64), "Colour?")])
    assert not batch.padded and batch.step_inputs()["attention_mask"] is None


def test_slack_layer_matches_concatenation_and_rarely_reallocates() -> None:
    torch.manual_seed(0)
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    layer = SlackLayer(keys, values)
    buffers = {layer._keys.data_ptr()}
    for _ in range(300):
        k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        got_k, got_v = layer.update(k, v)
        buffers.add(layer._keys.data_ptr())
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert layer.get_seq_length() == 305
    assert len(buffers) <= 6  # grows by a quarter at a time, not once per token
    layer.assign(keys[:1, :, 100:], values[:1, :, 100:])  # a row left and padding was trimmed
    assert torch.equal(layer.keys, keys[:1, :, 100:]) and layer.keys.shape[2] == 205
