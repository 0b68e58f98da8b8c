"""Real Envoy in front of the ext_proc server (fake router) and echo backends.

Checks what only a real Envoy can show: the bootstrap routes on the EPP's header, the body
rewrite and streaming work in FULL_DUPLEX_STREAMED, the served header comes back, client copies
of the destination header never reach a canary, and FailOpen / FailClose behave when the EPP
is down.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.envoy.params import ADMIN_ALLOW_PATHS
from poolkeeper.envoy.process import EnvoySupervisor
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.netutil import free_port
from poolkeeper.requestcontrol.types import Usage
from tests.envoy.envoy_harness import (
    Backend,
    Canary,
    Epp,
    RoundRobinRouter,
    rig_params,
    running_envoy,
    start_epp,
)

pytestmark = pytest.mark.integration

SERVED = "x-gateway-destination-endpoint-served"
DEST = "x-gateway-destination-endpoint"


@dataclass
class Rig:
    url: str
    backends: list[Backend]
    router: RoundRobinRouter
    canary: Canary
    envoy: EnvoySupervisor
    epp: Epp | None
    endpoints: EndpointsFile
    admin_port: int


@asynccontextmanager
async def rig(
    tmp_path: Path,
    transport: str,
    *,
    epp_up: bool,
    fail_open: bool,
    extra: tuple[str, ...] = (),
) -> AsyncIterator[Rig]:
    backends = [Backend("a"), Backend("b")]
    for b in backends:
        await b.start()
    canary = Canary()
    await canary.start()
    router = RoundRobinRouter(backends)
    server = None
    epp_port = free_port()
    if epp_up:
        server = await start_epp(transport, ExtProcServicer(router), epp_port)
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write([*(b.hostport for b in backends), *extra])
    params = rig_params(
        backends,
        epp_port,
        endpoints.path,
        fail_open=fail_open,
        admin_allow_paths=(*ADMIN_ALLOW_PATHS, "/clusters"),  # the EDS hosts, read below
    )
    try:
        async with running_envoy(params, tmp_path, epp_up=epp_up) as envoy:
            yield Rig(
                f"http://127.0.0.1:{params.listen_port}",
                backends,
                router,
                canary,
                envoy,
                server,
                endpoints,
                params.admin_port,
            )
    finally:
        if server is not None:
            await server.stop(None)
        for b in backends:
            await b.stop()
        await canary.stop()


async def _post(
    url: str, body: dict[str, object], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.read()


async def test_routed_by_epp_with_body_rewrite_and_served_header(
    tmp_path: Path, transport: str
) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=False) as r:
        served = []
        for _ in range(4):
            status, headers, raw = await _post(r.url, {"model": "alias", "messages": []})
            assert status == 200, raw
            reply = json.loads(raw)
            assert reply["model"] == "real"
            served.append((reply["served_by"], headers[SERVED]))
        assert [s for s, _ in served] == ["a", "b", "a", "b"]
        ports = {b.name: b.hostport for b in r.backends}
        assert all(ports[name] == hp for name, hp in served)
        seen = r.backends[0].seen[-1]
        assert json.loads(json.dumps(seen["body"]))["model"] == "real"
        for _ in range(50):
            if len(r.router.completed) == 4:
                break
            await asyncio.sleep(0.02)
        assert [c[0] for c in r.router.completed] == [200] * 4
        assert r.router.completed[0][1] == Usage(3, 4)


async def test_large_body_and_sse_with_injected_usage(tmp_path: Path, transport: str) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=False) as r:
        big = "y" * 900_000  # near the 1 MiB buffer limit, many 62,000-byte chunks
        status, _, raw = await _post(r.url, {"model": "alias", "prompt": big})
        assert status == 200, raw[:500]
        assert json.loads(raw)["received_bytes"] > 900_000
        sent = r.backends[0].seen[-1]["body"]
        assert isinstance(sent, dict)
        assert sent["prompt"] == big
        status, headers, raw = await _post(r.url, {"model": "m", "stream": True})
        assert status == 200
        assert headers["Content-Type"].startswith("text/event-stream")
        assert b'"usage": {' not in raw  # the injected usage chunk was stripped
        assert raw.count(b"data: ") == 3
        assert raw.endswith(b"data: [DONE]\n\n")
        for _ in range(50):
            if len(r.router.completed) == 2:
                break
            await asyncio.sleep(0.02)
        assert r.router.completed[-1][1] == Usage(5, 2)
        status, _, raw = await _post(
            r.url, {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
        )
        assert raw.count(b'"usage": {') == 1  # asked for: kept


async def test_read_paths_reach_a_model_server_and_errors_come_from_epp(
    tmp_path: Path, transport: str
) -> None:
    async with (
        rig(tmp_path, transport, epp_up=True, fail_open=False) as r,
        aiohttp.ClientSession() as session,
    ):
        for path in ("/v1/models", "/version"):  # body-less: routed by the EPP, as upstream
            async with session.get(f"{r.url}{path}") as resp:
                assert resp.status == 200
                assert (await resp.json())["served_by"] in {"a", "b"}
        assert [seen["path"] for b in r.backends for seen in b.seen] == ["/v1/models", "/version"]
        async with session.get(f"{r.url}/metrics") as resp:  # admin paths stay blocked
            assert resp.status == 404
        json_type = {"content-type": "application/json"}
        url = f"{r.url}/v1/completions"
        async with session.post(url, data=b"{oops", headers=json_type) as resp:
            assert resp.status == 400
            assert resp.headers["content-type"] == "application/json"
            assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_epp_503_keeps_its_own_body_and_dead_upstream_gets_one(
    tmp_path: Path, transport: str
) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=False) as r:
        backends = list(r.router.backends)
        r.router.backends = []
        status, _, raw = await _post(r.url, {"model": "m"})
        assert status == 503
        assert json.loads(raw)["error"]["message"] == "no ready endpoint"  # the EPP's message
        dead = Backend("dead", port=free_port())  # never started: connection refused
        r.router.backends = [dead]
        status, headers, raw = await _post(r.url, {"model": "m"})
        assert status == 503
        assert headers["Content-Type"] == "application/json"
        assert json.loads(raw)["error"]["code"] == "upstream_unavailable"
        r.router.backends = backends


async def test_spoofed_destination_never_reaches_canary_epp_up(
    tmp_path: Path, transport: str
) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=True) as r:
        spoof = {DEST: f"127.0.0.1:{r.canary.port}", f"{DEST}-served": "x"}
        for _ in range(3):
            status, _, raw = await _post(r.url, {"model": "m"}, spoof)
            assert status == 200
            assert json.loads(raw)["served_by"] in ("a", "b")
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{r.url}/v1/models", headers=spoof) as resp,  # a bodyless GET
        ):
            assert resp.status == 200
        assert r.canary.connections == 0
        for b in r.backends:
            for seen in b.seen:
                headers = {k.lower(): v for k, v in seen["headers"].items()}
                assert headers[DEST] == b.hostport  # the EPP's value, not the client's


async def test_epp_down_fail_open_serves_and_ignores_spoof(tmp_path: Path, transport: str) -> None:
    async with rig(tmp_path, transport, epp_up=False, fail_open=True) as r:
        spoof = {DEST: f"127.0.0.1:{r.canary.port}"}
        names = set()
        for _ in range(4):
            status, headers, raw = await _post(r.url, {"model": "m"}, spoof)
            assert status == 200, raw
            names.add(json.loads(raw)["served_by"])
            assert headers[SERVED] in {b.hostport for b in r.backends}
        assert names == {"a", "b"}  # round robin over the pool's endpoints
        assert r.canary.connections == 0


async def test_epp_down_fail_close_refuses(tmp_path: Path, transport: str) -> None:
    async with rig(tmp_path, transport, epp_up=False, fail_open=False) as r:
        spoof = {DEST: f"127.0.0.1:{r.canary.port}"}
        status, headers, raw = await _post(r.url, {"model": "m"}, spoof)
        assert status == 503
        assert headers["Content-Type"] == "application/json"
        assert json.loads(raw)["error"]["code"] == "endpoint_picker_unavailable"
        assert r.canary.connections == 0
        assert all(not b.seen for b in r.backends)


async def test_supervisor_restarts_a_dead_envoy(tmp_path: Path, transport: str) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=False) as r:
        first = r.envoy.process
        assert first is not None
        first.kill()
        for _ in range(100):
            if r.envoy.restarts == 1 and r.envoy.process is not first:
                break
            await asyncio.sleep(0.05)
        assert r.envoy.restarts == 1
        await r.envoy.wait_ready()
        status, _, _ = await _post(r.url, {"model": "m"})
        assert status == 200


@pytest.mark.parametrize("fail_open", [True, False])
async def test_epp_killed_while_running(tmp_path: Path, transport: str, fail_open: bool) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=fail_open) as r:
        status, headers, _ = await _post(r.url, {"model": "m"})
        assert status == 200
        assert r.epp is not None
        await r.epp.stop(None)
        spoof = {DEST: f"127.0.0.1:{r.canary.port}"}
        statuses = []
        for _ in range(40):  # Envoy's health check notices within about one interval (1 s)
            status, headers, raw = await _post(r.url, {"model": "m"}, spoof)
            statuses.append(status)
            if status == 200 or (not fail_open and len(statuses) >= 5):
                break
            await asyncio.sleep(0.1)
        if fail_open:
            assert statuses[-1] == 200
            assert headers[SERVED] in {b.hostport for b in r.backends}
        else:
            assert all(s == 503 for s in statuses)
            assert json.loads(raw or b"{}").get("error", {}).get("type") in (
                None,
                "service_unavailable_error",
            )
        assert r.canary.connections == 0


async def test_backend_dying_mid_stream_is_an_error_not_a_clean_end(
    tmp_path: Path, transport: str
) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=False) as r:
        async with aiohttp.ClientSession() as session:
            url = f"{r.url}/v1/chat/completions"
            async with session.post(url, json={"model": "cut", "stream": True}) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
        for _ in range(100):
            if r.router.completed:
                break
            await asyncio.sleep(0.02)
        assert [c[0] for c in r.router.completed] == [499]  # released, counted as cut short


@pytest.mark.parametrize("client_asked_usage", [False, True])
async def test_sse_events_arrive_as_they_are_produced(
    tmp_path: Path, transport: str, client_asked_usage: bool
) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=False) as r:
        body: dict[str, object] = {"model": "gated", "stream": True}
        if client_asked_usage:
            body["stream_options"] = {"include_usage": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{r.url}/v1/chat/completions", json=body) as resp,
        ):
            # The backend writes its second event only after the client has the first: a
            # gateway that held the first event back (until the stream ends) never delivers it,
            # and the generous limit ends the test as a failure.
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 20)
            assert not any(b.gate.is_set() for b in r.backends)
            for backend in r.backends:
                backend.gate.set()
            rest = await asyncio.wait_for(resp.read(), 20)
        assert b"hello" in first
        assert b"world" not in first
        assert b"world" in rest
        assert rest.endswith(b"data: [DONE]\n\n")


async def test_edge_limits_on_headers(tmp_path: Path, transport: str) -> None:
    async with rig(tmp_path, transport, epp_up=True, fail_open=False) as r:
        for bad in ({"x-big": "a" * 70_000}, {"x_under_score": "1"}):
            # Over max_request_headers_kb (60) / an underscore (REJECT_REQUEST): Envoy's HTTP/1
            # codec refuses the request (a 4xx, or for these codec errors a closed connection).
            try:
                status, _, _ = await _post(r.url, {"model": "m"}, bad)
            except aiohttp.ServerDisconnectedError:
                status = 0
            assert status == 0 or 400 <= status < 500
        assert all(not b.seen for b in r.backends)
        assert r.router.completed == []


# --- protocol v0.4+ fallbacks (004-endpoint-picker-protocol): Envoy retries on the list -------


async def test_fallback_endpoints_are_tried_in_order(tmp_path: Path, transport: str) -> None:
    dead = f"127.0.0.1:{free_port()}"  # in the cluster, nothing listening
    async with rig(tmp_path, transport, epp_up=True, fail_open=False, extra=(dead,)) as r:
        a, b = r.backends
        r.router.fixed = (dead, b.hostport, a.hostport)
        status, headers, raw = await _post(r.url, {"model": "m", "messages": []})
        assert status == 200, raw
        assert json.loads(raw)["served_by"] == "b"  # the first fallback, not the second
        assert headers[SERVED] == b.hostport
        assert a.seen == []
        for _ in range(50):
            if r.router.completed:
                break
            await asyncio.sleep(0.02)
        assert r.router.moved[-1][1] == b.hostport  # the EPP moved its accounting to b
        assert r.router.completed[-1][2] == b.hostport


async def test_exhausted_fallbacks_never_reach_an_unlisted_endpoint(
    tmp_path: Path, transport: str
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with rig(tmp_path, transport, epp_up=True, fail_open=False, extra=(dead,)) as r:
        r.router.fixed = (dead,)
        status, _, raw = await _post(r.url, {"model": "m", "messages": []})
        assert status == 503
        assert json.loads(raw)["error"]["code"] == "upstream_unavailable"
        assert all(backend.seen == [] for backend in r.backends)


async def _cluster_hosts(admin_port: int) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{admin_port}/clusters") as resp,
    ):
        return await resp.text()


async def test_endpoints_file_changes_reach_envoy(tmp_path: Path, transport: str) -> None:
    late = Backend("late")
    await late.start()
    try:
        async with rig(tmp_path, transport, epp_up=True, fail_open=False) as r:
            r.router.fixed = (late.hostport,)
            status, _, _ = await _post(r.url, {"model": "m", "messages": []})
            assert status == 503  # not in the cluster yet: never routed to
            r.endpoints.write([*(b.hostport for b in r.backends), late.hostport])
            for _ in range(100):  # bounded: Envoy reloads the watched file
                if f"epp_routed_cluster::{late.hostport}::" in await _cluster_hosts(r.admin_port):
                    break
                await asyncio.sleep(0.05)
            status, headers, raw = await _post(r.url, {"model": "m", "messages": []})
            assert status == 200, raw
            assert json.loads(raw)["served_by"] == "late"
            assert headers[SERVED] == late.hostport
    finally:
        await late.stop()
