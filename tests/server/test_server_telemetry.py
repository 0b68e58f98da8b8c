"""Gateway metrics (upstream names, label cap, pool gauges), gRPC health and JSON logs."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import Iterable
from typing import cast

import grpc
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.errors import ModelNotFound, RequestShed
from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.telemetry.epp_collectors import ObserverStats
from poolkeeper.telemetry.exposition import Exposition
from poolkeeper.telemetry.health import (
    EXT_PROC_SERVICE,
    NOT_SERVING,
    SERVING,
    HealthService,
    check_health,
)
from poolkeeper.telemetry.labels import OTHER
from poolkeeper.telemetry.logs import configure_logging
from poolkeeper.telemetry.metrics import GatewayMetrics
from poolkeeper.telemetry.pool_collector import PoolStats


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


def test_token_metrics_count_only_what_the_server_reported() -> None:
    """A stream's usage counted by the gateway (the response observer, one token per event)
    steers fairness, never the token histograms (upstream counts only a response's usage)."""
    m = GatewayMetrics()
    d = _decision()
    m.routed(d, 10, 0.001)
    m.finished(d, status=200, usage=Usage(30, 7, estimated=True), seconds=1.0, response_bytes=9)
    labels = (("model_name", "chat"), ("target_model_name", "lora-a"))
    s = _samples(m)
    assert s[("inference_model_request_duration_seconds_count", labels)] == 1
    assert ("inference_model_output_tokens_count", labels) not in s
    assert ("inference_model_input_tokens_count", labels) not in s


def test_the_response_observers_waiting_room_is_exported() -> None:
    m = GatewayMetrics()
    stats = [ObserverStats(waiting=3, settled=10, given_up=1)]
    m.follow_observer(lambda: stats[0])
    s = _samples(m)
    assert s[("inference_extension_response_observer_waiting", ())] == 3
    assert s[("inference_extension_response_observer_settled_total", ())] == 10
    assert s[("inference_extension_response_observer_given_up_total", ())] == 1
    stats[0] = ObserverStats(waiting=0, settled=13, given_up=1)  # read at every scrape
    assert _samples(m)[("inference_extension_response_observer_waiting", ())] == 0


def test_errors_are_counted_by_code() -> None:
    m = GatewayMetrics()
    m.rejected("chat", RequestShed("busy"), 10)
    d = _decision()
    m.routed(d, 10, 0.001)
    m.finished(d, status=500, usage=None, seconds=0.1, response_bytes=0)
    s = _samples(m)
    err = "inference_model_request_error_total"
    shed = (("error_code", "InferencePoolResourceExhausted"), ("model_name", "chat"),
            ("target_model_name", ""))  # fmt: skip
    assert s[(err, shed)] == 1
    base = (("model_name", "chat"), ("target_model_name", "lora-a"))
    assert s[(err, (("error_code", "ModelServerError"), *base))] == 1
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


# --- upstream fidelity (pkg/epp/metrics/metrics.go@v0.5.1 and metrics_test.go) ---------------


def _buckets(m: GatewayMetrics, name: str) -> list[float]:
    for family in text_string_to_metric_families(m.render().decode()):
        if family.name == name:
            return sorted(
                {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
            )
    raise AssertionError(f"no family {name}")


def test_metrics_go_histogram_buckets() -> None:
    m = GatewayMetrics()
    d = _decision()
    m.routed(d, 10, 0.001)
    m.finished(d, status=200, usage=Usage(5, 5), seconds=1.0, response_bytes=10)
    inf = float("inf")
    powers = [float(64 << i) for i in range(25)]
    assert _buckets(m, "inference_model_request_sizes") == [*powers, inf]
    assert powers[-1] == 1 << 30
    assert _buckets(m, "inference_model_response_sizes") == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, inf,
    ]  # fmt: skip
    assert _buckets(m, "inference_model_input_tokens") == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
        262144, 524288, 1048576, inf,
    ]  # fmt: skip
    assert _buckets(m, "inference_model_output_tokens") == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, inf,
    ]  # fmt: skip
    assert _buckets(m, "inference_extension_scheduler_e2e_duration_seconds") == [
        0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, inf,
    ]  # fmt: skip
    assert _buckets(m, "inference_model_normalized_time_per_output_token_seconds") == [
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, inf,
    ]  # fmt: skip


def test_metrics_go_no_created_series() -> None:
    m = GatewayMetrics()
    m.routed(_decision(), 10, 0.001)
    text = m.render().decode()
    assert "_created" not in text
    assert "inference_model_request_total{" in text


