"""The rest of llm-d-router's metric families (reference/llm-d-router.md §4, upstream's
`docs/metrics.md`): those `llmd.py`'s request families and `metrics.py`'s pool, scheduler and
flow-queue collectors do not cover.

Filled from what poolkeeper knows:

- `scheduler_attempts_total` {status, target_model_name, endpoint_name, namespace, port}:
  `success` with the picked endpoint per routed request, `failure` (endpoint labels empty) when
  the profile's filters kept none; the older `inference_extension_scheduler_attempts_total`
  beside it (label `pod_name`, as GIE);
- `inference_objective_request_total` with `priority` and
  `inference_objective_prompt_cached_tokens`: the v1.x twins whose labels or existence differ
  from the v0.5 `inference_model_*` family they are otherwise copied from;
- `datalayer_poll_errors_total` {source_type} and `datalayer_extract_errors_total`
  {source_type, extractor_type}: failed scrapes of the model servers (fetch, and a page that
  does not parse or lacks the engine's metrics), with the `llm_d_inference_scheduler_*` twins;
- `flow_control_requests_total` {outcome, priority, inference_pool}: each flow-control outcome
  (the pool's saturation and stale endpoints come with the pool gauges, the bands' capacity
  ratios with the queue gauges, `metrics.py`).

Registered with no samples, as upstream's are until their event happens (so dashboards find the
family and `absent()` alerts do not fire): the streaming TPOT and inter-token-latency
histograms (poolkeeper sees body chunks, not tokens), `plugin_data_scope_violations_total`
(poolkeeper plugins have no data scopes to violate), `response_processing_duration_seconds`,
and the flow-control families poolkeeper's flow control does not measure (dispatch cycle,
enqueue time, the global capacity ratios (no global bound here), eviction and reclaim).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from poolkeeper.hostport import split_hostport
from poolkeeper.telemetry.children import Counter, Gauge, Histogram

PREFIX: Final = "llm_d_epp_"
R: Final = ("model_name", "target_model_name", "fairness_id", "priority")
SUCCESS, FAILURE = "success", "failure"

# Older family -> (llm-d family, {older label: llm-d label}) for metrics.ALSO_AS.
ALSO_AS: Final = {
    "inference_extension_scheduler_attempts_total": (
        "llm_d_epp_scheduler_attempts_total",
        {"pod_name": "endpoint_name"},
    ),
    "llm_d_inference_scheduler_datalayer_poll_errors_total": (
        "llm_d_epp_datalayer_poll_errors_total",
        {},
    ),
    "llm_d_inference_scheduler_datalayer_extract_errors_total": (
        "llm_d_epp_datalayer_extract_errors_total",
        {},
    ),
    # The other way round: llm-d's own instrument, GIE's name beside it.
    "llm_d_epp_model_rewrite_decisions_total": (
        "inference_extension_model_rewrite_decisions_total",
        {},
    ),
    **{
        f"inference_extension_{name}": (f"llm_d_epp_{name}", {})
        for name in (
            "flow_control_dispatch_cycle_duration_seconds",
            "flow_control_request_enqueue_duration_seconds",
            "flow_control_pool_saturation",  # metrics.py's pool collector writes it
        )
    },
}
# Families without samples that upstream also writes under an older `inference_extension_`
# name (registered under that one; ALSO_AS gives the llm-d name).
TWINNED: Final = frozenset(
    {
        "flow_control_dispatch_cycle_duration_seconds",
        "flow_control_request_enqueue_duration_seconds",
    }
)

# (name without prefix, type, labels) of the families registered without samples.
UNSAMPLED: Final = (
    ("request_streaming_tpot_seconds", "histogram", R),
    ("request_streaming_itl_seconds", "histogram", R),
    ("plugin_data_scope_violations_total", "counter",
     ("extension_point", "plugin_type", "plugin_name", "access")),
    ("response_processing_duration_seconds", "histogram", ()),
    ("flow_control_dispatch_cycle_duration_seconds", "histogram", ()),
    ("flow_control_request_enqueue_duration_seconds", "histogram",
     ("fairness_id", "priority", "outcome")),
    ("flow_control_global_capacity_utilization_requests", "gauge", ("inference_pool",)),
    ("flow_control_global_capacity_utilization_bytes", "gauge", ("inference_pool",)),
    ("flow_control_revocations_issued_total", "counter", ("priority", "inference_pool")),
    ("flow_control_revocations_total", "counter", ("outcome", "inference_pool")),
    ("flow_control_reclaim_target", "gauge", ("inference_pool",)),
    ("flow_control_pending_reclaim", "gauge", ("inference_pool",)),
    ("flow_control_revocation_confirmation_seconds", "histogram", ("inference_pool",)),
)  # fmt: skip

# (poll failures, extract failures) of the model-server scrapes, ever.
ScrapeErrors = Callable[[], tuple[int, int]]


class _ScrapeErrorCollector(Collector):
    def __init__(self, source: ScrapeErrors) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        polls, extracts = self.source()
        poll = CounterMetricFamily(
            "llm_d_inference_scheduler_datalayer_poll_errors",
            "Failed model-server metric polls, by data source type.",
            labels=["source_type"],
        )
        poll.add_metric(["metrics-data-source"], polls)
        yield poll
        extract = CounterMetricFamily(
            "llm_d_inference_scheduler_datalayer_extract_errors",
            "Model-server metric pages that could not be read, by source and extractor type.",
            labels=["source_type", "extractor_type"],
        )
        extract.add_metric(["metrics-data-source", "core-metrics-extractor"], extracts)
        yield extract


class LlmdFamilies:
    """The instruments above, on `registry`; `objective_names`: the v1.x twins too
    (`token_buckets`: upstream's input-token buckets, for the cached-token histogram)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        objective_names: bool,
        token_buckets: tuple[float, ...],
    ) -> None:
        r = self._registry = registry
        self.attempts = Counter(
            "inference_extension_scheduler_attempts",
            "Scheduling attempts, by status, target model and picked endpoint.",
            ["status", "target_model_name", "pod_name", "namespace", "port"],
            registry=r,
        )
        self.flow_requests = Counter(
            PREFIX + "flow_control_requests",
            "Flow-control outcomes, by outcome, priority band and pool.",
            ["outcome", "priority", "inference_pool"],
            registry=r,
        )
        self.objective_requests: Counter | None = None
        self.objective_cached: Histogram | None = None
        if objective_names:
            self.objective_requests = Counter(
                "inference_objective_request",
                "Inference objective requests, by model, target model and priority.",
                ["model_name", "target_model_name", "priority"],
                registry=r,
            )
            self.objective_cached = Histogram(
                "inference_objective_prompt_cached_tokens",
                "Prompt tokens served from the prefix cache, by model and target model.",
                ["model_name", "target_model_name"],
                buckets=token_buckets,
                registry=r,
            )
        for name, kind, labels in UNSAMPLED:
            help_ = f"{name.replace('_', ' ')} (registered; poolkeeper records none)"
            full = ("inference_extension_" if name in TWINNED else PREFIX) + name
            if kind == "counter":
                Counter(full.removesuffix("_total"), help_, labels, registry=r)
            elif kind == "gauge":
                Gauge(full, help_, labels, registry=r)
            else:
                Histogram(full, help_, labels, registry=r)

    def follow_scrapes(self, source: ScrapeErrors) -> None:
        self._registry.register(_ScrapeErrorCollector(source))

    def scheduled(self, target: str, endpoint: tuple[str, str, str] | None) -> None:
        """A successful pick: (endpoint name, namespace, hostport) of the first endpoint."""
        if endpoint is None:
            self.attempts.labels(SUCCESS, target, "", "", "").inc()
            return
        name, namespace, hostport = endpoint
        _, port = split_hostport(hostport)
        self.attempts.labels(SUCCESS, target, name, namespace, str(port)).inc()

    def not_scheduled(self, target: str) -> None:
        self.attempts.labels(FAILURE, target, "", "", "").inc()
