"""Body-based routing with the real Envoy and the official openai client (upstream
`test/integration/bbr/hermetic_test.go` and `config/manifests/bbr-example/httproute_bbr.yaml`):
BBR copies the body's model into `x-gateway-model-name`, Envoy routes on it to the pool's own
EPP and model servers, a client's copy of the header steers nothing."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from envoy.service.auth.v3 import (
    external_auth_pb2 as auth_pb2,
    external_auth_pb2_grpc as auth_pb2_grpc,
)
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.rpc import code_pb2  # type: ignore[import-untyped]

from poolkeeper.cli import bbr as bbr_cli, main as cli
from poolkeeper.envoy.bbr import (
    MODEL_HEADER,
    BbrParams,
    PoolRoute,
    build_bbr_bootstrap,
    epp_cluster,
    render,
)
from poolkeeper.envoy.bootstrap import BootstrapParams, build_bootstrap
from poolkeeper.envoy.params import (
    CLIENT_MAX_HEADER_KB,
    CLIENT_MAX_HEADERS,
    DESTINATION_HEADER,
    EXT_PROC_FILTER,
    EXT_PROC_SERVICE,
    duration,
)
from poolkeeper.envoy.process import find_envoy
from poolkeeper.extproc.bbr import BbrServicer
from poolkeeper.extproc.conncap import ConnectionCounter
from poolkeeper.extproc.conncap_service import ConnectionCapService, add_conncap_service
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.netutil import free_port
from poolkeeper.telemetry.health import SERVING, check_health
from tests.envoy.envoy_harness import Backend, RoundRobinRouter, supervised_envoy
from tests.reliability.rel_harness import raw_http, status_of
from tests.support.keepalive import Conn, chat_from

pytestmark = pytest.mark.integration
POOL = "default/vllm-llama3-8b-instruct"


@dataclass
class Rig:
    url: str
    admin_port: int
    backends: dict[str, Backend]
    routers: dict[str, RoundRobinRouter]
    bbr: BbrServicer
    counter: ConnectionCounter | None = None

    @property
    def port(self) -> int:
        return int(self.url.rpartition(":")[2])


class _Silent(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """A processor that accepts every stream, reads it, and never answers (alive, but stuck):
    stands in for a hung BBR service or EPP."""

    async def Process(self, request_iterator: Any, context: Any = None) -> Any:
        async for _ in request_iterator:
            pass
        await asyncio.Event().wait()
        yield  # pragma: no cover  (makes this an async generator like the real one)


@asynccontextmanager
async def rig(
    tmp_path: Path, *, hung: str = "", cap: int = 0, **base_params: Any
) -> AsyncIterator[Rig]:
    """Two pools, each with its own EPP (fake router) and one model server; BBR in front
    (`base_params`: BootstrapParams fields). `hung`: "bbr", or a pool's name ("llama"), whose
    processor then never answers. `cap`: connections per client address, counted by the BBR
    server as `poolkeeper bbr` counts them (0: no cap)."""
    backends = {"llama": Backend("llama-server"), "phi": Backend("phi-server")}
    servers: list[grpc.aio.Server] = []
    routers: dict[str, RoundRobinRouter] = {}
    pools: list[PoolRoute] = []
    try:
        for name, backend in backends.items():
            await backend.start()
            routers[name] = RoundRobinRouter([backend])
            epp = _Silent() if hung == name else ExtProcServicer(routers[name])
            server, port = build_server(epp, "127.0.0.1:0")
            await server.start()
            servers.append(server)
            pools.append(
                PoolRoute(f"default/{name}-pool", (name,), f"127.0.0.1:{port}", (backend.hostport,))
            )
        bbr = BbrServicer(client_header_limits=(CLIENT_MAX_HEADERS, CLIENT_MAX_HEADER_KB))
        counter = ConnectionCounter(cap) if cap else None

        def extra(server: grpc.aio.Server) -> None:
            if counter is not None:  # as `poolkeeper bbr` serves it
                add_conncap_service(server, counter, 1.0)

        bbr_server, bbr_port = build_server(
            _Silent() if hung == "bbr" else bbr, "127.0.0.1:0", extra=extra
        )
        await bbr_server.start()
        servers.append(bbr_server)
        base = BootstrapParams(listen_port=free_port(), admin_port=free_port(), **base_params)
        config = tmp_path / "envoy-bbr.json"
        params = BbrParams(base, f"127.0.0.1:{bbr_port}", tuple(pools), client_cap=bool(cap))
        config.write_text(render(build_bbr_bootstrap(params)))
        async with supervised_envoy(config, base.admin_port):
            yield Rig(
                f"http://127.0.0.1:{base.listen_port}",
                base.admin_port,
                backends,
                routers,
                bbr,
                counter,
            )
    finally:
        for server in servers:
            await server.stop(None)
        for backend in backends.values():
            await backend.stop()


def _client(url: str, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30, **kw
    )


async def test_models_go_to_their_own_pool(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        client = _client(r.url)
        try:
            for model in ("llama", "phi", "llama"):
                raw = await client.chat.completions.with_raw_response.create(
                    model=model, messages=[{"role": "user", "content": "hi"}]
                )
                assert json.loads(raw.http_response.content)["served_by"] == f"{model}-server"
        finally:
            await client.close()
        assert [s["body"]["model"] for s in r.backends["llama"].seen] == ["llama", "llama"]
        assert [s["body"]["model"] for s in r.backends["phi"].seen] == ["phi"]
        # Each pool's EPP saw only its own model's requests.
        assert (r.routers["llama"].turn, r.routers["phi"].turn) == (2, 1)
        seen = r.backends["phi"].seen[0]["headers"]
        assert seen.get("x-gateway-model-name") == "phi"  # the header routes travel upstream


async def test_streaming_through_bbr(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        client = _client(r.url)
        try:
            stream = await client.chat.completions.create(
                model="phi", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            words = [c.choices[0].delta.content async for c in stream if c.choices]
        finally:
            await client.close()
        assert words == ["hello", "world"]
        assert len(r.backends["phi"].seen) == 1


async def test_client_model_header_steers_nothing(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        client = _client(r.url, default_headers={"X-Gateway-Model-Name": "phi"})
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "hi"}]
            )
            assert json.loads(raw.http_response.content)["served_by"] == "llama-server"
            with pytest.raises(openai.NotFoundError) as info:  # no pool serves it
                await client.chat.completions.create(
                    model="mistral", messages=[{"role": "user", "content": "hi"}]
                )
            assert info.value.body is not None
        finally:
            await client.close()
        assert r.backends["phi"].seen == []
        assert (r.routers["llama"].turn, r.routers["phi"].turn) == (1, 0)


async def test_body_without_model_is_not_routed_by_a_client_header(tmp_path: Path) -> None:
    async with rig(tmp_path) as r, aiohttp.ClientSession() as session:
        # No model in the body: BBR removes the client's header, the first pool's EPP answers.
        async with session.post(
            f"{r.url}/v1/chat/completions",
            data=b'{"messages": []}',
            headers={"content-type": "application/json", "x-gateway-model-name": "phi"},
        ) as resp:
            await resp.read()
        assert r.backends["phi"].seen == []
        assert r.routers["llama"].turn == 1


CHAT = b'{"model":"llama","messages":[]}'


def _error(answer: bytes) -> dict[str, Any]:
    body = answer.partition(b"\r\n\r\n")[2]
    error = json.loads(body[body.find(b"{") : body.rfind(b"}") + 1])["error"]
    assert isinstance(error, dict)
    return error


def _nothing_reached_a_pool(r: Rig) -> None:
    assert r.bbr.streams == 0  # Envoy answered from the headers: BBR was not consulted either
    assert not any(b.seen for b in r.backends.values())
    assert all(router.turn == 0 for router in r.routers.values())


async def test_only_inference_paths_and_methods_reach_a_pool(tmp_path: Path) -> None:
    """The same answers as serve's listener (tests/reliability/test_rel_edge.py and
    test_rel_protocol.py): a model server's admin paths were proxied to the first pool (its
    routes matched any path), and so was any method."""
    async with rig(tmp_path) as r, aiohttp.ClientSession() as session:
        for method, path in (
            ("POST", "/v1/unload_lora_adapter"),
            ("POST", "/v1/load_lora_adapter"),
            ("GET", "/metrics"),
            ("GET", "/health"),
            ("POST", "/v1/chat/completions/../../v1/unload_lora_adapter"),
            ("POST", "/v1/chat/completionsX"),
            ("GET", "/"),
        ):
            async with session.request(method, r.url + path, data=CHAT) as resp:
                body = await resp.json(content_type=None)
                assert resp.status == 404, (path, resp.status, body)
                assert body["error"]["code"] == "not_found"
        for method, path in (
            ("GET", "/v1/chat/completions"),
            ("PUT", "/v1/chat/completions"),
            ("DELETE", "/v1/completions"),
            ("POST", "/v1/models"),
        ):
            async with session.request(method, r.url + path, data=CHAT) as resp:
                body = await resp.json(content_type=None)
                assert resp.status == 405, (method, path, resp.status, body)
                assert body["error"]["code"] == "method_not_allowed"
        _nothing_reached_a_pool(r)
        async with session.get(r.url + "/v1/models") as resp:  # bodyless: the first pool
            assert resp.status == 200
        async with session.post(r.url + "/v1/embeddings?x=1", data=CHAT) as resp:
            assert (await resp.json())["served_by"] == "llama-server"


async def test_guard_routes_answer_before_bbr_or_an_epp(tmp_path: Path) -> None:
    """413 for a declared length over the limit before any body is read (the request was
    forwarded and waited for its body), 415 for a compressed body, CONNECT refused, a header
    with an underscore refused, HTTP/1.0 served: as serve's listener answers them."""
    async with rig(tmp_path, max_body_bytes=1000) as r:
        oversize = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: 1001\r\nexpect: 100-continue\r\n\r\n"
        )
        answer = await raw_http(r.port, oversize, read_timeout_s=5.0)
        assert status_of(answer) == 413, answer[:300]  # the body was never sent
        assert _error(answer)["code"] == "request_too_large"
        for encoding in ("gzip", "br", "identity, gzip"):
            compressed = (
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                f"\r\ncontent-encoding: {encoding}\r\ncontent-length: {len(CHAT)}\r\n\r\n"
            ).encode() + CHAT
            answer = await raw_http(r.port, compressed, read_timeout_s=5.0)
            assert status_of(answer) == 415, (encoding, answer[:300])
            assert _error(answer)["code"] == "unsupported_media_type"
        connect = b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nhost: 127.0.0.1:22\r\n\r\n"
        answer = await raw_http(r.port, connect, read_timeout_s=5.0)
        assert status_of(answer) == 403, answer[:300]
        assert _error(answer)["code"] == "upgrade_not_supported"
        underscore = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            f"\r\nx_gateway_model_name: phi\r\ncontent-length: {len(CHAT)}\r\n\r\n"
        ).encode() + CHAT
        assert status_of(await raw_http(r.port, underscore, read_timeout_s=5.0)) in (0, 400)
        _nothing_reached_a_pool(r)
        http10 = (
            "POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
            f"content-length: {len(CHAT)}\r\n\r\n"
        ).encode() + CHAT
        answer = await raw_http(r.port, http10, read_timeout_s=5.0)
        assert status_of(answer) == 200, answer[:300]
        assert b'"served_by": "llama-server"' in answer


