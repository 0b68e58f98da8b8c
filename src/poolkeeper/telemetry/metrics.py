"""Prometheus metrics of the gateway, with the upstream EPP's names, labels and buckets
(`pkg/epp/metrics/metrics.go@v0.5.1`, gie.md §4.2), so upstream dashboards and alerts work.

Each `GatewayMetrics` owns its own `CollectorRegistry` (never the global one), so several
gateways, tests and the quickstart can live in one process. It implements the ext_proc
`ExchangeObserver` hooks. Pool gauges and the scheduler's plugin/prefix-index measurements are
read at scrape time from callables, so no loop has to keep them fresh. Label values that come
from clients are capped as upstream caps them: model names (`model_name` and
`target_model_name` share `max_label_values` values) and fairness ids
(`fairness_id_label_limit`); past the cap, new ones are reported as "other". Each value is
sanitised first (control characters replaced, at most `MAX_LABEL_CHARS` characters), so neither
many names nor long ones can bloat /metrics.

Exposition differs from prometheus_client's default in two ways, both to look like upstream's
Go client: no `_created` series, and (unless `objective_names=False`) every `inference_model_*`
family is also exposed as `inference_objective_*`, the v1.1+ name, with the same samples.
llm-d-router's `llm_d_epp_*` families come beside them (`telemetry/llmd.py`), the flow-control
ones labelled as upstream's: the flow's fairness id, the request's priority (a number), the
pool, model and target.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from poolkeeper import __version__
from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import FilteredOut, GatewayError
from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.scheduling.stats import HistogramData, SchedulingStats
from poolkeeper.telemetry.children import Counter, Gauge, Histogram
from poolkeeper.telemetry.flowqueue import QueueCollector, QueueStats
from poolkeeper.telemetry.llmd import ALSO_AS, LlmdRequestMetrics
from poolkeeper.telemetry.llmd_families import (
    ALSO_AS as FAMILIES_ALSO_AS,
    LlmdFamilies,
    ScrapeErrors,
)

OTHER = "other"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DURATION_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20,
    30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
REQUEST_SIZE_BUCKETS = tuple(float(64 << i) for i in range(25))  # 64 B .. 1 GiB, x2 steps
# Upstream's response-size and input-token buckets say 32778 where 32768 was meant; kept so
# that bucket boundaries (and dashboards built on them) are identical.
RESPONSE_SIZE_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
)  # fmt: skip
INPUT_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
    262144, 524288, 1048576,
)  # fmt: skip
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
MODEL_PREFIX = "inference_model_"
OBJECTIVE_PREFIX = "inference_objective_"


MAX_LABEL_CHARS = 128  # longer client-supplied label values are cut (with a "..." marker)


def sanitize_label(value: str, limit: int = MAX_LABEL_CHARS) -> str:
    """A client-supplied label value made safe: control characters become "?", and a value
    longer than `limit` characters is cut to `limit` ending in "..."."""
    if value.isprintable() and len(value) <= limit:
        return value
    clean = "".join(c if c.isprintable() else "?" for c in value[: limit + 1])
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


class LabelCap:
    """Admits at most `limit` distinct (sanitised) values; the rest collapse into "other"."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        # Empty stays empty (as upstream's bound); one admitted before is clean already.
        if not value or value in self._seen:
            return value
        value = sanitize_label(value)
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


@dataclass(frozen=True, slots=True)
class ObserverStats:
    """The response observer's waiting room (extproc/accesslog.py), read at scrape time."""

    waiting: int  # routed requests whose response has not been reported yet
    settled: int  # ended by their access-log entry
    given_up: int  # settled as unknown: over the limit or the TTL (entries lost)


class _RefusedCollector(Collector):
    def __init__(self, source: Callable[[], int]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "inference_extension_epp_refused_calls",
            "gRPC calls to the EPP refused: they lacked the token of the Envoy serve runs.",
            value=self.source(),
        )


