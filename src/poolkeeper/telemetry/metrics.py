"""Prometheus metrics of the gateway, with the upstream EPP's names and labels (gie.md §4.2).

Each `GatewayMetrics` owns its own `CollectorRegistry` (never the global one), so several
gateways, tests and the quickstart can live in one process. It implements the ext_proc
`ExchangeObserver` hooks. Pool gauges are computed at scrape time from a callable, so no loop
has to keep them fresh. Label values that come from clients (model names) are capped: after
`max_label_values` distinct values per label, new ones are reported as "other".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from poolkeeper.errors import GatewayError
from poolkeeper.requestcontrol.types import RoutingDecision, Usage

OTHER = "other"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DURATION_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20,
    30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
SIZE_BUCKETS = tuple(float(64 << (2 * i)) for i in range(13))  # 64 B .. 1 GiB, x4 steps
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
SCHEDULER_BUCKETS = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip


class LabelCap:
    """Admits at most `limit` distinct values; the rest collapse into "other"."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self.limit:
            return OTHER
        self._seen.add(value)
        return value


@dataclass(frozen=True, slots=True)
class PoolStats:
    name: str  # the pool's name (upstream label `name`)
    average_kv_cache_utilization: float
    average_queue_size: float
    ready_pods: int


class _PoolCollector(Collector):
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
        for stats in self.source():
            kv.add_metric([stats.name], stats.average_kv_cache_utilization)
            queue.add_metric([stats.name], stats.average_queue_size)
            ready.add_metric([stats.name], stats.ready_pods)
        yield kv
        yield queue
        yield ready


class GatewayMetrics:
    """The EPP's metrics; pass it as the ext_proc observer."""

    def __init__(
        self,
        *,
        pool_stats: Callable[[], Iterable[PoolStats]] | None = None,
        max_label_values: int = 100,
    ) -> None:
        self.registry = CollectorRegistry()
        self._model = LabelCap(max_label_values)
        self._target = LabelCap(max_label_values)
        r = self.registry
        model_labels = ["model_name", "target_model_name"]
        self.request_total = Counter(
            "inference_model_request",
            "Counter of inference model requests broken out for each model and target model.",
            model_labels,
            registry=r,
        )
        self.request_error_total = Counter(
            "inference_model_request_error",
            "Counter of inference model requests errors broken out for each model and target "
            "model.",
            [*model_labels, "error_code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "inference_model_request_duration_seconds",
            "Inference model response latency distribution in seconds for each model and target "
            "model.",
            model_labels,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.request_sizes = Histogram(
            "inference_model_request_sizes",
            "Inference model requests size distribution in bytes for each model and target model.",
            model_labels,
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.response_sizes = Histogram(
            "inference_model_response_sizes",
            "Inference model responses size distribution in bytes for each model and target model.",
            model_labels,
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            "inference_model_input_tokens",
            "Inference model input token count distribution for requests in each model.",
            model_labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "inference_model_output_tokens",
            "Inference model output token count distribution for requests in each model.",
            model_labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.running_requests = Gauge(
            "inference_model_running_requests",
            "Inference model number of running requests in each model.",
            ["model_name"],
            registry=r,
        )
        self.scheduler_duration = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end routing decision latency (model resolution, admission, scheduling).",
            buckets=SCHEDULER_BUCKETS,
            registry=r,
        )
        if pool_stats is not None:
            r.register(_PoolCollector(pool_stats))

    def _labels(self, decision: RoutingDecision) -> tuple[str, str]:
        return self._model(decision.model_name), self._target(decision.target_model)

    # -- ExchangeObserver -------------------------------------------------------------------
    def routed(self, decision: RoutingDecision, request_bytes: int, route_seconds: float) -> None:
        self.scheduler_duration.observe(route_seconds)
        if not decision.model_name:
            return  # header-only requests carry no model: not an inference request
        model, target = self._labels(decision)
        self.request_total.labels(model, target).inc()
        self.request_sizes.labels(model, target).observe(request_bytes)
        self.running_requests.labels(model).inc()

    def rejected(self, model_name: str, error: GatewayError, request_bytes: int) -> None:
        self.request_error_total.labels(self._model(model_name), "", error.code).inc()

    def finished(
        self,
        decision: RoutingDecision,
        *,
        status: int,
        usage: Usage | None,
        seconds: float,
        response_bytes: int,
    ) -> None:
        if not decision.model_name:
            return
        model, target = self._labels(decision)
        self.running_requests.labels(model).dec()
        if status >= 400 or status == 0:
            code = "Cancelled" if status == 499 else "ModelServerError"
            self.request_error_total.labels(model, target, code).inc()
            return
        self.request_duration.labels(model, target).observe(seconds)
        self.response_sizes.labels(model, target).observe(response_bytes)
        if usage is not None:
            self.input_tokens.labels(model, target).observe(usage.prompt_tokens)
            self.output_tokens.labels(model, target).observe(usage.completion_tokens)

    # -- exposition -------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def app(self) -> web.Application:
        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app