async def test_header_limits_answer_431_and_leave_room_for_the_routing_headers(
    tmp_path: Path,
) -> None:
    """Serve's finding 5 behind BBR: with the codec at the client's exact limits, the headers
    BBR and the EPP add pushed a request with 94-100 client headers, or 60 KB of them, over it
    (an empty 500). Within the limits: served; over them: 431 from BBR, before any EPP."""
    async with rig(tmp_path) as r, aiohttp.ClientSession() as session:
        for count in (94, 97, 100):
            # aiohttp adds host, accept, accept-encoding, user-agent, content-length, content-type
            headers = {f"x-h{i}": "v" for i in range(count - 6)}
            headers["content-type"] = "application/json"
            async with session.post(
                r.url + "/v1/chat/completions", data=CHAT, headers=headers
            ) as resp:
                assert resp.status == 200, (count, await resp.text())
        big = "x" * (60 * 1024 - 600)
        async with session.post(
            r.url + "/v1/chat/completions", data=CHAT, headers={"x-big": big}
        ) as resp:  # routed: it reached the model server (whose parser refuses 8 KB lines)
            assert resp.headers.get("x-gateway-destination-endpoint-served"), await resp.text()
        turns = [router.turn for router in r.routers.values()]
        for total in (102, 110, 120):  # host is `:authority` (counted in bytes only)
            request = (
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                f"\r\ncontent-length: {len(CHAT)}\r\n"
                + "".join(f"x-h{i}: v\r\n" for i in range(total - 3))
                + "\r\n"
            ).encode() + CHAT
            answer = await raw_http(r.port, request, read_timeout_s=5.0)
            assert status_of(answer) == 431, (total, answer[:300])
            assert _error(answer)["code"] == "request_header_fields_too_large"
        assert [router.turn for router in r.routers.values()] == turns