class _StreamsCollector(Collector):
    def __init__(self, source: Callable[[], tuple[int, int]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        held, refused = self.source()
        yield GaugeMetricFamily(
            "poolkeeper_extproc_streams", "ext_proc streams the EPP holds now.", value=held
        )
        yield CounterMetricFamily(
            "poolkeeper_extproc_streams_refused",
            "ext_proc streams refused with RESOURCE_EXHAUSTED at requestHandling.maxStreams.",
            value=refused,
        )


class _ClientConnectionsCollector(Collector):
    def __init__(self, source: Callable[[], tuple[int, int, int, int]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        held, addresses, refused, untracked = self.source()
        prefix = "poolkeeper_client_connections"
        yield GaugeMetricFamily(prefix, "Client connections counted by address now.", value=held)
        yield GaugeMetricFamily(
            f"{prefix}_addresses", "Client addresses holding counted connections.", value=addresses
        )
        yield CounterMetricFamily(
            f"{prefix}_refused",
            "Connections closed at edge.maxConnectionsPerClient.",
            value=refused,
        )
        yield CounterMetricFamily(
            f"{prefix}_untracked", "Connections let in uncounted: the table was full.",
            value=untracked,
        )  # fmt: skip


def client_connections_app(source: Callable[[], tuple[int, int, int, int]]) -> web.Application:
    """A `/metrics` page of the per-client-address connection cap's counts alone (`poolkeeper
    bbr`, which has no other metrics): the families `follow_client_connections` exports."""
    registry = CollectorRegistry()
    registry.register(_ClientConnectionsCollector(source))

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


class _ObserverCollector(Collector):
    def __init__(self, source: Callable[[], ObserverStats]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        stats = self.source()
        yield GaugeMetricFamily(
            "inference_extension_response_observer_waiting",
            "Routed requests whose end Envoy's access log has not reported yet.",
            value=stats.waiting,
        )
        yield CounterMetricFamily(
            "inference_extension_response_observer_settled",
            "Requests ended by their access-log entry.",
            value=stats.settled,
        )
        yield CounterMetricFamily(
            "inference_extension_response_observer_given_up",
            "Requests settled as unknown, their entry never seen (waiting-room limit or TTL).",
            value=stats.given_up,
        )


class _StaleCollector(Collector):
    def __init__(self, stale_s: Callable[[], float]) -> None:
        self.stale_s = stale_s

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "poolkeeper_resource_source_stale_seconds",
            "Seconds the routing state has not been kept in step with its source (API server "
            "watches down: the last known state is served); 0 while in step.",
            value=self.stale_s(),
        )


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


class _SchedulingCollector(Collector):
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


class _Exposition:
    """The registry as upstream's Go client exposes it: no `_created` samples, and the
    `inference_model_*` families repeated as `inference_objective_*` when asked."""

    def __init__(self, registry: CollectorRegistry, *, objective_names: bool) -> None:
        self.registry = registry
        self.objective_names = objective_names

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield _copy(family, family.name, samples)
            also = ALSO_AS.get(family.name) or _ALSO_AS_MORE.get(family.name)
            if also is None and family.type == "counter":
                also = _ALSO_AS_MORE.get(family.name + "_total")
            if also is not None:
                yield _renamed(family, samples, *also)
            if (
                self.objective_names
                and family.name.startswith(MODEL_PREFIX)
                and family.name not in _OBJECTIVE_OWN
            ):
                renamed = OBJECTIVE_PREFIX + family.name.removeprefix(MODEL_PREFIX)
                yield _copy(
                    family,
                    renamed,
                    [
                        s._replace(name=OBJECTIVE_PREFIX + s.name.removeprefix(MODEL_PREFIX))
                        for s in samples
                    ],
                )


# More families under a second name (counters by their `_total` name).
_ALSO_AS_MORE: Mapping[str, tuple[str, Mapping[str, str]]] = FAMILIES_ALSO_AS
# v0.5 families whose v1.x twin is an instrument of its own (labels differ: `priority`).
_OBJECTIVE_OWN = frozenset({"inference_model_request"})


def _renamed(family: Metric, samples: list[Sample], name: str, labels: Mapping[str, str]) -> Metric:
    """`family` under llm-d-router's name (and label names)."""
    base = name.removesuffix("_total") if family.type == "counter" else name
    renamed = [
        s._replace(
            name=base + s.name.removeprefix(family.name),
            labels={labels.get(k, k): v for k, v in s.labels.items()},
        )
        for s in samples
    ]
    return _copy(family, name, renamed)


def _copy(family: Metric, name: str, samples: list[Sample]) -> Metric:
    if family.type == "counter":
        name = name.removesuffix("_total")
    out = Metric(name, family.documentation, family.type, family.unit)
    out.samples = samples
    return out


class GatewayMetrics:
    """The EPP's metrics; pass it as the ext_proc observer."""

    def __init__(
        self,
        *,
        pool_stats: Callable[[], Iterable[PoolStats]] | None = None,
        scheduling: SchedulingStats | None = None,
        flow_stats: Callable[[], Iterable[QueueStats]] | None = None,
        max_label_values: int = 1000,
        fairness_id_label_limit: int = 1000,
        objective_names: bool = True,
        endpoint_of: Callable[[str], tuple[str, str, str] | None] | None = None,
    ) -> None:
        """`endpoint_of`: (name, namespace, hostport) of the endpoint at a `host:port`, for
        the scheduler-attempt labels (None: the labels stay empty). `fairness_id_label_limit`:
        distinct `fairness_id` values kept, then `other` (upstream's
        --fairness-id-metric-label-limit; 0: every value is `other`)."""
        self.registry = CollectorRegistry()
        self._endpoint_of = endpoint_of
        self._defer: Callable[[Callable[[], None]], object] | None = None
        self._exposition = _Exposition(self.registry, objective_names=objective_names)
        # One cap for both model labels, as upstream's (they share their 1,000 values).
        self._model = self._target = LabelCap(max_label_values)
        caps = {
            "model_name": self._model,
            "target_model_name": self._target,
            "fairness_id": LabelCap(fairness_id_label_limit),
        }
        self._cap: Callable[[str, str], str] = lambda label, value: caps[label](value)
        r = self.registry
        self.llmd = LlmdRequestMetrics(
            r,
            self._cap,
            {
                "duration": DURATION_BUCKETS,
                "request_size": REQUEST_SIZE_BUCKETS,
                "response_size": RESPONSE_SIZE_BUCKETS,
                "input_tokens": INPUT_TOKEN_BUCKETS,
                "output_tokens": OUTPUT_TOKEN_BUCKETS,
                "ntpot": NTPOT_BUCKETS,
            },
        )
        self.families = LlmdFamilies(
            r, objective_names=objective_names, token_buckets=INPUT_TOKEN_BUCKETS
        )
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
            buckets=REQUEST_SIZE_BUCKETS,
            registry=r,
        )
        self.response_sizes = Histogram(
            "inference_model_response_sizes",
            "Inference model responses size distribution in bytes for each model and target model.",
            model_labels,
            buckets=RESPONSE_SIZE_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            "inference_model_input_tokens",
            "Inference model input token count distribution for requests in each model.",
            model_labels,
            buckets=INPUT_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "inference_model_output_tokens",
            "Inference model output token count distribution for requests in each model.",
            model_labels,
            buckets=OUTPUT_TOKEN_BUCKETS,
            registry=r,
        )
        self.running_requests = Gauge(
            "inference_model_running_requests",
            "Inference model number of running requests in each model.",
            ["model_name"],
            registry=r,
        )
        self.ntpot = Histogram(
            "inference_model_normalized_time_per_output_token_seconds",
            "Inference model latency divided by number of output tokens in seconds for each "
            "model and target model.",
            model_labels,
            buckets=NTPOT_BUCKETS,
            registry=r,
        )
        self.scheduler_duration = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency distribution in seconds.",
            buckets=SCHEDULER_BUCKETS,
            registry=r,
        )
        self.info = Gauge(
            "inference_extension_info",
            "General information of the current build of Inference Extension.",
            ["commit", "build_ref"],
            registry=r,
        )
        self.info.labels("", f"poolkeeper-{__version__}").set(1)
        if pool_stats is not None:
            r.register(_PoolCollector(pool_stats))
        if scheduling is not None:
            r.register(_SchedulingCollector(scheduling))
        self.flow_queue_duration = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time requests spent in the flow-control queue, by outcome (Dispatched, "
            "RejectedCapacity, RejectedOther, EvictedTTL, EvictedContextCancelled).",
            [
                "fairness_id",
                "priority",
                "outcome",
                "inference_pool",
                "model_name",
                "target_model_name",
            ],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.flow_hold_duration = Histogram(
            "poolkeeper_flow_control_hold_duration_seconds",
            "Time requests were held in front of the flow-control queue by holdNewPrefixes, "
            "by how the hold ended (released, capped at maxHoldMs, cancelled); the count is "
            "the requests held.",
            ["inference_pool", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        if flow_stats is not None:
            r.register(QueueCollector(flow_stats, self._cap))

    def follow_source(self, stale_s: Callable[[], float]) -> None:
        """Export how long the resource source has not been in step (Kubernetes: watches
        down, the last known state served); 0 while it is."""
        self.registry.register(_StaleCollector(stale_s))

    def follow_refused(self, source: Callable[[], int]) -> None:
        """Export the count of gRPC calls refused for want of Envoy's token (extproc/auth)."""
        self.registry.register(_RefusedCollector(source))

    def follow_streams(self, source: Callable[[], tuple[int, int]]) -> None:
        """Export the ext_proc streams held and those refused at the cap (held, refused)."""
        self.registry.register(_StreamsCollector(source))

    def follow_client_connections(self, source: Callable[[], tuple[int, int, int, int]]) -> None:
        """Export the per-client-address connection cap's counts (held, addresses, refused,
        untracked)."""
        self.registry.register(_ClientConnectionsCollector(source))

    def follow_scrapes(self, source: ScrapeErrors) -> None:
        """Export the model-server scrape failures (poll, extract) as upstream's data-layer
        error counters."""
        self.families.follow_scrapes(source)

    def follow_observer(self, source: Callable[[], ObserverStats]) -> None:
        """Export the response observer's waiting room (when the runtime has one)."""
        self.registry.register(_ObserverCollector(source))

    def defer_request_path(self, schedule: Callable[[Callable[[], None]], object]) -> None:
        """Record the request path's samples (`routed`, `flow_outcome`) through `schedule`,
        the event loop's `call_soon`: a routed request's replies then leave before its ~14
        samples are taken (about a fifth of the route work), not after. Same samples, same
        order (call_soon is FIFO); what a request's end records always comes later, on a
        later message or access-log entry."""
        self._defer = schedule

    def _labels(self, decision: RoutingDecision) -> tuple[str, str]:
        return self._model(decision.model_name), self._target(decision.target_model)

    # -- ExchangeObserver -------------------------------------------------------------------
    def routed(self, decision: RoutingDecision, request_bytes: int, route_seconds: float) -> None:
        if self._defer is not None:
            self._defer(functools.partial(self._routed, decision, request_bytes, route_seconds))
        else:
            self._routed(decision, request_bytes, route_seconds)

    def _routed(self, decision: RoutingDecision, request_bytes: int, route_seconds: float) -> None:
        self.scheduler_duration.observe(route_seconds)
        self.llmd.routed(decision, request_bytes, route_seconds)
        if not decision.model_name:
            return  # header-only requests carry no model: not an inference request
        model, target = self._labels(decision)
        self.request_total.labels(model, target).inc()
        if self.families.objective_requests is not None:
            priority = str(decision.priority or 0)
            self.families.objective_requests.labels(model, target, priority).inc()
        self.request_sizes.labels(model, target).observe(request_bytes)
        self.running_requests.labels(model).inc()
        if decision.endpoints:
            lookup = self._endpoint_of
            self.families.scheduled(target, lookup(decision.endpoints[0]) if lookup else None)

    def rejected(self, model_name: str, error: GatewayError, request_bytes: int) -> None:
        # Like upstream, errors after model resolution (shed, no endpoint) carry the target.
        target = self._target(error.target_model) if error.target_model else ""
        self.request_error_total.labels(self._model(model_name), target, error.code).inc()
        self.llmd.rejected(model_name, error.target_model, error.code)
        if isinstance(error, FilteredOut):  # the scheduler ran and found no endpoint
            self.families.not_scheduled(target)

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
        self.llmd.finished(
            decision, status=status, usage=usage, seconds=seconds, response_bytes=response_bytes
        )
        model, target = self._labels(decision)
        self.running_requests.labels(model).dec()
        if status == 499:
            return  # the client closed the stream: upstream counts no error (and no latency)
        if status >= 400 or status == 0:
            self.request_error_total.labels(model, target, "ModelServerError").inc()
            return
        self.request_duration.labels(model, target).observe(seconds)
        self.response_sizes.labels(model, target).observe(response_bytes)
        if usage is not None and not usage.estimated:
            # Upstream records token counts only when positive, and only the server's own.
            if usage.prompt_tokens > 0:
                self.input_tokens.labels(model, target).observe(usage.prompt_tokens)
            if usage.cached_tokens and self.families.objective_cached is not None:
                self.families.objective_cached.labels(model, target).observe(usage.cached_tokens)
            if usage.completion_tokens > 0:
                self.output_tokens.labels(model, target).observe(usage.completion_tokens)
                if seconds > 0:
                    self.ntpot.labels(model, target).observe(seconds / usage.completion_tokens)

    # -- DirectorObserver (requestcontrol.director) ------------------------------------------
    def first_token(self, decision: RoutingDecision, seconds: float) -> None:
        self.llmd.first_token(decision, seconds)

    def model_rewritten(self, rewrite: str, model: str, target: str) -> None:
        self.llmd.model_rewritten(rewrite, model, target)

    # -- FlowObserver (requestcontrol.flowoutcomes) -----------------------------------------
    def flow_outcome(
        self,
        *,
        pool: str,
        band: Criticality,
        model: str,
        target: str,
        fairness_id: str,
        priority: int,
        outcome: str,
        waited_s: float,
    ) -> None:
        """One request's flow-control outcome, labelled as upstream: its fairness id and
        priority (the number), pool, model and target (`band` is poolkeeper's own)."""
        del band  # upstream labels by the priority; the band follows from it
        record = functools.partial(
            self._flow_outcome, pool, model, target, fairness_id, priority, outcome, waited_s
        )
        if self._defer is not None:
            self._defer(record)
        else:
            record()

    def _flow_outcome(
        self,
        pool: str,
        model: str,
        target: str,
        fairness_id: str,
        priority: int,
        outcome: str,
        waited_s: float,
    ) -> None:
        pool_name = pool.rpartition("/")[2]
        fairness = self._cap("fairness_id", fairness_id)
        self.flow_queue_duration.labels(
            fairness, str(priority), outcome, pool_name, self._model(model), self._target(target)
        ).observe(waited_s)
        self.families.flow_requests.labels(outcome, str(priority), pool_name).inc()

    def flow_held(self, *, pool: str, band: Criticality, outcome: str, held_s: float) -> None:
        """A `holdNewPrefixes` hold ended (poolkeeper's own family; upstream has no hold)."""
        del band  # held requests are of `queue` bands; the pool and outcome say enough
        series = self.flow_hold_duration.labels(pool.rpartition("/")[2], outcome)
        if self._defer is not None:
            self._defer(functools.partial(series.observe, held_s))
        else:
            series.observe(held_s)

    # -- exposition -------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self._exposition)

    def app(self) -> web.Application:
        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app
