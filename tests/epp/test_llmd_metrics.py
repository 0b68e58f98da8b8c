"""`/metrics` against llm-d-router's metric families (reference/llm-d-router.md §4): every
family upstream always fills is exported, under upstream's name and labels, beside the
older names; what poolkeeper does not export is this exact, documented list."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import QueueTimeout
from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.telemetry.metrics import OTHER, GatewayMetrics, PoolStats, QueueStats
from tests.requestcontrol.test_rc_director import _chat
from tests.requestcontrol.test_rc_director_objectives import rig

# llm-d-router v0.10's core families (§4 table), counters with their _total.
UPSTREAM: frozenset[str] = frozenset(
    "llm_d_epp_" + name
    for name in [
        "request_total",
        "request_error_total",
        "request_duration_seconds",
        "request_size_bytes",
        "response_size_bytes",
        "request_input_tokens",
        "request_output_tokens",
        "request_cached_tokens",
        "request_running",
        "request_ntpot_seconds",
        "request_ttft_seconds",
        "request_streaming_tpot_seconds",
        "request_streaming_itl_seconds",
        "average_kv_cache_utilization",
        "average_queue_size",
        "average_running_requests",
        "std_dev_kv_cache_utilization",
        "std_dev_queue_size",
        "std_dev_running_requests",
        "ready_endpoints",
        "per_endpoint_queue_size",
        "scheduler_e2e_duration_seconds",
        "scheduler_attempts_total",
        "plugin_duration_seconds",
        "plugin_data_scope_violations_total",
        "request_processing_duration_seconds",
        "response_processing_duration_seconds",
        "info",
        "model_rewrite_decisions_total",
        "datalayer_poll_errors_total",
        "datalayer_extract_errors_total",
        "flow_control_request_queue_duration_seconds",
        "flow_control_dispatch_cycle_duration_seconds",
        "flow_control_request_enqueue_duration_seconds",
        "flow_control_queue_size",
        "flow_control_queue_bytes",
        "flow_control_pool_saturation",
        "flow_control_stale_endpoints",
        "flow_control_capacity_utilization_requests",
        "flow_control_capacity_utilization_bytes",
        "flow_control_global_capacity_utilization_requests",
        "flow_control_global_capacity_utilization_bytes",
        "flow_control_requests_total",
        "flow_control_revocations_issued_total",
        "flow_control_revocations_total",
        "flow_control_reclaim_target",
        "flow_control_pending_reclaim",
        "flow_control_revocation_confirmation_seconds",
    ]
)

# Not exported yet (docs/kubernetes.md, "Replacing upstream's EPP"). Keep in step with the code.
NOT_YET: frozenset[str] = frozenset(
    "llm_d_epp_" + name
    for name in [
        "request_streaming_tpot_seconds",
        "request_streaming_itl_seconds",
        "average_running_requests",
        "std_dev_kv_cache_utilization",
        "std_dev_queue_size",
        "std_dev_running_requests",
        "scheduler_attempts_total",
        "plugin_data_scope_violations_total",
        "response_processing_duration_seconds",
        "datalayer_poll_errors_total",
        "datalayer_extract_errors_total",
        "flow_control_dispatch_cycle_duration_seconds",
        "flow_control_request_enqueue_duration_seconds",
        "flow_control_pool_saturation",
        "flow_control_stale_endpoints",
        "flow_control_capacity_utilization_requests",
        "flow_control_capacity_utilization_bytes",
        "flow_control_global_capacity_utilization_requests",
        "flow_control_global_capacity_utilization_bytes",
        "flow_control_requests_total",
        "flow_control_revocations_issued_total",
        "flow_control_revocations_total",
        "flow_control_reclaim_target",
        "flow_control_pending_reclaim",
        "flow_control_revocation_confirmation_seconds",
    ]
)


def _metrics() -> GatewayMetrics:
    return GatewayMetrics(
        pool_stats=lambda: [PoolStats("pool", 0.5, 2.0, 1, (("sim-0", 2.0),))],
        scheduling=SchedulingStats(),
        flow_stats=lambda: [QueueStats("pool", "Standard", 1, 10)],
    )


def _decision(model: str = "chat", priority: int | None = 5) -> RoutingDecision:
    return RoutingDecision(
        request_id="r",
        endpoints=("10.0.0.1:8000",),
        pool="default/pool",
        model_name=model,
        target_model="chat-v1",
        criticality=Criticality.CRITICAL,
        priority=priority,
    )


def _families(text: str) -> dict[str, str]:
    """family name (counters with _total) -> type, from the TYPE lines."""
    out = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        if kind == "counter" and not name.endswith("_total"):
            name += "_total"
        out[name] = kind
    return out


def test_metrics_families_against_upstreams_list() -> None:
    m = _metrics()
    decision = _decision()
    m.routed(decision, 100, 0.001)
    m.finished(decision, status=200, usage=Usage(10, 5, 4), seconds=0.5, response_bytes=50)
    m.rejected("chat", QueueTimeout("late"), 10)
    m.flow_outcome(pool="default/pool", band=Criticality.STANDARD, model="chat",
                   outcome="Dispatched", waited_s=0.01)  # fmt: skip
    exported = {name for name in _families(m.render().decode()) if name.startswith("llm_d_epp_")}
    assert UPSTREAM - exported == NOT_YET
    assert exported - UPSTREAM <= {
        "llm_d_epp_prefix_indexer_size",
        "llm_d_epp_prefix_indexer_hit_ratio",
        "llm_d_epp_prefix_indexer_hit_bytes",
    }
    # The older names stay beside them.
    older = _families(m.render().decode())
    for name in ("inference_objective_request_total", "inference_pool_ready_pods",
                 "inference_extension_scheduler_e2e_duration_seconds"):  # fmt: skip
        assert name in older


def _samples(m: GatewayMetrics, family: str) -> list[dict[str, str]]:
    for parsed in text_string_to_metric_families(m.render().decode()):
        if parsed.name == family:
            return [dict(s.labels) for s in parsed.samples if not s.name.endswith("_created")]
    return []


def test_upstreams_labels() -> None:
    m = _metrics()
    m.routed(_decision(), 100, 0.001)
    (request,) = _samples(m, "llm_d_epp_request")
    assert request == {
        "model_name": "chat",
        "target_model_name": "chat-v1",
        "fairness_id": "default-flow",
        "priority": "5",
    }
    (per_endpoint,) = _samples(m, "llm_d_epp_per_endpoint_queue_size")
    assert per_endpoint == {"name": "pool", "model_server_endpoint": "sim-0"}
    (ready,) = _samples(m, "llm_d_epp_ready_endpoints")
    assert ready == {"name": "pool"}


def test_labels_are_capped_at_1000_values_then_other() -> None:
    m = GatewayMetrics()
    for i in range(1005):
        m.routed(_decision(f"model-{i}", None), 1, 0.001)
    names = {s["model_name"] for s in _samples(m, "llm_d_epp_request")}
    assert len(names) == 1001
    assert OTHER in names
    assert {s["priority"] for s in _samples(m, "llm_d_epp_request")} == {"0"}


async def test_time_to_first_token_and_rewrite_decisions_come_from_the_director() -> None:
    """Filled from the Director's events: a successful response's first byte (sent -> first
    byte, on the Director's clock) and each InferenceModelRewrite decision."""
    r = rig()
    m = _metrics()
    r.director.observer = m
    streamed = await r.director.route(_chat("food-review", rid="s", stream=True))  # a rule
    plain = await r.director.route(_chat("chat", rid="p"))  # no rule: no decision counted
    r.clock[0] += 0.3
    r.director.first_byte(streamed)
    r.clock[0] += 0.2
    r.director.first_byte(plain)  # a JSON answer: its first byte, labelled streaming=false
    r.director.complete(plain, status=200, usage=None)
    r.director.first_byte(plain)  # after the end: nothing
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    rewrites = [
        (s.labels, s.value)
        for s in families["llm_d_epp_model_rewrite_decisions"].samples
        if s.name.endswith("_total")
    ]
    assert rewrites == [
        (
            {
                "model_rewrite_name": "canary",
                "model_name": "food-review",
                "target_model": streamed.target_model,
            },
            1.0,
        )
    ]
    sums = {
        (s.labels["model_name"], s.labels["streaming"]): s.value
        for s in families["llm_d_epp_request_ttft_seconds"].samples
        if s.name.endswith("_sum")
    }
    counts = {
        (s.labels["model_name"], s.labels["streaming"]): s.value
        for s in families["llm_d_epp_request_ttft_seconds"].samples
        if s.name.endswith("_count")
    }
    assert sums == pytest.approx({("food-review", "true"): 0.3, ("chat", "false"): 0.5})
    assert counts == {("food-review", "true"): 1.0, ("chat", "false"): 1.0}
