"""GatewayConfig: defaults, validation errors with field paths, and the shipped example."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from poolkeeper.config.gateway import (
    Engine,
    GatewayConfig,
    RequestHandling,
    TrustedHeader,
    UnknownModelPolicy,
    host_errors,
)
from poolkeeper.config.load import load_paths, load_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _doc(spec: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "poolkeeper.dev/v1alpha1",
            "kind": "GatewayConfig",
            "metadata": {"name": "default"},
            "spec": spec,
        }
    )


def _errors(spec: dict[str, Any]) -> list[tuple[str, str]]:
    result = load_text(_doc(spec), "gw.yaml")
    return [(e.path, e.message) for e in result.errors]


def test_empty_spec_gives_documented_defaults() -> None:
    result = load_text(_doc({}), "gw.yaml")
    assert result.ok, result.errors
    config = result.objects_of(GatewayConfig)[0]
    assert config == GatewayConfig.default()
    listeners = config.spec.listeners
    assert (listeners.address, listeners.http, listeners.ext_proc) == ("127.0.0.1", 8080, 9002)
    assert (listeners.metrics, listeners.health, listeners.admin) == (9090, 9003, 9901)
    assert config.spec.endpoints == []
    handling = config.spec.request_handling
    # Unset: by the pool's generation (v1 pools pass any model through, x-k8s ones 404).
    assert handling.unknown_model_policy is None
    assert set(handling.trusted_headers) == set(TrustedHeader)
    assert handling.max_body_bytes == 16 * 1024 * 1024
    assert handling.inject_stream_usage is True
    assert handling.fallback_endpoints == 3
    assert handling.default_pool is None
    assert config.metadata.name == "default"


def test_example_loads_with_the_api_objects() -> None:
    result = load_paths([EXAMPLES])
    assert result.ok, [str(e) for e in result.errors]
    configs = result.objects_of(GatewayConfig)
    assert len(configs) == 1
    endpoints = configs[0].spec.endpoints
    assert [(e.name, e.address, e.port) for e in endpoints] == [
        (f"sim-{i}", "127.0.0.1", 8001 + i) for i in range(4)
    ]
    assert all(e.labels == {"app": "vllm-llama3-8b"} for e in endpoints)
    for pool in result.pools():  # the example pool (when present) selects every endpoint
        assert all(pool.matches(e.labels) for e in endpoints)


def test_camel_and_snake_case_and_round_trip() -> None:
    config = GatewayConfig.model_validate(
        {"spec": {"requestHandling": {"unknown_model_policy": "PassthroughSheddable"}}}
    )
    assert config.spec.request_handling.unknown_model_policy is (
        UnknownModelPolicy.PASSTHROUGH_SHEDDABLE
    )
    dumped = config.model_dump(mode="json", by_alias=True)
    assert dumped["spec"]["requestHandling"]["unknownModelPolicy"] == "PassthroughSheddable"
    assert "extProc" in dumped["spec"]["listeners"]
    assert GatewayConfig.model_validate(dumped) == config


def test_endpoint_optional_fields() -> None:
    config = GatewayConfig.model_validate(
        {"spec": {"endpoints": [{"name": "a", "address": "sim.local"}]}}
    )
    endpoint = config.spec.endpoints[0]
    assert (endpoint.port, endpoint.engine, endpoint.labels) == (None, None, {})
    config = GatewayConfig.model_validate(
        {"spec": {"endpoints": [{"name": "b", "address": "10.1.2.3", "engine": "sglang"}]}}
    )
    assert config.spec.endpoints[0].engine is Engine.SGLANG


def test_default_pool_gets_the_default_namespace() -> None:
    assert RequestHandling(default_pool="pool").default_pool == "default/pool"
    assert RequestHandling(default_pool="ns/pool").default_pool == "ns/pool"


@pytest.mark.parametrize(
    ("spec", "path", "message"),
    [
        ({"listeners": {"http": 0}}, "spec.listeners.http", "greater than or equal to 1"),
        ({"listeners": {"metrics": 65536}}, "spec.listeners.metrics", "less than or equal"),
        (
            {"listeners": {"http": 9002}},
            "spec.listeners.extProc",
            "Duplicate value: 9002: already used by http",
        ),
        (
            {"listeners": {"admin": 9090}},
            "spec.listeners.admin",
            "Duplicate value: 9090: already used by metrics",
        ),
        ({"listeners": {"address": "::1"}}, "spec.listeners.address", "IPv6"),
        ({"listeners": {"htp": 1}}, "spec.listeners.htp", 'unknown field "spec.listeners.htp"'),
        ({"endpoints": [{"address": "1.2.3.4"}]}, "spec.endpoints[0].name", "Required value"),
        ({"endpoints": [{"name": "a"}]}, "spec.endpoints[0].address", "Required value"),
        (
            {"endpoints": [{"name": "A_1", "address": "1.2.3.4"}]},
            "spec.endpoints[0].name",
            "RFC 1123 subdomain",
        ),
        (
            {"endpoints": [{"name": "a", "address": "300.1.1.1"}]},
            "spec.endpoints[0].address",
            "must be an IPv4 address or a DNS hostname",
        ),
        (
            {"endpoints": [{"name": "a", "address": "bad host"}]},
            "spec.endpoints[0].address",
            "must be an IPv4 address or a DNS hostname",
        ),
        (
            {"endpoints": [{"name": "a", "address": "1.2.3.4", "port": 0}]},
            "spec.endpoints[0].port",
            "greater than or equal to 1",
        ),
        (
            {"endpoints": [{"name": "a", "address": "1.2.3.4", "labels": {"a b": "x"}}]},
            "spec.endpoints[0].labels",
            'Invalid value: "a b"',
        ),
        (
            {"endpoints": [{"name": "a", "address": "1.2.3.4", "labels": {"app": "x" * 64}}]},
            "spec.endpoints[0].labels",
            "must be no more than 63 characters",
        ),
        (
            {"endpoints": [{"name": "a", "address": "1.2.3.4", "engine": "tgi"}]},
            "spec.endpoints[0].engine",
            'Unsupported value: "tgi"',
        ),
        (
            {"endpoints": [{"name": "a", "address": "1.2.3.4", "weight": 2}]},
            "spec.endpoints[0].weight",
            "unknown field",
        ),
        (
            {"endpoints": [{"name": "a", "address": "h"}, {"name": "a", "address": "i"}]},
            "spec.endpoints[1].name",
            'Duplicate value: "a": already used by endpoints[0]',
        ),
        (
            {
                "endpoints": [
                    {"name": "a", "address": "h", "port": 1},
                    {"name": "b", "address": "h", "port": 1},
                ]
            },
            "spec.endpoints[1].port",
            'Duplicate value: "h:1"',
        ),
        (
            {"requestHandling": {"unknownModelPolicy": "Allow"}},
            "spec.requestHandling.unknownModelPolicy",
            'supported values: "Reject", "PassthroughSheddable"',
        ),
        (
            {"requestHandling": {"maxBodyBytes": 100}},
            "spec.requestHandling.maxBodyBytes",
            "greater than or equal to 1024",
        ),
        (
            {"requestHandling": {"fallbackEndpoints": 17}},
            "spec.requestHandling.fallbackEndpoints",
            "less than or equal to 16",
        ),
        (
            {"requestHandling": {"defaultPool": "Bad/Pool"}},
            "spec.requestHandling.defaultPool",
            'Invalid value: "Bad/Pool"',
        ),
        (
            {"requestHandling": {"injectStreamUsage": "maybe"}},
            "spec.requestHandling.injectStreamUsage",
            "boolean",
        ),
        (
            {"flowControl": {"bands": {"standard": {"ttlMs": 90000}}}},
            "spec.edge.eppTimeoutS",
            "must exceed the longest flow-control queue TTL (flowControl.bands.standard.ttlMs",
        ),
        ({"endpoint": []}, "spec.endpoint", "unknown field"),
        (
            {"flowControl": {"enabled": False, "holdNewPrefixes": {}}},
            "spec.flowControl",
            "holdNewPrefixes needs flow control (enabled: true)",
        ),
    ],
)
def test_invalid_fields_report_their_path(spec: dict[str, Any], path: str, message: str) -> None:
    errors = _errors(spec)
    assert any(p == path and message in m for p, m in errors), errors


def test_wrong_api_version_is_reported() -> None:
    text = _doc({}).replace("poolkeeper.dev/v1alpha1", "poolkeeper.dev/v2")
    result = load_text(text, "gw.yaml")
    assert not result.ok
    assert "poolkeeper.dev/v1alpha1" in str(result.errors[0])


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1", True),
        ("0.0.0.0", True),
        ("sim-0.default.svc.cluster.local", True),
        ("localhost", True),
        ("::1", False),
        ("1.2.3", False),
        ("999.1.1.1", False),
        ("-bad.example", False),
        ("a" * 64 + ".example", False),
        ("", False),
    ],
)
def test_host_rules(host: str, ok: bool) -> None:
    assert (host_errors(host) == []) is ok


def test_epp_timeout_must_outlast_the_longest_queue_ttl() -> None:
    """A request still queued when Envoy gives up on the EPP would get Envoy's 504 (the error
    and its path are in the table above); fine when Envoy waits longer, when the band does not
    queue, or without flow control."""
    with pytest.raises(ValidationError, match=r"standard\.ttlMs 90000"):
        GatewayConfig.model_validate(
            {"spec": {"flowControl": {"bands": {"standard": {"ttlMs": 90000}}}}}
        )
    # A held request's TTL starts when its hold ends: the hold counts too.
    held = {"holdNewPrefixes": {"maxHoldMs": 10000}, "bands": {"standard": {"ttlMs": 55000}}}
    with pytest.raises(ValidationError, match=r"ttlMs 55000\) plus holdNewPrefixes\.maxHoldMs"):
        GatewayConfig.model_validate({"spec": {"flowControl": held}})
    # The hold is on by default: where it does not fit it steps aside (configs that loaded
    # before it was on still load, and say so: a dump round-trips), set explicitly it errs.
    defaulted: list[dict[str, Any]] = [
        {"flowControl": {"bands": {"standard": {"ttlMs": 59000}}}},
        {"edge": {"eppTimeoutS": 31}},
    ]
    for old in defaulted:
        config = GatewayConfig.model_validate({"spec": old})
        assert config.spec.flow_control.hold_new_prefixes is None
        # ... and say so: the EPP logs this at start.
        assert "holdNewPrefixes is off" in (config.spec.hold_left_out() or "")
        dumped = config.model_dump(by_alias=True, exclude_unset=True)
        assert GatewayConfig.model_validate(dumped) == config
    assert GatewayConfig.model_validate({"spec": {}}).spec.flow_control.hold_new_prefixes
    # Nothing to say where the hold is on, or off where it would have fitted.
    assert GatewayConfig.model_validate({"spec": {}}).spec.hold_left_out() is None
    off = {"flowControl": {"holdNewPrefixes": None}}
    assert GatewayConfig.model_validate({"spec": off}).spec.hold_left_out() is None
    late = GatewayConfig.model_validate({"spec": {**off, "edge": {"eppTimeoutS": 31}}})
    assert late.spec.hold_left_out() == (
        "flowControl.holdNewPrefixes is off (its default would not fit): the longest queue "
        "TTL (flowControl.bands."
        "standard.ttlMs 30000) plus the hold's maxHoldMs 2000 reaches edge.eppTimeoutS 31"
    )
    for spec in (
        {"flowControl": held, "edge": {"eppTimeoutS": 66}},
        {"flowControl": {"bands": {"standard": {"ttlMs": 90000}}}, "edge": {"eppTimeoutS": 120}},
        {"flowControl": {"bands": {"standard": {"ttlMs": 90000, "mode": "shed"}}}},
        {"flowControl": {"enabled": False, "bands": {"standard": {"ttlMs": 90000}}}},
    ):
        GatewayConfig.model_validate({"spec": spec})