async def test_a_silent_connection_is_closed(tmp_path: Path) -> None:
    """The connection idle timeout (armed at accept) closes a connection that sends nothing:
    it was an hour (Envoy's default)."""
    async with rig(tmp_path, connection_idle_timeout_s=1.0) as r:
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        try:
            assert await asyncio.wait_for(reader.read(1024), 10.0) == b""
        except ConnectionError:
            pass
        finally:
            writer.close()


async def test_the_admin_answers_only_serves_paths(tmp_path: Path) -> None:
    """The BBR Envoy's admin (loopback, which any process on the host reaches) answered every
    path: /quitquitquit stopped the gateway, /config_dump gave its whole configuration. Now
    serve's rule: what an operator reads (/ready, /stats*, /memory) and the drain; 403 for
    the rest, Envoy's own answer for a path it does not allow."""
    async with rig(tmp_path) as r, aiohttp.ClientSession() as session:
        admin = f"http://127.0.0.1:{r.admin_port}"
        for method, path in (("GET", "/config_dump"), ("POST", "/quitquitquit"),
                             ("POST", "/runtime_modify?a=b"), ("POST", "/healthcheck/fail"),
                             ("GET", "/clusters"), ("GET", "/no-such-path")):  # fmt: skip
            async with session.request(method, admin + path) as resp:
                assert resp.status == 403, (method, path, resp.status, await resp.text())
                assert (await resp.text()).endswith("not allowed")
        async with session.get(admin + "/drain_listeners") as resp:
            assert resp.status == 405  # allowed, but only as a POST
        for path in ("/ready", "/stats?filter=^server.live$", "/stats/prometheus", "/memory"):
            async with session.get(admin + path) as resp:
                assert resp.status == 200, (path, resp.status)
        async with session.post(
            r.url + "/v1/chat/completions",
            json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
        ) as resp:
            assert resp.status == 200  # still serving


