"""Acceptance (issue 32): behind an Envoy that routes by the destination header alone, as
upstream's e2e gateway does (an ORIGINAL_DST cluster with `use_http_header`), requests through
the official openai client succeed with `poolkeeper epp`'s defaults (and `GET /v1/models`
reaches a pod).

Such an Envoy reads `x-gateway-destination-endpoint` as one `ip:port`: the comma list of a pick
plus fallbacks is no address to it, and every request got 503. The EPP here is the chart's
(Kubernetes mode, the API-server double) over two simulated pods, so a fallback list would have
had two entries. Loopback only: the pods are 127.0.0.1 and 127.0.0.2 on one port, as pods of
one InferencePool share their target port.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from poolkeeper.netutil import free_port
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet
from tests.envoy.envoy_harness import supervised_envoy
from tests.epp.test_epp_kube import _v1_pool, chart_epp
from tests.kube.conftest import fake, pod_obj
from tests.kube.fakeapi import FakeApiServer

__all__ = ["fake"]  # the API-server double fixture

pytestmark = pytest.mark.integration

MODEL = "Qwen/Qwen3-0.6B"  # no InferenceObjective names it: passed through at priority 0

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def original_dst_bootstrap(
    listen: int, admin: int, ext_proc: int, *, tls: bool = False
) -> dict[str, Any]:
    """Upstream's e2e gateway, reduced to loopback: ext_proc (FULL_DUPLEX_STREAMED both ways)
    to the EPP, then every path to an ORIGINAL_DST cluster that takes its address from the
    header the EPP sets. h2 to the EPP, over TLS with `tls` as upstream's standalone Envoy
    preset dials a `--secure-serving` EPP (no certificate validation, ALPN h2)."""
    ext_proc_filter = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "message_timeout": "1000s",
        },
    }
    route = {"cluster": "original_destination_cluster", "timeout": "86400s"}
    manager = {
        "@type": HCM + "HttpConnectionManager",
        "stat_prefix": "http",
        "route_config": {
            "name": "local_route",
            "virtual_hosts": [
                {
                    "name": "backend",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }
            ],
        },
        "http_filters": [
            ext_proc_filter,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    original_dst = {
        "name": "original_destination_cluster",
        "type": "ORIGINAL_DST",
        "connect_timeout": "10s",
        "lb_policy": "CLUSTER_PROVIDED",
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        },
    }
    epp = {
        "name": "ext_proc",
        "type": "STATIC",
        "connect_timeout": "10s",
        "typed_extension_protocol_options": {
            HTTP_OPTIONS: {
                "@type": "type.googleapis.com/" + HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "ext_proc",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(ext_proc)}}]}],
        },
    }
    if tls:
        epp["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    return {
        "admin": {"address": _address(admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "listener_0",
                    "address": _address(listen),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [original_dst, epp],
        },
    }


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


@asynccontextmanager
async def original_dst_envoy(
    workdir: Path, ext_proc: int, *, tls: bool = False
) -> AsyncIterator[str]:
    """The Envoy above, ready; yields its URL."""
    listen, admin = free_port(), free_port()
    config = workdir / "envoy-original-dst.json"
    config.write_text(json.dumps(original_dst_bootstrap(listen, admin, ext_proc, tls=tls)))
    async with supervised_envoy(config, admin):
        yield f"http://127.0.0.1:{listen}"


_PORT_TRIES = 8


async def _two_pods_one_port() -> tuple[SimCluster, SimCluster]:
    """A simulator on 127.0.0.1:P and one on 127.0.0.2:P, started. The kernel picks P free on
    127.0.0.1 only; another process on this host may hold it on 127.0.0.2 (other test runs use
    127.0.0.x too), so a taken P is given up for another, a bounded number of times."""
    for _ in range(_PORT_TRIES):
        first = SimCluster(build_fleet(count=1, cli=ServerSettings(model=MODEL), name_prefix="a"))
        second = SimCluster(
            build_fleet(count=1, cli=ServerSettings(model=MODEL), name_prefix="b"),
            host="127.0.0.2",
            base_port=(await first.start())[0].port,
        )
        try:
            await second.start()
            return first, second
        except OSError:
            await second.stop()
            await first.stop()
    raise AssertionError(f"no port free on both 127.0.0.1 and 127.0.0.2 in {_PORT_TRIES} tries")


async def test_requests_succeed_behind_original_dst_with_use_http_header(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = await _two_pods_one_port()
    port = first.servers[0].port
    try:
        fake.put(_v1_pool(port), "inferencepools")
        fake.put(pod_obj("sim-0", "127.0.0.1"), "pods")
        fake.put(pod_obj("sim-1", "127.0.0.2"), "pods")
        async with (
            chart_epp(fake, tmp_path, monkeypatch) as epp,
            original_dst_envoy(tmp_path, epp.ext_proc) as url,
        ):
            client = openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30
            )
            messages: Any = [{"role": "user", "content": "hello there"}]
            try:
                for _ in range(4):
                    raw = await client.chat.completions.with_raw_response.create(
                        model=MODEL, messages=messages, max_tokens=4
                    )
                    assert raw.http_response.status_code == 200
                    assert raw.parse().choices[0].message.content
                stream = await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=4, stream=True
                )
                pieces = [c.choices[0].delta.content async for c in stream if c.choices]
                assert "".join(p or "" for p in pieces)
                completion = await client.completions.create(
                    model=MODEL, prompt="once upon", max_tokens=3
                )
                assert completion.choices[0].text
                listing = await client.models.list()  # body-less: a pod's own list, as upstream
                assert MODEL in [m.id async for m in listing]
            finally:
                await client.close()
        served = [s.engine.counters.requests_submitted for c in (first, second) for s in c.servers]
        assert sum(served) == 6, served
    finally:
        await second.stop()
        await first.stop()
