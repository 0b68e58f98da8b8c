"""The pool gauges, read at scrape time from the pools' stats (`PoolStats`, made by
`server/stats_views.py`): upstream's `inference_pool_*`, llm-d-router's standard deviations,
and the admission detector's saturation and stale endpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class PoolStats:
    name: str  # the pool's name (upstream label `name`)
    average_kv_cache_utilization: float
    average_queue_size: float
    ready_pods: int
    # (endpoint name, waiting requests) for `inference_pool_per_pod_queue_size`
    per_pod_queue_size: tuple[tuple[str, float], ...] = ()
    average_running_requests: float = 0.0
    # Population standard deviations over the pool's endpoints (llm-d-router's std_dev_*).
    std_dev_kv_cache_utilization: float = 0.0
    std_dev_queue_size: float = 0.0
    std_dev_running_requests: float = 0.0
    # The admission detector's view (upstream's flow_control_pool_saturation and
    # flow_control_stale_endpoints): mean saturation, stale endpoints counting 1.0.
    saturation: float | None = None
    stale_endpoints: int = 0


class PoolCollector(Collector):
    def __init__(self, source: Callable[[], Iterable[PoolStats]]) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization",
            "The average kv cache utilization for an inference server pool.",
            labels=["name"],
        )
        queue = GaugeMetricFamily(
            "inference_pool_average_queue_size",
            "The average number of requests pending in the model server queue.",
            labels=["name"],
        )
        ready = GaugeMetricFamily(
            "inference_pool_ready_pods",
            "The number of ready pods in the inference server pool.",
            labels=["name"],
        )
        per_pod = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            "The total number of requests pending in the model server queue for each "
            "underlying pod.",
            labels=["name", "model_server_pod"],
        )
        running = GaugeMetricFamily(
            "inference_pool_average_running_requests",
            "The average number of requests running on the model servers of the pool.",
            labels=["name"],
        )
        spreads = {
            field: GaugeMetricFamily(
                f"llm_d_epp_{field}", f"The pool's {what} standard deviation.", labels=["name"]
            )
            for field, what in (
                ("std_dev_kv_cache_utilization", "kv cache utilization"),
                ("std_dev_queue_size", "queue size"),
                ("std_dev_running_requests", "running requests"),
            )
        }
        saturation = GaugeMetricFamily(
            "inference_extension_flow_control_pool_saturation",
            "Pool saturation gating dispatch (1.0: the set point), by pool and stage.",
            labels=["inference_pool", "stage"],
        )
        stale = GaugeMetricFamily(
            "llm_d_epp_flow_control_stale_endpoints",
            "Endpoints whose metrics are missing or stale, by saturation detector.",
            labels=["detector"],
        )
        stale_total = 0
        for stats in self.source():
            if stats.saturation is not None:
                # One stage: poolkeeper pools are monolithic (upstream: all endpoints decode).
                for stage in ("decode", "effective"):
                    saturation.add_metric([stats.name, stage], stats.saturation)
            stale_total += stats.stale_endpoints
            kv.add_metric([stats.name], stats.average_kv_cache_utilization)
            queue.add_metric([stats.name], stats.average_queue_size)
            ready.add_metric([stats.name], stats.ready_pods)
            running.add_metric([stats.name], stats.average_running_requests)
            for field, family in spreads.items():
                family.add_metric([stats.name], getattr(stats, field))
            for pod, size in stats.per_pod_queue_size:
                per_pod.add_metric([stats.name, pod], size)
        yield kv
        yield queue
        yield ready
        yield per_pod
        yield running
        yield from spreads.values()
        stale.add_metric(["utilization-detector"], stale_total)
        yield saturation
        yield stale
