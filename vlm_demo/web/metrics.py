"""Prometheus metrics for one app, fed by the backend's listener hooks and by the UI's front door.

Each :class:`Metrics` owns its own ``CollectorRegistry`` (not the process-global one) so that tests,
or a process serving several apps, never collide on metric names. Requests the backend ran are
counted from ``on_request_done``; requests refused before they reached the backend (bad input, full
queue) are counted by the UI through :meth:`Metrics.rejected`, so each request is counted once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vlm_demo.stream import Stream

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


def outcome_of(request: Stream) -> str:
    """One label per way a request can end: ``ok``, ``length`` (hit max_new_tokens), or an error code."""
    if request.error is not None:
        return request.error.code
    return "length" if request.finish_reason == "length" else "ok"


@dataclass(frozen=True)
class CacheCounts:
    """What the caches have done, read at each scrape (the engine's side arrives with its stats): lookups,
    and the bytes the key/value cache moved, wrote and had read (the page pool's traffic)."""

    response_hits: int = 0
    response_misses: int = 0
    response_entries: int = 0
    image_hits: int = 0
    image_misses: int = 0
    vision_encodes: int = 0
    vision_tiles: int = 0
    kv_copied_bytes: int = 0
    kv_written_bytes: int = 0
    attention_read_bytes: int = 0
    attention_live_bytes: int = 0
    picture_states_bytes: int = 0  # a gauge: what the pool holds for pictures now


TRAFFIC: dict[str, tuple[Callable[[CacheCounts], int], str]] = {  # counter (exposed with _total) -> (value, help)
    "vlm_kv_copied_bytes": (
        lambda c: c.kv_copied_bytes,
        "Bytes of keys/values and image states moved because rows joined, left or were preempted.",
    ),
    "vlm_kv_written_bytes": (lambda c: c.kv_written_bytes, "Bytes of keys/values written for generated tokens."),
    "vlm_attention_read_bytes": (
        lambda c: c.attention_read_bytes,
        "Bytes of keys/values and image states the decode steps' attention read.",
    ),
    "vlm_attention_live_bytes": (
        lambda c: c.attention_live_bytes,
        "The live part of what decode attention read: each row's real tokens and the tiles it sees.",
    ),
}


class _CacheCollector:
    """``vlm_cache_requests_total{cache,result}``, ``vlm_response_cache_entries``, ``vlm_vision_encodes_total``,
    ``vlm_vision_tiles_total``, the key/value traffic counters (:data:`TRAFFIC`) and the ``vlm_picture_states_bytes``
    gauge, from counts kept elsewhere (the response cache in this process, the
    image-state cache and the page pool in the engine's)."""

    def __init__(self, read: Callable[[], CacheCounts]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        try:
            counts = self.read()
        except Exception as err:  # a scrape must not fail because the backend is briefly unreachable
            log.warning("cache counts unavailable: %r", err)
            counts = CacheCounts()
        cache = CounterMetricFamily(
            "vlm_cache_requests", "Cache lookups by cache and result.", labels=["cache", "result"]
        )
        cache.add_metric(["response", "hit"], counts.response_hits)
        cache.add_metric(["response", "miss"], counts.response_misses)
        cache.add_metric(["image", "hit"], counts.image_hits)
        cache.add_metric(["image", "miss"], counts.image_misses)
        yield cache
        yield GaugeMetricFamily(
            "vlm_response_cache_entries", "Answers the response cache holds.", value=counts.response_entries
        )
        yield CounterMetricFamily(
            "vlm_vision_encodes", "Images run through the vision tower.", value=counts.vision_encodes
        )
        yield CounterMetricFamily(
            "vlm_vision_tiles",
            "Tiles the vision tower encoded (each picture's real tiles with --vision-tiles real).",
            value=counts.vision_tiles,
        )
        for name, (value, text) in TRAFFIC.items():
            yield CounterMetricFamily(name, text, value=value(counts))
        yield GaugeMetricFamily(
            "vlm_picture_states_bytes",
            "Bytes of cross-attention keys/values the page pool holds for pictures (a picture rows share, once).",
            value=counts.picture_states_bytes,
        )


class _InfoCollector:
    """``vlm_weights_info{weights="int8"} 1``, ``vlm_decode_attention_info{kernel="triton"} 1``: how the served
    model runs, read at each scrape (nothing while unknown: a remote Triton model, a dynamic engine)."""

    def __init__(self, name: str, text: str, label: str, read: Callable[[], str]) -> None:
        self.name, self.text, self.label, self.read = name, text, label, read

    def collect(self) -> Iterator[Metric]:
        try:
            value = self.read()
        except Exception as err:  # a scrape must not fail because the backend is briefly unreachable
            log.warning("%s unavailable: %r", self.label, err)
            value = ""
        info = GaugeMetricFamily(self.name, self.text, labels=[self.label])
        if value:
            info.add_metric([value], 1)
        yield info


class Metrics:
    """The ``vlm_*`` metrics; also a backend listener (``on_batch`` / ``on_request_done``)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        queue_depth: Callable[[], int] | None = None,
        caches: Callable[[], CacheCounts] | None = None,
        weights: Callable[[], str] | None = None,
        decode_attention: Callable[[], str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "vlm_requests", "Requests by how they ended.", ["outcome"], registry=self.registry
        )  # exposed as vlm_requests_total
        self.queue_depth = Gauge("vlm_queue_depth", "Requests waiting for the model.", registry=self.registry)
        self.batch_size = Histogram(
            "vlm_batch_size", "Requests per model batch.", buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.latency = Histogram(
            "vlm_request_latency_seconds",
            "Submit to last token, for requests that finished.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "vlm_time_to_first_token_seconds",
            "Submit to first streamed token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter("vlm_generated_tokens", "Tokens generated.", registry=self.registry)
        if queue_depth is not None:
            self.queue_depth.set_function(lambda: _safe(queue_depth))
        self.registry.register(_CacheCollector(caches or CacheCounts))
        self.registry.register(_InfoCollector(
            "vlm_weights_info", "How the model's weights are stored: fp8, int8, int4 or the dtype.", "weights",
            weights or str,
        ))  # fmt: skip
        self.registry.register(_InfoCollector(
            "vlm_decode_attention_info", "The continuous engine's decode attention: flash, triton or reference.",
            "kernel", decode_attention or str,
        ))  # fmt: skip

    # ---- backend listener ---------------------------------------------------------------------
    def on_batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def on_request_done(self, request: Stream) -> None:
        outcome = outcome_of(request)
        self.requests.labels(outcome=outcome).inc()
        if outcome not in ("ok", "length"):
            return
        result = request.result(0)
        self.latency.observe(result.total_s)
        self.ttft.observe(result.ttft_s)
        self.tokens.inc(result.completion_tokens)

    # ---- the UI's front door -------------------------------------------------------------------
    def rejected(self, code: str) -> None:
        """A request refused before it reached the backend (invalid input, full queue)."""
        self.requests.labels(outcome=code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _safe(read: Callable[[], int]) -> float:
    """A scrape must not fail because the backend is briefly unreachable."""
    try:
        return float(read())
    except Exception as err:
        log.warning("queue depth unavailable: %r", err)
        return float("nan")
