"""Prometheus metrics: names, labels and values, fed by real engine Request objects."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from support import checked

from vlm_demo.engine.batching.job import Request
from vlm_demo.engine.ipc.handles import EngineStream, StreamTable
from vlm_demo.engine.ipc.messages import Ended, Step
from vlm_demo.errors import OutOfMemoryError
from vlm_demo.request import SamplingParams
from vlm_demo.web.metrics import TRAFFIC, CacheCounts, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Parse our own exposition text back, as Prometheus would."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def finished_request(tokens: int, reason: str = "stop") -> EngineStream:
    """A client's handle to an engine request that finished, as the engine's Step delivers it."""
    request = Request(image=None, question="q", params=checked(SamplingParams()))
    request.token_ids = list(range(tokens))
    request.push_text("x" * tokens)
    request.finish(reason)
    table = StreamTable(cancel=lambda rid: None)
    handle = table.open()
    table.apply(Step(ended=[Ended(handle.rid, request.result)]))
    return handle


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


def test_the_key_value_traffic_counters_read_the_engines_totals() -> None:
    counts = CacheCounts(kv_copied_bytes=10, kv_written_bytes=20, attention_read_bytes=33, attention_live_bytes=30)
    got = samples(Metrics(caches=lambda: counts))
    assert set(TRAFFIC) == {
        "vlm_kv_copied_bytes",
        "vlm_kv_written_bytes",
        "vlm_attention_read_bytes",
        "vlm_attention_live_bytes",
    }
    assert [got[(f"{name}_total", ())] for name in TRAFFIC] == [10, 20, 33, 30]


def test_requests_are_counted_by_outcome_with_tokens_and_latency() -> None:
    m = Metrics()
    for request in (finished_request(5), finished_request(7, "length")):
        m.on_request_done(request)
    table = StreamTable(cancel=lambda rid: None)
    cancelled, failed = table.open(), table.open()
    cancelled.cancel()
    m.on_request_done(cancelled)
    table.apply(Step(ended=[Ended(failed.rid, None, OutOfMemoryError("no memory"))]))
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
