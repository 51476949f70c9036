"""Prometheus exposition of a cache's stats, read at scrape time (no second set of counters).

``serve_metrics(cache, port)`` starts prometheus-client's HTTP endpoint on its own thread; the
collector snapshots ``cache.stats()`` on each scrape, so the hot path pays nothing for metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvtier.metrics import LATENCY_BUCKETS, CacheStats

PREFIX = "kvtier"

_TIER_COUNTERS = (
    ("hits", "blocks served from the tier"),
    ("misses", "blocks a load asked the tier for (not found above it) that it did not serve"),
    ("stores", "blocks written to the tier (new stores, demotions and promotions in)"),
    ("failed_stores", "writes the tier refused or failed"),
    ("evictions", "blocks evicted from the tier"),
    ("demotions_out", "evicted blocks copied to a lower tier"),
    ("promotions_in", "lower-tier hits copied into the tier"),
    ("corrupt_or_lost", "blocks the index listed that the tier could not return (corrupt, deleted)"),
    ("bytes_read", "bytes read from the tier"),
    ("bytes_written", "bytes written to the tier"),
)


class KVTierCollector(Collector):
    """Turns a :class:`CacheStats` snapshot into metric families labelled by tier."""

    def __init__(self, snapshot: Callable[[], CacheStats], namespace: str = "") -> None:
        self._snapshot = snapshot
        self._namespace = namespace

    def collect(self) -> Iterator[Any]:
        stats = self._snapshot()
        ns = self._namespace
        for name, value, doc in (
                ("lookups", stats.lookups, "lookup calls"),
                ("lookup_blocks", stats.lookup_blocks, "blocks asked about by lookups"),
                ("lookup_hit_blocks", stats.lookup_hit_blocks, "leading blocks lookups found cached"),
                ("load_blocks", stats.load_blocks, "blocks asked for by loads"),
                ("loaded_blocks", stats.loaded_blocks, "blocks loaded bit-exact"),
                ("stored_blocks", stats.stored_blocks, "blocks stored")):
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["namespace"])
            family.add_metric([ns], value)
            yield family
        labels = ["namespace", "tier", "kind"]
        for attr, doc in _TIER_COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_tier_{attr}", doc, labels=labels)
            for t in stats.tiers:
                family.add_metric([ns, t.name, t.kind], getattr(t, attr))
            yield family
        errors = CounterMetricFamily(f"{PREFIX}_tier_errors", "tier errors by kind",
                                     labels=[*labels, "error"])
        usage = GaugeMetricFamily(f"{PREFIX}_tier_usage_bytes", "bytes held (raw block size)", labels=labels)
        capacity = GaugeMetricFamily(f"{PREFIX}_tier_capacity_bytes", "configured capacity", labels=labels)
        healthy = GaugeMetricFamily(f"{PREFIX}_tier_healthy", "1 when the tier works, 0 while degraded",
                                    labels=labels)
        latency = HistogramMetricFamily(f"{PREFIX}_tier_op_seconds", "latency of batched tier operations",
                                        labels=[*labels, "op"])
        for t in stats.tiers:
            base = [ns, t.name, t.kind]
            for kind, count in sorted(t.errors.items()):
                errors.add_metric([*base, kind], count)
            usage.add_metric(base, t.usage_bytes)
            healthy.add_metric(base, 1 if t.health == "ok" else 0)
            capacity.add_metric(base, t.capacity_bytes)
            for op, hist in sorted(t.latency.items()):
                cumulative, buckets = 0, []
                for bound, count in zip((*LATENCY_BUCKETS, float("inf")), hist.counts, strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                latency.add_metric([*base, op], buckets, hist.total_seconds)
        yield from (errors, usage, capacity, healthy, latency)


class MetricsServer:
    """The HTTP endpoint ``http://address:port/metrics`` for one cache; :meth:`close` stops it."""

    def __init__(self, snapshot: Callable[[], CacheStats], port: int, address: str = "127.0.0.1",
                 namespace: str = "") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(KVTierCollector(snapshot, namespace))
        self._server, self._thread = start_http_server(port, addr=address, registry=self.registry)
        self.address, self.port = self._server.server_address[:2]

    @property
    def url(self) -> str:
        return f"http://{self.address!s}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