def test_metrics_go_normalized_time_per_output_token() -> None:
    m = GatewayMetrics()
    d = _decision()
    m.routed(d, 10, 0.001)
    m.finished(d, status=200, usage=Usage(30, 8), seconds=2.0, response_bytes=100)
    s = _samples(m)
    labels = (("model_name", "chat"), ("target_model_name", "lora-a"))
    assert s[("inference_model_normalized_time_per_output_token_seconds_sum", labels)] == 0.25
    # no output tokens: nothing to normalise by (upstream skips, as for zero token counts)
    m.routed(d, 10, 0.001)
    m.finished(d, status=200, usage=Usage(30, 0), seconds=2.0, response_bytes=100)
    s = _samples(m)
    assert s[("inference_model_normalized_time_per_output_token_seconds_count", labels)] == 1
    assert s[("inference_model_output_tokens_count", labels)] == 1


def test_metrics_go_info_and_per_pod_queue_size() -> None:
    stats = [PoolStats("pool-a", 0.5, 2.0, 2, (("pod-0", 3.0), ("pod-1", 1.0)))]
    m = GatewayMetrics(pool_stats=lambda: stats)
    s = _samples(m)
    per_pod = "inference_pool_per_pod_queue_size"
    assert s[(per_pod, (("model_server_pod", "pod-0"), ("name", "pool-a")))] == 3
    assert s[(per_pod, (("model_server_pod", "pod-1"), ("name", "pool-a")))] == 1
    (info,) = [labels for name, labels in s if name == "inference_extension_info"]
    assert dict(info)["build_ref"].startswith("poolkeeper-")
    assert set(dict(info)) == {"commit", "build_ref"}


def test_unknown_model_is_bad_configuration_and_shed_errors_carry_the_target() -> None:
    m = GatewayMetrics()
    m.rejected("nope", ModelNotFound("model nope not found"), 10)
    shed = RequestShed("busy")
    shed.target_model = "lora-a"
    m.rejected("chat", shed, 10)
    s = _samples(m)
    err = "inference_model_request_error_total"
    assert s[(err, (("error_code", "BadConfiguration"), ("model_name", "nope"),
                    ("target_model_name", "")))] == 1  # fmt: skip
    assert s[(err, (("error_code", "InferencePoolResourceExhausted"), ("model_name", "chat"),
                    ("target_model_name", "lora-a")))] == 1  # fmt: skip


def test_closed_stream_is_not_an_error() -> None:
    m = GatewayMetrics()
    d = _decision()
    m.routed(d, 10, 0.001)
    m.finished(d, status=499, usage=None, seconds=0.1, response_bytes=0)
    s = _samples(m)
    assert not [k for k in s if k[0] == "inference_model_request_error_total"]
    assert s[("inference_model_running_requests", (("model_name", "chat"),))] == 0


def test_v1_1_objective_names_beside_the_model_names() -> None:
    m = GatewayMetrics()
    d = _decision()
    m.routed(d, 10, 0.001)
    m.finished(d, status=200, usage=Usage(3, 4), seconds=1.0, response_bytes=10)
    s = _samples(m)
    model_series = {k: v for k, v in s.items() if k[0].startswith("inference_model_")}
    assert model_series
    for (name, labels), value in model_series.items():
        twin = "inference_objective_" + name.removeprefix("inference_model_")
        if name == "inference_model_request_total":  # v1.x added `priority` (upstream's)
            labels = tuple(sorted([*labels, ("priority", "0")]))
        assert s[(twin, labels)] == value
    plain = _samples(GatewayMetrics(objective_names=False))
    assert not [k for k in plain if k[0].startswith("inference_objective_")]


def test_plugin_durations_and_prefix_indexer_from_scheduling_stats() -> None:
    stats = SchedulingStats()
    stats.plugin("Scorer", "queue-scorer", "queue-scorer").observe(0.0003)
    stats.plugin("Scorer", "prefix-cache-scorer", "a").observe(0.00005)
    stats.plugin("Scorer", "prefix-cache-scorer", "b").observe(0.2)
    stats.add_prefix_index(lambda: 42)
    stats.prefix_match(128, 256)
    stats.prefix_match(0, 0)
    s = _samples(GatewayMetrics(scheduling=stats))
    v05 = "inference_extension_scheduler_plugin_duration_seconds"
    prefix = (("plugin_name", "prefix-cache-scorer"), ("plugin_type", "Scorer"))
    assert s[(v05 + "_count", prefix)] == 2  # two instances of one type add up
    assert s[(v05 + "_bucket", (("le", "0.0001"), *prefix))] == 1
    v10 = "inference_extension_plugin_duration_seconds_count"
    assert s[(v10, (("extension_point", "Scorer"), ("plugin_name", "b"),
                    ("plugin_type", "prefix-cache-scorer")))] == 1  # fmt: skip
    assert s[("inference_extension_prefix_indexer_size", ())] == 42
    assert s[("inference_extension_prefix_indexer_hit_bytes_count", ())] == 2
    assert s[("inference_extension_prefix_indexer_hit_ratio_count", ())] == 1
    assert s[("inference_extension_prefix_indexer_hit_ratio_sum", ())] == 0.5


