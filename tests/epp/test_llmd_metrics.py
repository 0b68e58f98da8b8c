"""`/metrics` against llm-d-router's metric families (reference/llm-d-router.md §4): every
family upstream always fills is exported, under upstream's name and labels, beside the
older names; what poolkeeper does not export is this exact, documented list."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import FilteredOut, QueueTimeout
from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.telemetry.flowqueue import FlowQueue, QueueStats
from poolkeeper.telemetry.labels import OTHER
from poolkeeper.telemetry.llmd_families import UNSAMPLED
from poolkeeper.telemetry.metrics import GatewayMetrics
from poolkeeper.telemetry.pool_collector import PoolStats
from tests.requestcontrol.test_rc_director import _chat
from tests.requestcontrol.test_rc_director_objectives import rig

R = ("model_name", "target_model_name", "fairness_id", "priority")
POOL = ("inference_pool",)
# llm-d-router's core families and their label names, as its docs/metrics.md lists them
# (reference/llm-d-router.md §4); counters with their _total.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "llm_d_epp_" + name: labels
    for name, labels in [
        ("request_total", R),
        ("request_error_total", (*R, "error_code")),
        ("request_duration_seconds", R),
        ("request_size_bytes", R),
        ("response_size_bytes", R),
        ("request_input_tokens", R),
        ("request_output_tokens", R),
        ("request_cached_tokens", R),
        ("request_running", R),
        ("request_ntpot_seconds", R),
        ("request_ttft_seconds", (*R, "streaming")),
        ("request_streaming_tpot_seconds", R),
        ("request_streaming_itl_seconds", R),
        ("average_kv_cache_utilization", ("name",)),
        ("average_queue_size", ("name",)),
        ("average_running_requests", ("name",)),
        ("std_dev_kv_cache_utilization", ("name",)),
        ("std_dev_queue_size", ("name",)),
        ("std_dev_running_requests", ("name",)),
        ("ready_endpoints", ("name",)),
        ("per_endpoint_queue_size", ("name", "model_server_endpoint")),
        ("scheduler_e2e_duration_seconds", ()),
        ("scheduler_attempts_total",
         ("status", "target_model_name", "endpoint_name", "namespace", "port")),
        ("plugin_duration_seconds", ("extension_point", "plugin_type", "plugin_name")),
        ("plugin_data_scope_violations_total",
         ("extension_point", "plugin_type", "plugin_name", "access")),
        ("request_processing_duration_seconds", ()),
        ("response_processing_duration_seconds", ()),
        ("info", ("commit", "build_ref")),
        ("model_rewrite_decisions_total", ("model_rewrite_name", "model_name", "target_model")),
        ("datalayer_poll_errors_total", ("source_type",)),
        ("datalayer_extract_errors_total", ("source_type", "extractor_type")),
        ("flow_control_request_queue_duration_seconds",
         ("fairness_id", "priority", "outcome", "inference_pool", "model_name",
          "target_model_name")),
        ("flow_control_dispatch_cycle_duration_seconds", ()),
        ("flow_control_request_enqueue_duration_seconds", ("fairness_id", "priority", "outcome")),
        ("flow_control_queue_size",
         ("fairness_id", "priority", "inference_pool", "model_name", "target_model_name")),
        ("flow_control_queue_bytes",
         ("fairness_id", "priority", "inference_pool", "model_name", "target_model_name")),
        ("flow_control_pool_saturation", ("inference_pool", "stage")),
        ("flow_control_stale_endpoints", ("detector",)),
        ("flow_control_capacity_utilization_requests", ("priority", "inference_pool")),
        ("flow_control_capacity_utilization_bytes", ("priority", "inference_pool")),
        ("flow_control_global_capacity_utilization_requests", POOL),
        ("flow_control_global_capacity_utilization_bytes", POOL),
        ("flow_control_requests_total", ("outcome", "priority", "inference_pool")),
        ("flow_control_revocations_issued_total", ("priority", "inference_pool")),
        ("flow_control_revocations_total", ("outcome", "inference_pool")),
        ("flow_control_reclaim_target", POOL),
        ("flow_control_pending_reclaim", POOL),
        ("flow_control_revocation_confirmation_seconds", POOL),
    ]
}  # fmt: skip

MODEL = ("model_name", "target_model_name")
# The deprecated twins upstream still writes beside them, with their label names (its
# metrics.go: `inference_objective_`, `inference_pool_`, `inference_extension_`,
# `llm_d_inference_scheduler_` subsystems; collectors/inference_pool.go).
DEPRECATED: dict[str, tuple[str, ...]] = {
    **{
        "inference_objective_" + name: labels
        for name, labels in [
            ("request_total", (*MODEL, "priority")),
            ("request_error_total", (*MODEL, "error_code")),
            ("request_duration_seconds", MODEL),
            ("request_sizes", MODEL),
            ("response_sizes", MODEL),
            ("input_tokens", MODEL),
            ("output_tokens", MODEL),
            ("prompt_cached_tokens", MODEL),
            ("running_requests", ("model_name",)),
            ("normalized_time_per_output_token_seconds", MODEL),
        ]
    },
    **{
        "inference_pool_" + name: labels
        for name, labels in [
            ("average_kv_cache_utilization", ("name",)),
            ("average_queue_size", ("name",)),
            ("average_running_requests", ("name",)),
            ("ready_pods", ("name",)),
            ("per_pod_queue_size", ("name", "model_server_pod")),
        ]
    },
    **{
        "inference_extension_" + name: labels
        for name, labels in [
            ("scheduler_e2e_duration_seconds", ()),
            ("scheduler_attempts_total",
             ("status", "target_model_name", "pod_name", "namespace", "port")),
            ("plugin_duration_seconds", ("extension_point", "plugin_type", "plugin_name")),
            ("info", ("commit", "build_ref")),
            ("model_rewrite_decisions_total",
             ("model_rewrite_name", "model_name", "target_model")),
            *(
                (name, UPSTREAM["llm_d_epp_" + name])
                for name in [
                    "flow_control_request_queue_duration_seconds",
                    "flow_control_dispatch_cycle_duration_seconds",
                    "flow_control_request_enqueue_duration_seconds",
                    "flow_control_queue_size",
                    "flow_control_queue_bytes",
                    "flow_control_pool_saturation",
                ]
            ),
        ]
    },
    "llm_d_inference_scheduler_datalayer_poll_errors_total": ("source_type",),
    "llm_d_inference_scheduler_datalayer_extract_errors_total": ("source_type", "extractor_type"),
}  # fmt: skip

# Plugin-owned families poolkeeper exports too (the approximate prefix producer's), with the
# older unlabelled twins.
PLUGIN_OWNED: dict[str, tuple[str, ...]] = {
    **{
        "llm_d_epp_" + name: ("plugin_name", "plugin_type")
        for name in ["prefix_indexer_size", "prefix_indexer_hit_ratio", "prefix_indexer_hit_bytes"]
    },
    **{
        "inference_extension_" + name: ()
        for name in ["prefix_indexer_size", "prefix_indexer_hit_ratio", "prefix_indexer_hit_bytes"]
    },
}

# Registered without samples (telemetry/llmd_families.py says why; docs/kubernetes.md).
NO_SAMPLES: frozenset[str] = frozenset(
    "llm_d_epp_" + name
    for name in [
        "request_streaming_tpot_seconds",
        "request_streaming_itl_seconds",
        "plugin_data_scope_violations_total",
        "response_processing_duration_seconds",  # unlabelled: zero buckets
        "flow_control_dispatch_cycle_duration_seconds",  # unlabelled: zero buckets
        "flow_control_request_enqueue_duration_seconds",
        "flow_control_global_capacity_utilization_requests",
        "flow_control_global_capacity_utilization_bytes",
        "flow_control_revocations_issued_total",
        "flow_control_revocations_total",
        "flow_control_reclaim_target",
        "flow_control_pending_reclaim",
        "flow_control_revocation_confirmation_seconds",
    ]
)


def _metrics() -> GatewayMetrics:
    stats = SchedulingStats()
    stats.plugin("Scorer", "queue-scorer", "queue-scorer").observe(0.0002)
    m = GatewayMetrics(
        pool_stats=lambda: [
            PoolStats(
                "pool",
                0.5,
                2.0,
                1,
                (("sim-0", 2.0),),
                average_running_requests=3.0,
                std_dev_kv_cache_utilization=0.1,
                std_dev_queue_size=1.5,
                std_dev_running_requests=0.5,
                saturation=0.75,
                stale_endpoints=1,
            )
        ],
        scheduling=stats,
        flow_stats=lambda: [
            QueueStats(
                "pool",
                Criticality.STANDARD,
                1,
                10,
                max_requests=4,
                max_bytes=40,
                flows=(FlowQueue("team-a", 0, "chat", "chat-v1", 1, 10),),
            )
        ],
        endpoint_of=lambda hostport: ("sim-0", "llm", hostport),
    )
    m.follow_scrapes(lambda: (3, 1))
    return m


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


def _filled() -> GatewayMetrics:
    """`_metrics()` after one request's events (and a few others'), every hook called."""
    m = _metrics()
    decision = _decision()
    m.routed(decision, 100, 0.001)
    m.finished(decision, status=200, usage=Usage(10, 5, 4), seconds=0.5, response_bytes=50)
    m.rejected("chat", QueueTimeout("late"), 10)
    m.flow_outcome(pool="default/pool", band=Criticality.STANDARD, model="chat",
                   target="chat-v1", fairness_id="team-a", priority=0, outcome="Dispatched",
                   waited_s=0.01)  # fmt: skip
    m.flow_held(pool="default/pool", band=Criticality.STANDARD, outcome="released", held_s=0.05)
    m.first_token(decision, 0.2)
    m.model_rewritten("default/canary", "chat", "chat-v1")
    m.rejected("chat", FilteredOut("none passed"), 10)
    m.routed(_decision("still-running"), 10, 0.001)
    return m


def test_metrics_families_against_upstreams_list() -> None:
    text = _filled().render().decode()
    families = _families(text)
    exported = {name for name in families if name.startswith("llm_d_epp_")}
    assert set(UPSTREAM) - exported == set()
    assert exported - set(UPSTREAM) == {n for n in PLUGIN_OWNED if n.startswith("llm_d_epp_")}
    assert set(DEPRECATED) - set(families) == set()  # the older names stay beside them
    # Every family but the documented few has a non-zero sample after one request's events.
    sampled = {
        f.name for f in text_string_to_metric_families(text) if any(s.value for s in f.samples)
    }
    sampled |= {name + "_total" for name in sampled}
    assert {n for n in UPSTREAM if n not in sampled} == NO_SAMPLES


def _declared(name: str) -> tuple[str, ...]:
    """The label names a family registered without samples was declared with."""
    bare = name.removeprefix("llm_d_epp_").removeprefix("inference_extension_")
    (labels,) = [labels for n, _, labels in UNSAMPLED if n == bare]
    return labels


def test_every_family_has_upstreams_label_names() -> None:
    """The label names of every family in upstream's list and of every deprecated twin, as
    exported (families without samples: as declared), diffed against upstream's."""
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(_filled().render().decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        names = {k for sample in family.samples for k in sample.labels if k != "le"}
        exported[name] = names if family.samples else set(_declared(name))
    expected = {
        name: set(labels) for name, labels in {**UPSTREAM, **DEPRECATED, **PLUGIN_OWNED}.items()
    }
    wrong = {
        name: (sorted(exported.get(name, ())), sorted(labels))
        for name, labels in expected.items()
        if exported.get(name) != labels
    }
    assert wrong == {}


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
    # model_name and target_model_name share the 1,000 values (the target, chat-v1, holds one).
    assert len(names) == 1000
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


def _values(m: GatewayMetrics, family: str) -> list[tuple[dict[str, str], float]]:
    for parsed in text_string_to_metric_families(m.render().decode()):
        if parsed.name == family:
            return [
                (dict(s.labels), s.value)
                for s in parsed.samples
                if s.name.endswith(("_total", "_sum")) or s.name == family
            ]
    return []


def test_the_families_filled_from_poolkeepers_own_data() -> None:
    m = _metrics()
    decision = _decision(priority=7)
    m.routed(decision, 100, 0.001)
    m.finished(decision, status=200, usage=Usage(10, 5, 4), seconds=0.5, response_bytes=50)
    m.rejected("chat", FilteredOut("none passed"), 10)
    m.flow_outcome(pool="default/pool", band=Criticality.SHEDDABLE, model="chat",
                   target="chat-v1", fairness_id="team-a", priority=-3,
                   outcome="RejectedCapacity", waited_s=0.0)  # fmt: skip
    attempts = sorted(_values(m, "llm_d_epp_scheduler_attempts"), key=lambda s: s[0]["status"])
    assert attempts == [
        ({"status": "failure", "target_model_name": "", "endpoint_name": "", "namespace": "",
          "port": ""}, 1.0),
        ({"status": "success", "target_model_name": "chat-v1", "endpoint_name": "sim-0",
          "namespace": "llm", "port": "8000"}, 1.0),
    ]  # fmt: skip
    (older,) = [s for s in _values(m, "inference_extension_scheduler_attempts")
                if s[0]["status"] == "success"]  # fmt: skip
    assert older[0]["pod_name"] == "sim-0"
    assert _values(m, "inference_objective_request") == [
        ({"model_name": "chat", "target_model_name": "chat-v1", "priority": "7"}, 1.0)
    ]
    assert "priority" not in _values(m, "inference_model_request")[0][0]  # v0.5's labels
    assert _values(m, "inference_objective_prompt_cached_tokens") == [
        ({"model_name": "chat", "target_model_name": "chat-v1"}, 4.0)
    ]
    for family, value in [
        ("llm_d_epp_average_running_requests", 3.0),
        ("inference_pool_average_running_requests", 3.0),
        ("llm_d_epp_std_dev_kv_cache_utilization", 0.1),
        ("llm_d_epp_std_dev_queue_size", 1.5),
        ("llm_d_epp_std_dev_running_requests", 0.5),
    ]:
        assert _values(m, family) == [({"name": "pool"}, value)]
    assert _values(m, "llm_d_epp_flow_control_pool_saturation") == [
        ({"inference_pool": "pool", "stage": "decode"}, 0.75),
        ({"inference_pool": "pool", "stage": "effective"}, 0.75),
    ]
    assert _values(m, "inference_extension_flow_control_pool_saturation")  # the older twin
    assert _values(m, "llm_d_epp_flow_control_stale_endpoints") == [
        ({"detector": "utilization-detector"}, 1.0)
    ]
    for unit in ("requests", "bytes"):
        assert _values(m, f"llm_d_epp_flow_control_capacity_utilization_{unit}") == [
            ({"priority": "0", "inference_pool": "pool"}, 0.25)
        ]
    assert _values(m, "llm_d_epp_datalayer_poll_errors") == [
        ({"source_type": "metrics-data-source"}, 3.0)
    ]
    assert _values(m, "llm_d_inference_scheduler_datalayer_extract_errors") == [
        ({"source_type": "metrics-data-source", "extractor_type": "core-metrics-extractor"}, 1.0)
    ]
    assert _values(m, "llm_d_epp_flow_control_requests") == [
        ({"outcome": "RejectedCapacity", "priority": "-3", "inference_pool": "pool"}, 1.0)
    ]
