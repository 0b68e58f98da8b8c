"""The flow-control queue gauges, at scrape time: requests and bytes waiting per flow
(`flow_control_queue_size` / `_bytes`, labelled as llm-d-router's: fairness id, priority,
pool, model, target) and each band's share of its bounds (`flow_control_capacity_utilization_*`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from poolkeeper.api.criticality import Criticality

# A band's `priority` label (its band-level gauges): poolkeeper's three bands each serve a
# range of InferenceObjective priorities (> 0, 0, < 0: api/criticality.py), labelled by the
# priority that stands for the range. Per-request families carry the request's own priority.
BAND_PRIORITY: Mapping[Criticality, str] = {
    Criticality.CRITICAL: "1",
    Criticality.STANDARD: "0",
    Criticality.SHEDDABLE: "-1",
}
QUEUE_LABELS = ["fairness_id", "priority", "inference_pool", "model_name", "target_model_name"]


@dataclass(frozen=True, slots=True)
class FlowQueue:
    """One flow's requests waiting in one band (upstream's per-flow queue gauges)."""

    fairness_id: str
    priority: int  # the requests' InferenceObjective priority (0 when none applies)
    model: str
    target: str
    requests: int
    bytes: int


@dataclass(frozen=True, slots=True)
class QueueStats:
    """One band of one pool's flow-control queue, at scrape time."""

    pool: str  # the pool's name (upstream label `inference_pool`)
    band: Criticality
    requests: int
    bytes: int
    # The band's bounds per pool (maxRequests, maxBytes); 0: unknown, no utilization ratio.
    max_requests: int = 0
    max_bytes: int = 0
    flows: tuple[FlowQueue, ...] = ()  # what waits, by flow
    held: int = 0  # held in front of the queue by `holdNewPrefixes` (not in `requests`)


class QueueCollector(Collector):
    """The queue gauges by flow, as upstream's (a series seen once stays, at 0 when its flow
    has nothing waiting: upstream's gauges go back to 0 the same way); label values capped."""

    def __init__(
        self, source: Callable[[], Iterable[QueueStats]], cap: Callable[[str, str], str]
    ) -> None:
        self.source = source
        self.cap = cap
        self._seen: dict[tuple[str, ...], None] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily(
            "inference_extension_flow_control_queue_size",
            "Requests waiting in the flow-control queue, by flow, priority, pool and model.",
            labels=QUEUE_LABELS,
        )
        size_bytes = GaugeMetricFamily(
            "inference_extension_flow_control_queue_bytes",
            "Request bytes waiting in the flow-control queue, by flow, priority, pool and model.",
            labels=QUEUE_LABELS,
        )
        # llm-d-router's names only (no older twins): the fraction of the band's bounds used.
        used = {
            unit: GaugeMetricFamily(
                f"llm_d_epp_flow_control_capacity_utilization_{unit}",
                f"Fraction of a priority band's {unit} capacity in use (0-1), per pool.",
                labels=["priority", "inference_pool"],
            )
            for unit in ("requests", "bytes")
        }
        held = GaugeMetricFamily(
            "poolkeeper_flow_control_held_requests",
            "Requests holdNewPrefixes holds in front of the flow-control queue, per pool "
            "(not counted in the queue size).",
            labels=["inference_pool"],
        )
        held_by_pool: dict[str, int] = {}
        now: dict[tuple[str, ...], tuple[int, int]] = {}
        key: tuple[str, ...]
        for stats in self.source():
            held_by_pool[stats.pool] = held_by_pool.get(stats.pool, 0) + stats.held
            for flow in stats.flows:
                key = (
                    self.cap("fairness_id", flow.fairness_id),
                    str(flow.priority),
                    stats.pool,
                    self.cap("model_name", flow.model),
                    self.cap("target_model_name", flow.target),
                )
                requests, size_ = now.get(key, (0, 0))
                now[key] = (requests + flow.requests, size_ + flow.bytes)
            priority = BAND_PRIORITY[stats.band]
            if stats.max_requests:
                ratio = stats.requests / stats.max_requests
                used["requests"].add_metric([priority, stats.pool], ratio)
            if stats.max_bytes:
                used["bytes"].add_metric([priority, stats.pool], stats.bytes / stats.max_bytes)
        self._seen.update(dict.fromkeys(now))
        for key in self._seen:
            requests, size_ = now.get(key, (0, 0))
            size.add_metric(list(key), requests)
            size_bytes.add_metric(list(key), size_)
        for pool, n in held_by_pool.items():
            held.add_metric([pool], n)
        yield size
        yield size_bytes
        yield from used.values()
        yield held
