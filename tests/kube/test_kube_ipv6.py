"""IPv6 pod IPs: every `ip:port` formed is bracketed (`[fd00::5]:20100`), at the header, in
Envoy's endpoints, and through a real Envoy to a model server listening on ::1."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.controller.files import file_source
from poolkeeper.datastore.endpoint import Endpoint
from poolkeeper.envoy.endpoints_file import load_assignment
from poolkeeper.envoy.params import lb_endpoints
from poolkeeper.hostport import host_of, join_hostport, split_hostport
from poolkeeper.server.options import ServeOptions
from tests.kube.conftest import Factory, pod_obj, pool_obj
from tests.kube.fakeapi import FakeApiServer
from tests.kube.test_kube_faults import hostports, running
from tests.support.gateway_files import one_pool
from tests.support.sim_gateway import running_gateway, sim_server


def test_hostport_brackets_ipv6_and_reads_it_back() -> None:
    assert join_hostport("fd00::5", 20100) == "[fd00::5]:20100"
    assert join_hostport("10.0.0.5", 20100) == "10.0.0.5:20100"
    assert join_hostport("[fd00::5]", 1) == "[fd00::5]:1"
    assert split_hostport("[fd00::5]:20100") == ("fd00::5", 20100)
    assert split_hostport("10.0.0.5:80") == ("10.0.0.5", 80)
    for bad in ("fd00::5:20100", "[fd00::5]", "[fd00::5]x", "10.0.0.5", "10.0.0.5:0", ":80"):
        with pytest.raises(ValueError, match="endpoint"):
            split_hostport(bad)
    assert [host_of(v) for v in ("[fd00::5]:1", "10.0.0.5:1", "fd00::5", "10.0.0.5")] == [
        "fd00::5", "10.0.0.5", "fd00::5", "10.0.0.5",
    ]  # fmt: skip


def test_destination_header_and_envoy_endpoints_for_an_ipv6_pod() -> None:
    endpoint = Endpoint("p", "fd00::5", 20100)
    assert endpoint.hostport == "[fd00::5]:20100"  # x-gateway-destination-endpoint's value
    (lb,) = lb_endpoints([endpoint.hostport])
    assert lb["endpoint"]["address"]["socket_address"] == {
        "address": "fd00::5",
        "port_value": 20100,
    }
    assignment = load_assignment([endpoint.hostport, "10.0.0.1:8000"])
    addresses = str(assignment)
    assert "'fd00::5'" in addresses
    assert "[fd00::5]" not in addresses


async def test_ipv6_pod_ips_from_the_api_server(fake: FakeApiServer, make_source: Factory) -> None:
    fake.put(pool_obj(port=20100), "inferencepools")
    fake.put(pod_obj("p0", "fd00::5"), "pods")
    source, store = await make_source(write_status=False)
    async with running(source, fake):
        fake.put(pod_obj("p1", "fd00::6"), "pods")
        await asyncio.sleep(0)
        for _ in range(400):
            if len(hostports(store)) == 2:
                break
            await asyncio.sleep(0.005)
        assert hostports(store) == ["[fd00::5]:20100", "[fd00::6]:20100"]


@pytest.mark.integration
async def test_ipv6_endpoint_routes_through_envoy(tmp_path: Path) -> None:
    if not _ipv6_loopback():  # pragma: no cover - a host without IPv6 loopback
        pytest.skip("cannot listen on ::1")
    async with (
        sim_server(host="::1") as sim_port,
        running_gateway(
            ServeOptions(
                source=file_source([one_pool(tmp_path / "config", sim_port, host="::1")]),
                workdir=tmp_path / "work",
                ready_wait_s=10,
            )
        ) as runtime,
    ):
        body = {"model": "m", "prompt": "hello", "max_tokens": 4}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{runtime.http_url}/v1/completions", json=body) as resp,
        ):
            text = await resp.text()
            assert resp.status == 200, text
            served = resp.headers.get("x-gateway-destination-endpoint-served")
        assert served in (None, f"[::1]:{sim_port}")
        assert runtime.datastore.snapshot().all_endpoints()[0].hostport == f"[::1]:{sim_port}"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True
