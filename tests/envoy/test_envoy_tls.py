"""Real Envoy speaks ext_proc to the EPP over TLS, as a Gateway does to upstream's EPP: an
`UpstreamTlsContext` with ALPN h2 and no validation on the EPP cluster (the bootstrap's own
`epp_tls`, what `serve --secure-serving` gives the managed Envoy), the EPP serving a
self-signed certificate (`extproc.tls`), on either transport; and an Envoy presenting a client
certificate to an EPP that requires one (`--client-ca-file`)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp
import grpc
import pytest

from poolkeeper.controller.files import file_source
from poolkeeper.envoy.bootstrap import EPP_CLUSTER, build_bootstrap, render
from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.extproc.lean import start_lean
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.extproc.tls import TlsSettings, server_credentials, ssl_context
from poolkeeper.netutil import free_port
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.transport import Stoppable, health_methods
from poolkeeper.telemetry.health import (
    SERVICE_NAME,
    HealthCheckRequest,
    HealthCheckResponse,
    HealthService,
)
from tests.envoy.envoy_harness import (
    Backend,
    RoundRobinRouter,
    rig_params,
    running_envoy,
    supervised_envoy,
)
from tests.extproc.test_extproc_mtls import issue_client, make_ca
from tests.support.gateway_files import one_pool
from tests.support.sim_gateway import MODEL, running_gateway, sim_server

pytestmark = pytest.mark.integration

TLS_CONTEXT = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


def test_the_bootstrap_dials_a_tls_epp_as_upstreams_preset() -> None:
    """The EPP cluster as upstream's gateway presets dial it: TLS, ALPN h2, no validation."""
    params = rig_params([], 9002, Path("/e.json"), fail_open=False)
    plain = build_bootstrap(params)["static_resources"]["clusters"]
    assert not [c for c in plain if "transport_socket" in c]
    tls = build_bootstrap(dataclasses.replace(params, epp_tls=True))["static_resources"]
    (epp,) = [c for c in tls["clusters"] if c["name"] == EPP_CLUSTER]
    assert epp["transport_socket"]["typed_config"] == {
        "@type": TLS_CONTEXT,
        "common_tls_context": {"alpn_protocols": ["h2"]},
    }


async def tls_epp(
    transport: str, servicer: ExtProcServicer, health: HealthService, settings: TlsSettings
) -> tuple[Stoppable, int]:
    """The EPP's ext_proc port serving TLS on `transport`, started; (server, port)."""
    if transport == "lean":
        lean = await start_lean(
            servicer, "127.0.0.1", free_port(), tls=ssl_context(settings),
            more=health_methods(health),
        )  # fmt: skip
        return lean, lean.port
    server, port = build_server(
        servicer,
        f"127.0.0.1:{free_port()}",
        extra=health.register,
        credentials=server_credentials(settings),
    )
    await server.start()
    return server, port


async def test_envoy_routes_through_an_epp_serving_tls(tmp_path: Path, transport: str) -> None:
    backends = [Backend("a"), Backend("b")]
    for b in backends:
        await b.start()
    health = HealthService.for_gateway(live=lambda: True, ready=lambda: True)
    servicer = ExtProcServicer(RoundRobinRouter(backends))
    settings = TlsSettings(secure_serving=True)
    server, epp_port = await tls_epp(transport, servicer, health, settings)
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write([b.hostport for b in backends])
    params = rig_params(backends, epp_port, endpoints.path, fail_open=False)
    params = dataclasses.replace(params, epp_tls=True)
    try:
        # Until Envoy counts the EPP healthy, too: this pool is FailClose (running_envoy).
        async with running_envoy(params, tmp_path):
            url = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
            served = set()
            async with aiohttp.ClientSession() as session:
                for _ in range(4):
                    async with session.post(url, json={"model": "m", "messages": []}) as resp:
                        assert resp.status == 200, await resp.text()
                        served.add((await resp.json())["served_by"])
            assert len(served) == 2  # the EPP's picks, both backends
            # The EPP cluster's connections really are TLS.
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{params.admin_port}/stats?filter=epp.ssl") as resp,
            ):
                stats = dict(
                    line.split(": ", 1) for line in (await resp.text()).splitlines() if ": " in line
                )
            assert int(stats[f"cluster.{EPP_CLUSTER}.ssl.handshake"]) >= 1
    finally:
        await server.stop(None)
        for b in backends:
            await b.stop()