async def test_a_client_is_held_to_its_connection_cap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The BBR listener had no per-client cap (serve's counter runs only in serve): one
    address could hold every connection Envoy accepts. Now `poolkeeper bbr` counts them for
    its Envoy (the same counter and Envoy filters as serve's): over the cap a connection is
    closed on its first bytes, logged and counted; the address's open connections and other
    addresses are served; a close frees a place."""
    cap, extra = 3, 12
    held: list[Conn] = []
    async with rig(tmp_path, cap=cap) as r:
        counter = r.counter
        assert counter is not None
        try:
            for _ in range(cap):
                status, conn = await chat_from(r.port, "127.0.0.2", CHAT)
                assert status == b"HTTP/1.1 200 OK", status
                held.append(conn)
            for _ in range(extra):
                status, refused = await chat_from(r.port, "127.0.0.2", CHAT)
                refused[1].close()
                assert status == b"", status  # closed on its first bytes, nothing answered
            assert counter.exported()[2] == extra
            assert "refused 1 connection(s) over 3 per client address (latest from 127.0.0.2)" in (
                caplog.text
            )
            status, other = await chat_from(r.port, "127.0.0.1", CHAT)  # another address
            assert status == b"HTTP/1.1 200 OK", status
            other[1].close()
            for conn in held:  # the open ones are unaffected
                status, _ = await chat_from(r.port, "127.0.0.2", CHAT, conn)
                assert status == b"HTTP/1.1 200 OK", status
            held.pop(0)[1].close()
            for _ in range(250):  # until Envoy's access log reported the close
                if counter.exported()[0] == cap - 1:
                    break
                await asyncio.sleep(0.02)
            status, conn = await chat_from(r.port, "127.0.0.2", CHAT)
            assert status == b"HTTP/1.1 200 OK", status
            held.append(conn)
        finally:
            for _reader, writer in held:
                writer.close()


@pytest.mark.parametrize("hung", ["bbr", "llama"])
async def test_a_hung_processor_is_bounded_by_the_message_timeout(
    tmp_path: Path, hung: str
) -> None:
    """BBR or a pool's EPP that accepts the stream and never answers costs a request at most
    the message timeout (as behind serve's listener), not the 300 s idle timeout of routed
    requests: Envoy answers 504 in OpenAI's shape, and nothing reached a model server."""
    async with (
        rig(tmp_path, hung=hung, message_timeout_s=1.0) as r,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(
            r.url + "/v1/chat/completions",
            json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
        ) as resp,
    ):
        body = json.loads(await resp.read())
        assert resp.status == 504, body
        assert body["error"]["type"] == "timeout_error"
    assert not any(b.seen for b in r.backends.values())


def _bbr_bootstrap(**base_params: Any) -> dict[str, Any]:
    pools = (
        PoolRoute("default/a", ("a",), "127.0.0.1:9002", ("10.0.0.1:8000",)),
        PoolRoute("default/b", ("b", "b2"), "127.0.0.1:9003", ("10.0.0.2:8000",)),
    )
    base = BootstrapParams(**base_params)
    return build_bbr_bootstrap(BbrParams(base, "127.0.0.1:9004", pools))


def _listener(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    assert isinstance(listener, dict)
    return listener


def _hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    filters = _listener(bootstrap)["filter_chains"][0]["filters"]
    (hcm,) = [f for f in filters if f["name"] == "envoy.filters.network.http_connection_manager"]
    config = hcm["typed_config"]
    assert isinstance(config, dict)
    return config


def test_bbr_listener_has_serves_edge_settings() -> None:
    """Every client-facing setting of serve's connection manager and listener, and its overload
    manager (the stream idle timeout included: the message timeout's)."""
    serve, bbr = build_bootstrap(BootstrapParams()), _bbr_bootstrap()
    own = {"stat_prefix", "route_config", "http_filters", "access_log"}
    expected = shared = {k: v for k, v in _hcm(serve).items() if k not in own}
    hcm = _hcm(bbr)
    assert {k: hcm.get(k) for k in expected if k != "early_header_mutation_extensions"} == {
        k: v for k, v in expected.items() if k != "early_header_mutation_extensions"
    }
    removed = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove": MODEL_HEADER} in removed
    assert all(m in removed for m in shared["early_header_mutation_extensions"][0]
               ["typed_config"]["mutations"])  # fmt: skip
    edge = {k: v for k, v in _listener(serve).items() if k not in ("name", "filter_chains")}
    assert {k: _listener(bbr).get(k) for k in edge} == edge
    assert bbr["overload_manager"] == serve["overload_manager"]
    assert bbr["admin"] == serve["admin"]  # serve's allowed paths only


def test_bbr_routes_reach_pools_on_inference_paths_only() -> None:
    p = BootstrapParams()
    routes = _hcm(_bbr_bootstrap())["route_config"]["virtual_hosts"][0]["routes"]
    serve_routes = _hcm(build_bootstrap(p))["route_config"]["virtual_hosts"][0]["routes"]
    guards = ("connect", "too_large", "unsupported_encoding")
    assert [r["name"] for r in routes[:3]] == list(guards)
    for route, serves in zip(routes[:3], serve_routes[:3], strict=True):
        assert route["match"] == serves["match"]
        assert route["direct_response"] == serves["direct_response"]
    proxied = [r for r in routes if "route" in r]
    assert proxied
    for route in proxied:
        assert "prefix" not in route["match"], route["name"]
        pattern = re.compile(route["match"]["safe_regex"]["regex"])
        assert any(pattern.match(path) for path in p.inference_paths), route["name"]
        for path in ("/metrics", "/v1/load_lora_adapter", "/", "/v1/chat/completionsX"):
            assert not pattern.match(path), (route["name"], path)
        # The body kept for a retry on a fallback: larger than the connection's buffer.
        assert route["per_request_buffer_limit_bytes"] == p.buffer_limit_bytes
        # Routed (the EPP named a destination): long generations idle up to the stream idle
        # timeout; still deciding (BBR or the EPP): at most the message timeout.
        (state,) = [h for h in route["match"]["headers"] if h["name"] == DESTINATION_HEADER]
        deciding = state.get("invert_match", False)
        assert route["name"].endswith("_deciding") == deciding, route["name"]
        idle = p.message_timeout_s if deciding else p.stream_idle_timeout_s
        assert route["route"]["idle_timeout"] == duration(idle), route["name"]
    for route in routes:  # Envoy answers these itself: neither BBR nor an EPP is asked
        if "direct_response" in route and route["name"] != "no_pool":
            per_filter = route["typed_per_filter_config"]
            assert per_filter["bbr"]["disabled"], route["name"]
            assert per_filter["epp"]["disabled"], route["name"]
            assert EXT_PROC_FILTER not in per_filter


def test_bbr_envoy_config_from_the_examples(tmp_path: Path) -> None:
    """`poolkeeper bbr-envoy-config`: one route per served model name (InferenceModel and
    InferenceModelRewrite alike), the pool's EPP overridable, and the real Envoy accepts it."""
    out = tmp_path / "bbr.json"
    examples = str(Path(__file__).parents[2] / "examples")
    plain = tmp_path / "plain.json"
    assert cli.main(["bbr-envoy-config", "-f", examples, "-o", str(plain)]) == 0
    # No cap unless asked: the first filter is the HTTP connection manager, no access log.
    (chain,) = _listener(json.loads(plain.read_text()))["filter_chains"]
    assert [f["name"] for f in chain["filters"]] == [
        "envoy.filters.network.http_connection_manager"
    ]
    assert not _listener(json.loads(plain.read_text())).get("access_log")
    args = ["bbr-envoy-config", "-f", examples, "--epp", POOL + "=10.1.2.3:9002"]
    assert cli.main([*args, "--count-connections", "-o", str(out)]) == 0
    bootstrap = json.loads(out.read_text())
    config = _hcm(bootstrap)
    # The per-client cap (--count-connections): the listener asks `poolkeeper bbr`'s counter,
    # on the BBR cluster, first; and reports each close to it.
    listener = _listener(bootstrap)
    cap = listener["filter_chains"][0]["filters"][0]
    assert cap["name"] == "envoy.filters.network.ext_authz"
    assert cap["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "bbr"
    assert cap["typed_config"]["failure_mode_allow"] is True
    (closes,) = listener["access_log"]
    assert closes["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"] == {
        "cluster_name": "bbr"
    }
    assert [f["name"] for f in config["http_filters"]] == [
        "bbr",
        "epp",
        "envoy.filters.http.router",
    ]
    routes = config["route_config"]["virtual_hosts"][0]["routes"]
    matched = [  # each model's route once routed, once while its pool's EPP decides
        r["match"]["headers"][0]["string_match"]["exact"]
        for r in routes
        if "string_match" in r["match"].get("headers", [{}])[0]
        and not r["name"].endswith("_deciding")
    ]
    assert matched == [
        "food-review",
        "meta-llama/Llama-3.1-8B-Instruct",
        "tweet-summary",
        "tweet-summary-latest",  # an InferenceModelRewrite exact match
    ]
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    epp = clusters[epp_cluster(POOL)]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert epp["endpoint"]["address"]["socket_address"] == {
        "address": "10.1.2.3",
        "port_value": 9002,
    }
    assert routes[-1]["direct_response"]["status"] == 404
    check = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


def test_bbr_envoy_config_errors_are_precise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    examples = str(Path(__file__).parents[2] / "examples")
    assert cli.main(["bbr-envoy-config", "-f", examples, "--epp", "default/nope=1.2.3.4:1"]) == 2
    assert "--epp names pools that are not loaded: default/nope" in capsys.readouterr().err
    assert cli.main(["bbr-envoy-config", "-f", examples, "--bbr", "no-port"]) == 2
    assert "--bbr: expected HOST:PORT, got 'no-port'" in capsys.readouterr().err


def _check(ip: str, port: int) -> auth_pb2.CheckRequest:
    request = auth_pb2.CheckRequest()
    source = request.attributes.source.address.socket_address
    source.address, source.port_value = ip, port
    return request


async def test_poolkeeper_bbr_command_serves_health_and_ext_proc() -> None:
    """`poolkeeper bbr`: ext_proc, gRPC health, and the connection counter its Envoy asks
    (`--max-connections-per-client`), whose refusals `--metrics-port` exports."""
    port, metrics_port = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "poolkeeper",
        "bbr",
        "--port",
        str(port),
        "--max-connections-per-client",
        "2",
        "--metrics-port",
        str(metrics_port),
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
        assert f"poolkeeper bbr ready on 127.0.0.1:{port}" in line.decode()
        assert await check_health(f"127.0.0.1:{port}", EXT_PROC_SERVICE) == SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = auth_pb2_grpc.AuthorizationStub(channel).Check
            codes = [(await check(_check("10.0.0.7", p))).status.code for p in (1, 2, 3, 4)]
            other = (await check(_check("10.0.0.8", 1))).status.code
        assert codes == [code_pb2.OK, code_pb2.OK, code_pb2.PERMISSION_DENIED,
                         code_pb2.PERMISSION_DENIED]  # fmt: skip
        assert other == code_pb2.OK
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp,
        ):
            page = await resp.text()
        assert "poolkeeper_client_connections_refused_total 2.0" in page
        assert "poolkeeper_client_connections 3.0" in page
        warning = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
        assert b"refused 1 connection(s) over 2 per client address" in warning
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)


def test_the_counter_runs_on_loopback_only(capsys: pytest.CaptureFixture[str]) -> None:
    """`poolkeeper bbr`'s counter takes no token and reads this host's connections: the cap
    is refused past loopback, as are a negative cap and a metrics page with nothing on it."""
    assert all(map(bbr_cli._loopback, ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost")))
    assert not any(map(bbr_cli._loopback, ("0.0.0.0", "::", "10.0.0.1", "bbr.example")))
    cases = {
        (
            "--address",
            "0.0.0.0",
            "--max-connections-per-client",
            "8",
        ): "needs --address on loopback",
        ("--max-connections-per-client", "-1"): "must be >= 0, got -1",
        ("--metrics-port", "9090"): "--metrics-port serves the connection cap's counts",
        ("--envoy-port", "70000"): "--envoy-port must be a port (0-65535), got 70000",
    }
    for argv, message in cases.items():
        assert cli.main(["bbr", *argv]) == 2
        assert message in capsys.readouterr().err


async def test_a_learnt_listener_settles_lost_closes(caplog: pytest.LogCaptureFixture) -> None:
    """`poolkeeper bbr` learns its Envoy's listener port from the first check and settles the
    count from the kernel's list of that port's connections: a close the access log lost does
    not hold the address's place for ever."""
    listed: list[int] = []
    twice = asyncio.Event()

    def peers(port: int) -> set[tuple[str, int]]:
        listed.append(port)
        if len(listed) >= 2:
            twice.set()
        return set()  # the kernel: nothing of 10.0.0.7 is open

    service = ConnectionCapService(
        ConnectionCounter(1), 1.0, lookup=lambda here, there: None, peers=peers,
        learn_listen_port=True,
    )  # fmt: skip
    first = _check("10.0.0.7", 1)
    first.attributes.destination.address.socket_address.address = "127.0.0.1"
    first.attributes.destination.address.socket_address.port_value = 18081
    with caplog.at_level("INFO", logger="poolkeeper.extproc.conncap_service"):
        assert (await service.Check(first)).status.code == code_pb2.OK
    assert service.listen_port == 18081
    assert "settling counts from port 18081's connections" in caplog.text  # said, not silent
    assert (await service.Check(_check("10.0.0.7", 2))).status.code == code_pb2.PERMISSION_DENIED
    await asyncio.wait_for(twice.wait(), 30)  # a phantom goes when missing from two lists
    assert set(listed) == {18081}
    assert (await service.Check(_check("10.0.0.7", 3))).status.code == code_pb2.OK
