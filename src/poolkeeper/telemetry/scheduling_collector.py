"""The scheduler's measurements, read at scrape time from its `SchedulingStats`: plugin
durations (v0.5 and v1.0+ names) and the prefix indexer's size and hit ratios (GIE's
unlabelled names and llm-d-router's, labelled by the producer plugin), and the KV-event path of
each prefix scorer that subscribes (`kv_collector.py`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from poolkeeper.scheduling.stats import HistogramData, SchedulingStats
from poolkeeper.telemetry.kv_collector import kv_event_families


def _histogram(family: HistogramMetricFamily, labels: list[str], *parts: HistogramData) -> None:
    """Add the sum of `parts` (same buckets) as one labelled histogram."""
    bounds = [le for le, _ in parts[0].cumulative()]
    counts = [0.0] * len(bounds)
    total = 0.0
    for part in parts:
        for i, (_, count) in enumerate(part.cumulative()):
            counts[i] += count
        total += part.sum
    family.add_metric(labels, list(zip(bounds, counts, strict=True)), total)


# (plugin_name, plugin_type) of llm-d's prefix-indexer families.
PREFIX_PRODUCER = ["approx-prefix-cache-producer", "approx-prefix-cache-producer"]


class SchedulingCollector(Collector):
    """Plugin durations (v0.5 and v1.0+ names) and the prefix indexer, read at scrape time."""

    def __init__(self, stats: SchedulingStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        v05 = HistogramMetricFamily(
            "inference_extension_scheduler_plugin_duration_seconds",
            "Scheduler plugin processing latency distribution in seconds for each plugin type "
            "and plugin name.",
            labels=["plugin_type", "plugin_name"],
        )
        v10 = HistogramMetricFamily(
            "inference_extension_plugin_duration_seconds",
            "Plugin processing latency distribution in seconds for each extension point, plugin "
            "type and plugin name.",
            labels=["extension_point", "plugin_type", "plugin_name"],
        )
        # v0.5 labelled by (extension point, plugin type): instances of one type add up.
        by_type: dict[tuple[str, str], list[HistogramData]] = {}
        for (point, type_, name), hist in self.stats.plugins():
            _histogram(v10, [point, type_, name], hist)
            by_type.setdefault((point, type_), []).append(hist)
        for (point, type_), hists in by_type.items():
            _histogram(v05, [point, type_], *hists)
        yield v05
        yield v10
        # GIE's unlabelled names, and llm-d's labelled by the producer plugin upstream records
        # them in (poolkeeper's prefix index stands in for it, under its default name).
        for prefix, labels in (("inference_extension_", []), ("llm_d_epp_", PREFIX_PRODUCER)):
            names = ["plugin_name", "plugin_type"] if labels else []
            size = GaugeMetricFamily(
                prefix + "prefix_indexer_size", "Size of the prefix indexer.", labels=names
            )
            size.add_metric(labels, self.stats.prefix_index_size())
            yield size
            ratio = HistogramMetricFamily(
                prefix + "prefix_indexer_hit_ratio",
                "Ratio of prefix length matched to total prefix length in the cache lookup.",
                labels=names,
            )
            _histogram(ratio, labels, self.stats.prefix_hit_ratio)
            yield ratio
            hit_bytes = HistogramMetricFamily(
                prefix + "prefix_indexer_hit_bytes",
                "Length of the prefix match in number of bytes in the cache lookup.",
                labels=names,
            )
            _histogram(hit_bytes, labels, self.stats.prefix_hit_bytes)
            yield hit_bytes
        yield from kv_event_families(self.stats.kv_events())