async def test_serve_with_secure_serving_runs_its_envoy_over_tls(tmp_path: Path) -> None:
    """`serve --secure-serving` with the managed Envoy: the EPP serves ext_proc over TLS and
    the Envoy `serve` runs dials it so (ext_proc, health checks and the response observer's
    access log), and requests succeed."""
    async with (
        sim_server() as sim_port,
        running_gateway(
            ServeOptions(
                source=file_source([one_pool(tmp_path, sim_port, address="0.0.0.0")]),
                ready_wait_s=5,
                tls=TlsSettings(secure_serving=True),
            )
        ) as runtime,
    ):
        assert runtime.config is not None
        assert runtime.detached is not None
        listeners = runtime.config.spec.listeners
        url = f"http://127.0.0.1:{listeners.http}/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(url, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            async with session.get(
                f"http://127.0.0.1:{listeners.admin}/stats?filter=ssl.handshake"
            ) as resp:
                stats = await resp.text()
        assert f"cluster.{EPP_CLUSTER}.ssl.handshake: 0" not in stats
        assert f"cluster.{EPP_CLUSTER}.ssl.handshake" in stats
        for _ in range(100):  # the observer's access log reaches the EPP over TLS too
            if runtime.detached.settled >= 2:
                break
            await asyncio.sleep(0.05)
        assert runtime.detached.settled == 2
        # And the EPP's port really refuses plaintext.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{listeners.ext_proc}") as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await check(channel)


async def check(channel: grpc.aio.Channel) -> None:
    call = channel.unary_unary(
        f"/{SERVICE_NAME}/Check",
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )
    await call(HealthCheckRequest(service=""), timeout=2)


@pytest.mark.parametrize("presents", [True, False], ids=["client-cert", "no-client-cert"])
async def test_envoy_with_a_client_certificate_passes_an_epp_requiring_one(
    tmp_path: Path, presents: bool, transport: str
) -> None:
    """`--client-ca-file`: the Envoy given a certificate of the CA routes; one without fails
    closed (no ext_proc stream can open), the EPP never answering it; on both transports."""
    backends = [Backend("a")]
    await backends[0].start()
    ca, ca_key = make_ca("envoy-client-ca")
    client = issue_client(ca, ca_key, "envoy")
    (tmp_path / "ca.crt").write_bytes(ca.cert)
    health = HealthService.for_gateway(live=lambda: True, ready=lambda: True)
    settings = TlsSettings(secure_serving=True, client_ca_file=tmp_path / "ca.crt")
    servicer = ExtProcServicer(RoundRobinRouter(backends))
    server, epp_port = await tls_epp(transport, servicer, health, settings)
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write([b.hostport for b in backends])
    params = rig_params(backends, epp_port, endpoints.path, fail_open=False)
    bootstrap = build_bootstrap(dataclasses.replace(params, epp_tls=True))
    if presents:
        (epp,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == EPP_CLUSTER]
        epp["transport_socket"]["typed_config"]["common_tls_context"]["tls_certificates"] = [
            {
                "certificate_chain": {"inline_string": client.cert.decode()},
                "private_key": {"inline_string": client.key.decode()},
            }
        ]
    config = tmp_path / "envoy.json"
    config.write_text(render(bootstrap))
    try:
        async with supervised_envoy(config, params.admin_port) as envoy:
            if presents:  # FailClose: 503 until Envoy's first health check of the EPP passed
                assert await envoy.wait_healthy(EPP_CLUSTER), envoy.log_tail()
            url = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
            async with aiohttp.ClientSession() as session:
                for _ in range(2):
                    async with session.post(url, json={"model": "m", "messages": []}) as resp:
                        if presents:
                            assert resp.status == 200, await resp.text()
                            assert (await resp.json())["served_by"] == "a"
                        else:
                            assert resp.status >= 500, await resp.text()
            assert len(backends[0].seen) == (2 if presents else 0)
    finally:
        await server.stop(None)
        await backends[0].stop()
