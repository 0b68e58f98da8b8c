"""Real Envoy speaks ext_proc to the EPP over TLS, as a Gateway does to upstream's EPP: an
`UpstreamTlsContext` with ALPN h2 and no validation on the EPP cluster, the EPP serving a
self-signed certificate (`extproc.tls`), on either transport."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from poolkeeper.envoy.bootstrap import EPP_CLUSTER, build_bootstrap, render
from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.envoy.process import EnvoyOptions, EnvoySupervisor, find_envoy
from poolkeeper.extproc.lean import start_lean
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.extproc.tls import TlsSettings, server_credentials, ssl_context
from poolkeeper.netutil import free_port
from poolkeeper.server.transport import Stoppable, health_methods
from poolkeeper.telemetry.health import HealthService
from tests.envoy.envoy_harness import Backend, RoundRobinRouter, rig_params

pytestmark = pytest.mark.integration

TLS_CONTEXT = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


def with_tls_to_the_epp(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The EPP cluster as upstream's gateway presets dial it: TLS, ALPN h2, no validation."""
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == EPP_CLUSTER:
            cluster["transport_socket"] = {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": TLS_CONTEXT,
                    "common_tls_context": {"alpn_protocols": ["h2"]},
                },
            }
            return bootstrap
    raise AssertionError("no EPP cluster in the bootstrap")


async def test_envoy_routes_through_an_epp_serving_tls(tmp_path: Path, transport: str) -> None:
    backends = [Backend("a"), Backend("b")]
    for b in backends:
        await b.start()
    health = HealthService.for_gateway(live=lambda: True, ready=lambda: True)
    servicer = ExtProcServicer(RoundRobinRouter(backends))
    settings = TlsSettings(secure_serving=True)
    server: Stoppable
    if transport == "lean":
        server = lean = await start_lean(
            servicer, "127.0.0.1", free_port(), tls=ssl_context(settings),
            more=health_methods(health),
        )  # fmt: skip
        epp_port = lean.port
    else:
        server, epp_port = build_server(
            servicer,
            f"127.0.0.1:{free_port()}",
            extra=health.register,
            credentials=server_credentials(settings),
        )
        await server.start()
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write([b.hostport for b in backends])
    params = rig_params(backends, epp_port, endpoints.path, fail_open=False)
    config = tmp_path / "envoy.json"
    config.write_text(render(with_tls_to_the_epp(build_bootstrap(params))))
    envoy = EnvoySupervisor(
        EnvoyOptions(
            binary=find_envoy(),
            config_path=config,
            log_path=tmp_path / "envoy.log",
            admin_url=f"http://127.0.0.1:{params.admin_port}",
        )
    )
    await envoy.start()
    try:
        await envoy.wait_ready()
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
        await envoy.stop()
        await server.stop(None)
        for b in backends:
            await b.stop()
