"""Prometheus metrics: names, labels and values, fed by real engine Request objects."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from vlm_demo.engine.request import Request
from vlm_demo.errors import OutOfMemoryError
from vlm_demo.request import SamplingParams
from vlm_demo.web.metrics import Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Parse our own exposition text back, as Prometheus would."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def finished_request(tokens: int, reason: str = "stop") -> Request:
    request = Request(image=None, question="q", params=SamplingParams())
    request.token_ids = list(range(tokens))
    request.push_text("x" * tokens)
    request.finish(reason)
    return request


def test_exposes_the_contract_names() -> None:
    text = Metrics(queue_depth=lambda: 3).render().decode()
    for name in (
        "vlm_requests_total",
        "vlm_queue_depth",
        "vlm_batch_size_bucket",
        "vlm_request_latency_seconds_bucket",
        "vlm_time_to_first_token_seconds_bucket",
        "vlm_generated_tokens_total",
    ):
        assert name in text, name
    assert "vlm_queue_depth 3.0" in text


def test_requests_are_counted_by_outcome_with_tokens_and_latency() -> None:
    m = Metrics()
    for request in (finished_request(5), finished_request(7, "length")):
        m.on_request_done(request)
    cancelled = Request(image=None, question="q", params=SamplingParams())
    cancelled.cancel()
    m.on_request_done(cancelled)
    failed = Request(image=None, question="q", params=SamplingParams())
    failed.fail(OutOfMemoryError("no memory"))
    m.on_request_done(failed)
    m.rejected("invalid_request")
    s = samples(m)
    for outcome in ("ok", "length", "cancelled", "out_of_memory", "invalid_request"):
        assert s[("vlm_requests_total", (("outcome", outcome),))] == 1, outcome
    assert s[("vlm_generated_tokens_total", ())] == 12  # failed and cancelled requests add none
    assert s[("vlm_request_latency_seconds_count", ())] == 2
    assert s[("vlm_time_to_first_token_seconds_count", ())] == 2


def test_batch_size_histogram_gives_the_mean() -> None:
    m = Metrics()
    for size in (1, 4, 4, 3):
        m.on_batch(size)
    s = samples(m)
    assert s[("vlm_batch_size_count", ())] == 4
    assert s[("vlm_batch_size_sum", ())] / s[("vlm_batch_size_count", ())] == 3.0
    assert s[("vlm_batch_size_bucket", (("le", "2.0"),))] == 1


def test_each_app_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.on_batch(2)
    assert samples(a)[("vlm_batch_size_count", ())] == 1
    assert samples(b)[("vlm_batch_size_count", ())] == 0


def test_unreachable_queue_depth_does_not_break_a_scrape() -> None:
    def broken() -> int:
        raise ConnectionError("triton is down")  # stands in for an unreachable remote backend

    value = samples(Metrics(queue_depth=broken))[("vlm_queue_depth", ())]
    assert value != value  # NaN: "unknown", rather than a failed scrape or a misleading 0
