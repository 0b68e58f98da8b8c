"""llm-d-router's metric names (`llm_d_epp_*`, reference/llm-d-router.md §4), beside the older
GIE names `metrics.py` exports, so dashboards and alerts written for either stay filled.

Two ways in:

- `ALSO_AS`: families whose labels already match upstream's (pool gauges, scheduler and plugin
  latency, build info, flow-control queue) are exposed a second time under the llm-d name,
  with the same samples (a label renamed where upstream renamed it);
- `LlmdRequestMetrics`: the per-request families carry upstream's label set R =
  {model_name, target_model_name, fairness_id, priority}, which the older families lack, so
  they are instruments of their own, fed by the same ExchangeObserver hooks.

`fairness_id` is the flow the request was queued in (the fairness header's value, else the
model name: poolkeeper's flows), `default-flow` when flow control did not see it; `priority`
is the InferenceObjective priority, 0 when none applies (upstream's default).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from prometheus_client import CollectorRegistry

from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.telemetry.children import Counter, Gauge, Histogram

PREFIX: Final = "llm_d_epp_"

# Older family -> (llm-d family, {older label: llm-d label}).
ALSO_AS: Final[Mapping[str, tuple[str, Mapping[str, str]]]] = MappingProxyType(
    {
        "inference_pool_average_kv_cache_utilization": (
            "llm_d_epp_average_kv_cache_utilization", {}),
        "inference_pool_average_queue_size": ("llm_d_epp_average_queue_size", {}),
        "inference_pool_average_running_requests": ("llm_d_epp_average_running_requests", {}),
        "inference_pool_ready_pods": ("llm_d_epp_ready_endpoints", {}),
        "inference_pool_per_pod_queue_size": (
            "llm_d_epp_per_endpoint_queue_size", {"model_server_pod": "model_server_endpoint"}),
        "inference_extension_scheduler_e2e_duration_seconds": (
            "llm_d_epp_scheduler_e2e_duration_seconds", {}),
        "inference_extension_plugin_duration_seconds": (
            "llm_d_epp_plugin_duration_seconds", {}),
        "inference_extension_info": ("llm_d_epp_info", {}),
        "inference_extension_flow_control_request_queue_duration_seconds": (
            "llm_d_epp_flow_control_request_queue_duration_seconds", {}),
        "inference_extension_flow_control_queue_size": ("llm_d_epp_flow_control_queue_size", {}),
        "inference_extension_flow_control_queue_bytes": (
            "llm_d_epp_flow_control_queue_bytes", {}),
    }
)  # fmt: skip

R: Final = ("model_name", "target_model_name", "fairness_id", "priority")
DEFAULT_FLOW: Final = "default-flow"

TTFT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                       30.0, 60.0, 120.0)  # fmt: skip


class LlmdRequestMetrics:
    """The `llm_d_epp_request_*` families (label set R), registered on `registry`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        cap: Callable[[str, str], str],
        buckets: Mapping[str, tuple[float, ...]],
    ) -> None:
        self._cap = cap  # (label, value) -> the value or "other" past the label's cap
        r = registry
        self.total = Counter(
            PREFIX + "request",
            "Requests, by model, target model, fairness id and priority.",
            R,
            registry=r,
        )
        self.errors = Counter(
            PREFIX + "request_error",
            "Request errors, by R and error code.",
            [*R, "error_code"],
            registry=r,
        )
        self.duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Response latency in seconds.",
            R,
            buckets=buckets["duration"],
            registry=r,
        )
        self.request_size = Histogram(
            PREFIX + "request_size_bytes",
            "Request body size in bytes.",
            R,
            buckets=buckets["request_size"],
            registry=r,
        )
        self.response_size = Histogram(
            PREFIX + "response_size_bytes",
            "Response body size in bytes.",
            R,
            buckets=buckets["response_size"],
            registry=r,
        )
        self.input_tokens = Histogram(
            PREFIX + "request_input_tokens",
            "Prompt tokens per request.",
            R,
            buckets=buckets["input_tokens"],
            registry=r,
        )
        self.output_tokens = Histogram(
            PREFIX + "request_output_tokens",
            "Output tokens per request.",
            R,
            buckets=buckets["output_tokens"],
            registry=r,
        )
        self.cached_tokens = Histogram(
            PREFIX + "request_cached_tokens",
            "Prompt tokens served from the prefix cache.",
            R,
            buckets=buckets["input_tokens"],
            registry=r,
        )
        self.running = Gauge(PREFIX + "request_running", "Requests running, by R.", R, registry=r)
        self.ntpot = Histogram(
            PREFIX + "request_ntpot_seconds",
            "Latency divided by output tokens, seconds.",
            R,
            buckets=buckets["ntpot"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "request_ttft_seconds",
            "Time to first token in seconds.",
            [*R, "streaming"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.request_processing = Histogram(
            PREFIX + "request_processing_duration_seconds",
            "Time the EPP spent deciding where a request goes, seconds.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                     5, 10), registry=r)  # fmt: skip
        # Without samples until an InferenceModelRewrite rule decides, as upstream.
        self.rewrites = Counter(
            PREFIX + "model_rewrite_decisions",
            "Model rewrite decisions, by rewrite name, model and target.",
            ["model_rewrite_name", "model_name", "target_model"],
            registry=r,
        )
        # fmt: on

    def _r(self, decision: RoutingDecision) -> tuple[str, str, str, str]:
        flow = getattr(decision.ticket, "flow", "") or DEFAULT_FLOW
        priority = decision.priority if decision.priority is not None else 0
        return (
            self._cap("model_name", decision.model_name),
            self._cap("target_model_name", decision.target_model),
            self._cap("fairness_id", flow),
            str(priority),
        )

    def routed(self, decision: RoutingDecision, request_bytes: int, route_seconds: float) -> None:
        self.request_processing.observe(route_seconds)
        if not decision.model_name:
            return
        labels = self._r(decision)
        self.total.labels(*labels).inc()
        self.request_size.labels(*labels).observe(request_bytes)
        self.running.labels(*labels).inc()

    def first_token(self, decision: RoutingDecision, seconds: float) -> None:
        """Time to first token: from the request's dispatch to its endpoint (after any
        flow-control wait) to the first body byte of a successful response."""
        if decision.model_name:
            streaming = "true" if decision.stream else "false"
            self.ttft.labels(*self._r(decision), streaming).observe(seconds)

    def model_rewritten(self, rewrite: str, model: str, target: str) -> None:
        """One InferenceModelRewrite decision; the rule's object by name, as upstream."""
        self.rewrites.labels(
            rewrite.rpartition("/")[2],
            self._cap("model_name", model),
            self._cap("target_model_name", target),
        ).inc()

    def rejected(self, model_name: str, target_model: str, code: str) -> None:
        self.errors.labels(
            self._cap("model_name", model_name),
            self._cap("target_model_name", target_model) if target_model else "",
            DEFAULT_FLOW,
            "0",
            code,
        ).inc()

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
        labels = self._r(decision)
        self.running.labels(*labels).dec()
        if status == 499:
            return
        if status >= 400 or status == 0:
            self.errors.labels(*labels, "ModelServerError").inc()
            return
        self.duration.labels(*labels).observe(seconds)
        self.response_size.labels(*labels).observe(response_bytes)
        if usage is None or usage.estimated:
            return
        if usage.prompt_tokens > 0:
            self.input_tokens.labels(*labels).observe(usage.prompt_tokens)
        if usage.cached_tokens:
            self.cached_tokens.labels(*labels).observe(usage.cached_tokens)
        if usage.completion_tokens > 0:
            self.output_tokens.labels(*labels).observe(usage.completion_tokens)
            if seconds > 0:
                self.ntpot.labels(*labels).observe(seconds / usage.completion_tokens)
