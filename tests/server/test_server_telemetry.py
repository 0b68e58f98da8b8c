"""Gateway metrics (upstream names, label cap, pool gauges), gRPC health and JSON logs."""

from __future__ import annotations

import io
import json
import logging

import grpc
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.errors import RequestShed
from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.telemetry.health import (
    EXT_PROC_SERVICE,
    NOT_SERVING,
    SERVING,
    HealthService,
    check_health,
)
from poolkeeper.telemetry.logs import configure_logging
from poolkeeper.telemetry.metrics import OTHER, GatewayMetrics, PoolStats


def _samples(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _decision(model: str = "chat", target: str = "lora-a") -> RoutingDecision:
    return RoutingDecision("r1", ("10.0.0.1:8000",), "default/pool", model, target)


def test_request_lifecycle_metrics_have_upstream_names() -> None:
    m = GatewayMetrics()
    d = _decision()
    m.routed(d, 512, 0.0004)
    labels = (("model_name", "chat"), ("target_model_name", "lora-a"))
    s = _samples(m)
    assert s[("inference_model_request_total", labels)] == 1
    assert s[("inference_model_running_requests", (("model_name", "chat"),))] == 1
    assert s[("inference_model_request_sizes_sum", labels)] == 512
    assert s[("inference_extension_scheduler_e2e_duration_seconds_count", ())] == 1
    m.finished(d, status=200, usage=Usage(30, 7), seconds=1.5, response_bytes=900)
    s = _samples(m)
    assert s[("inference_model_running_requests", (("model_name", "chat"),))] == 0
    assert s[("inference_model_request_duration_seconds_sum", labels)] == 1.5
    assert s[("inference_model_input_tokens_sum", labels)] == 30
    assert s[("inference_model_output_tokens_sum", labels)] == 7
    assert s[("inference_model_response_sizes_sum", labels)] == 900


def test_errors_are_counted_by_code() -> None:
    m = GatewayMetrics()
    m.rejected("chat", RequestShed("busy"), 10)
    d = _decision()
    m.routed(d, 10, 0.001)
    m.finished(d, status=500, usage=None, seconds=0.1, response_bytes=0)
    m.routed(d, 10, 0.001)
    m.finished(d, status=499, usage=None, seconds=0.1, response_bytes=0)
    s = _samples(m)
    err = "inference_model_request_error_total"
    shed = (("error_code", "InferencePoolResourceExhausted"), ("model_name", "chat"),
            ("target_model_name", ""))  # fmt: skip
    assert s[(err, shed)] == 1
    base = (("model_name", "chat"), ("target_model_name", "lora-a"))
    assert s[(err, (("error_code", "ModelServerError"), *base))] == 1
    assert s[(err, (("error_code", "Cancelled"), *base))] == 1
    assert s[("inference_model_running_requests", (("model_name", "chat"),))] == 0


def test_label_cardinality_is_capped() -> None:
    m = GatewayMetrics(max_label_values=3)
    for i in range(50):
        m.rejected(f"random-{i}", RequestShed("x"), 1)
    names = {
        dict(labels)["model_name"]
        for (name, labels) in _samples(m)
        if name == "inference_model_request_error_total"
    }
    assert names == {"random-0", "random-1", "random-2", OTHER}


def test_pool_gauges_come_from_the_source_at_scrape_time() -> None:
    stats = [PoolStats("pool-a", 0.25, 3.0, 2)]
    m = GatewayMetrics(pool_stats=lambda: stats)
    s = _samples(m)
    assert s[("inference_pool_average_kv_cache_utilization", (("name", "pool-a"),))] == 0.25
    assert s[("inference_pool_average_queue_size", (("name", "pool-a"),))] == 3.0
    assert s[("inference_pool_ready_pods", (("name", "pool-a"),))] == 2
    stats[0] = PoolStats("pool-a", 0.5, 0.0, 1)
    assert _samples(m)[("inference_pool_ready_pods", (("name", "pool-a"),))] == 1


def test_instances_do_not_share_a_registry() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a.routed(_decision(), 1, 0.001)
    assert not any(n == "inference_model_request_total" for n, _ in _samples(b))


async def test_grpc_health_liveness_and_readiness() -> None:
    ready = {"value": False}
    health = HealthService.for_gateway(live=lambda: True, ready=lambda: ready["value"])
    server = grpc.aio.server()
    health.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        assert await check_health(address, "liveness") == SERVING
        assert await check_health(address, "readiness") == NOT_SERVING
        assert await check_health(address, EXT_PROC_SERVICE) == SERVING  # answering = live
        ready["value"] = True
        assert await check_health(address, "readiness") == SERVING
    finally:
        await server.stop(None)


async def test_cmd_epp_health_answers_any_service_name() -> None:
    """Upstream `cmd/epp/health.go` answers every service name alike; v0.3-v0.5 Deployments probe
    `inference-extension` (`config/manifests/inferencepool*.yaml`), so it must not be NOT_FOUND."""
    answering = {"value": False}
    health = HealthService.for_gateway(
        live=lambda: True, ready=lambda: False, answering=lambda: answering["value"]
    )
    server = grpc.aio.server()
    health.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        assert await check_health(address, "inference-extension") == NOT_SERVING
        assert await check_health(address, "anything.else") == NOT_SERVING
        answering["value"] = True
        assert await check_health(address, "inference-extension") == SERVING
        assert await check_health(address, "anything.else") == SERVING
    finally:
        await server.stop(None)


def test_health_without_default_still_reports_unknown_services() -> None:
    assert HealthService({"x": lambda: True}).status("y") is None


def test_json_logs() -> None:
    stream = io.StringIO()
    configure_logging("info", stream=stream)
    try:
        logging.getLogger("poolkeeper.test").info("routed request_id=%s", "abc")
        entry = json.loads(stream.getvalue().splitlines()[-1])
        assert entry["msg"] == "routed request_id=abc"
        assert entry["level"] == "info"
    finally:
        root = logging.getLogger("poolkeeper")
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.propagate = True