async def test_a_scrape_renders_the_instruments_off_the_event_loop() -> None:
    """Outside audit: 1,000 fairness ids of one model made /metrics 64 MB, whose 3 s of
    rendering on the event loop held every request that long. The collectors of the EPP's
    state still run on the loop (that state is not thread-safe); prometheus_client's
    instruments and the text, nearly all of a large page, run on the metrics thread. Driven
    through the app's /metrics handler, so an on-loop render there fails it."""
    seen: dict[str, threading.Thread] = {}

    def pools() -> list[PoolStats]:
        seen["pools"] = threading.current_thread()
        return []

    class Probe(Counter):
        def collect(self) -> Iterable[Metric]:
            seen["instrument"] = threading.current_thread()
            return super().collect()

    m = GatewayMetrics(pool_stats=pools)
    Probe(
        "audit_probe", "an instrument that notes the thread collecting it", registry=m.registry
    ).inc()
    try:
        async with TestClient(TestServer(m.app())) as http:
            response = await http.get("/metrics")
            assert response.status == 200
            page = await response.read()
        assert seen["pools"] is threading.current_thread()
        assert seen["instrument"].name.startswith("metrics-render")
        assert page == m.render()
        assert b"audit_probe_total 1.0" in page
    finally:
        await m.close()


async def test_concurrent_scrapes_share_one_render() -> None:
    """Review of the outside audit: 8 scrapes at once rendered the page 8 times (5 s each on a
    large page). Scrapes that arrive while a render is in flight get its page; one that
    arrives after it ended renders anew."""
    renders = {"pools": 0}
    release = threading.Event()

    def pools() -> list[PoolStats]:
        renders["pools"] += 1  # once per render: its snapshot, on the loop
        return []

    class Gate(Counter):
        def collect(self) -> Iterable[Metric]:
            assert release.wait(10)  # holds the render until every scrape has come
            return super().collect()

    m = GatewayMetrics(pool_stats=pools)
    Gate("audit_gate", "holds the render", registry=m.registry).inc()
    try:
        scrapes = [asyncio.create_task(m.render_off_loop()) for _ in range(8)]
        await asyncio.sleep(0)  # every scrape is waiting now: the first on its render
        release.set()
        pages = await asyncio.gather(*scrapes)
        assert renders["pools"] == 1
        assert len(set(pages)) == 1
        assert b"audit_gate_total 1.0" in pages[0]
        assert await m.render_off_loop() == pages[0]
        assert renders["pools"] == 2
    finally:
        await m.close()


async def test_a_scraper_gone_does_not_cancel_the_others_page() -> None:
    release = threading.Event()

    class Gate(Counter):
        def collect(self) -> Iterable[Metric]:
            assert release.wait(10)
            return super().collect()

    m = GatewayMetrics()
    Gate("audit_gate", "holds the render", registry=m.registry).inc()
    try:
        gone, staying = (asyncio.create_task(m.render_off_loop()) for _ in range(2))
        await asyncio.sleep(0)
        gone.cancel()
        release.set()
        assert b"audit_gate_total 1.0" in await staying
        assert gone.cancelled()
    finally:
        await m.close()


async def test_a_registry_without_the_private_attributes_is_collected_at_once() -> None:
    """The snapshot reads prometheus_client's private `_lock` and `_collector_to_names`;
    where a release lacks them, every family is collected on the caller's thread (the page
    as before the audit) instead of failing the scrape."""
    seen: list[threading.Thread] = []

    class Probe(Counter):
        def collect(self) -> Iterable[Metric]:
            seen.append(threading.current_thread())
            return super().collect()

    class PublicOnly:
        """A registry with only the public `collect`."""

        def __init__(self, registry: CollectorRegistry) -> None:
            self.collect = registry.collect

    m = GatewayMetrics()
    Probe("audit_probe", "notes its thread", registry=m.registry).inc()
    exposition = Exposition(cast(CollectorRegistry, PublicOnly(m.registry)), objective_names=True)
    snapshot = exposition.snapshot()
    assert seen == [threading.current_thread()]
    page = await asyncio.to_thread(generate_latest, snapshot)
    assert seen == [threading.current_thread()]  # nothing left to collect off the loop
    assert page == m.render()
    assert b"audit_probe_total 1.0" in page
