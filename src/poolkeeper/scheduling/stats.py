"""Scheduler self-measurements: per-plugin durations and prefix-index lookups.

Plain Python (the scheduling package does not import prometheus_client): the scheduler records
into `SchedulingStats`, and the gateway's metrics endpoint turns it into upstream's families at
scrape time (`inference_extension_scheduler_plugin_duration_seconds`,
`inference_extension_plugin_duration_seconds`, `inference_extension_prefix_indexer_*`, and
the KV-event families of each prefix scorer with kvEvents: `telemetry/kv_collector.py`).
A plugin timer's recording is a list append (bucketed when read, `HistogramData`), so it stays
on for every decision.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from functools import reduce
from operator import add
from typing import Final

from poolkeeper.scheduling.kvstats import KVEventsReading

# Upstream's buckets (pkg/epp/metrics/metrics.go@v0.5.1).
PLUGIN_DURATION_BUCKETS: Final = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
)  # fmt: skip
PREFIX_HIT_RATIO_BUCKETS: Final = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
PREFIX_HIT_BYTES_BUCKETS: Final = (
    0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
)  # fmt: skip

# Extension points, named as upstream names them (pkg/epp/scheduling/framework/plugins.go).
FILTER: Final = "Filter"
SCORER: Final = "Scorer"
PICKER: Final = "Picker"
POST_CYCLE: Final = "PostCycle"


class HistogramData:
    """Cumulative-at-read histogram: `counts[i]` = observations in (bounds[i-1], bounds[i]].

    `observe` buckets a value at once. `record` (a plugin timer's, on every decision) only
    appends it to `pending`, a C-level call where `observe` is a Python frame, a bisect and
    three updates per plugin per request; `fold` buckets what is pending, in order (so the sum
    is the same float), and every reader folds first. Whoever records folds at a bound
    (`SchedulerProfile` folds one of its timers every `FOLD_EVERY`-th run, in turn), so
    `pending` stays short without a scrape.
    One thread, as the request path and the metrics endpoint share the event loop."""

    __slots__ = ("_count", "_counts", "_sum", "bounds", "pending", "record")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._count = 0
        self.pending: list[float] = []
        self.record: Callable[[float], None] = self.pending.append

    def observe(self, value: float) -> None:
        if self.pending:  # recorded values first: the sum adds up in order
            self.fold()
        self._counts[bisect_left(self.bounds, value)] += 1
        self._sum += value
        self._count += 1

    def fold(self) -> None:
        """Bucket the values `record` appended, oldest first."""
        pending = self.pending
        n = len(pending)
        if not n:
            return
        values = pending[:n]
        del pending[:n]  # not `clear`: `record` is this list's append
        bounds, counts = self.bounds, self._counts
        if max(values) <= bounds[0]:  # (a plugin's durations: mostly all in the first bucket)
            counts[0] += n
        else:
            for value in values:
                counts[bisect_left(bounds, value)] += 1
        self._sum = reduce(add, values, self._sum)  # in order, C-level: the same float
        self._count += n

    @property
    def counts(self) -> list[int]:
        self.fold()
        return self._counts

    @property
    def sum(self) -> float:
        self.fold()
        return self._sum

    @property
    def count(self) -> int:
        self.fold()
        return self._count

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs as Prometheus exposes them, `+Inf` last."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class SchedulingStats:
    """What one scheduler measured since it was built."""

    __slots__ = ("_kv_events", "_plugins", "_prefix_sizes", "prefix_hit_bytes", "prefix_hit_ratio")

    def __init__(self) -> None:
        self._plugins: dict[tuple[str, str, str], HistogramData] = {}
        self._prefix_sizes: list[Callable[[], int]] = []
        self._kv_events: list[tuple[str, Callable[[], KVEventsReading]]] = []
        self.prefix_hit_ratio = HistogramData(PREFIX_HIT_RATIO_BUCKETS)
        self.prefix_hit_bytes = HistogramData(PREFIX_HIT_BYTES_BUCKETS)

    def plugin(self, extension_point: str, plugin_type: str, name: str) -> HistogramData:
        """The duration histogram of one plugin at one extension point (made on first use)."""
        key = (extension_point, plugin_type, name)
        hist = self._plugins.get(key)
        if hist is None:
            hist = self._plugins[key] = HistogramData(PLUGIN_DURATION_BUCKETS)
        return hist

    def plugins(self) -> Iterator[tuple[tuple[str, str, str], HistogramData]]:
        return iter(list(self._plugins.items()))

    def add_prefix_index(self, size: Callable[[], int]) -> None:
        """Count an index's entries into `inference_extension_prefix_indexer_size`."""
        self._prefix_sizes.append(size)

    def add_kv_events(self, plugin_name: str, read: Callable[[], KVEventsReading]) -> None:
        """A KV-event subscription and its exact index, read at scrape time as `plugin_name`'s
        (a prefix scorer with kvEvents)."""
        self._kv_events.append((plugin_name, read))

    def kv_events(self) -> list[tuple[str, KVEventsReading]]:
        return [(name, read()) for name, read in self._kv_events]

    def prefix_index_size(self) -> int:
        return sum(size() for size in self._prefix_sizes)

    def prefix_match(self, matched_bytes: int, total_bytes: int) -> None:
        """One lookup for the endpoint picked (upstream records it after the pick)."""
        self.prefix_hit_bytes.observe(matched_bytes)
        if total_bytes > 0:
            self.prefix_hit_ratio.observe(matched_bytes / total_bytes)
