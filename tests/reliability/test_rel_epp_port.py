"""Round 2, finding 2: the EPP's ports are for the Envoy `serve` runs, and nobody else.

Before: with `listeners.address: 0.0.0.0` the ext_proc, health and metrics ports bound every
address; any client of the gRPC port could route requests it never sent (phantom in-flight
requests, every endpoint named in the replies) and settle live streams with forged access-log
entries (keys: a per-process prefix plus a counter). Real parts: `GatewayRuntime` with its
managed Envoy and a simulated model server, all on loopback."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)
from google.protobuf import empty_pb2, struct_pb2, wrappers_pb2

from poolkeeper import observation as wire
from poolkeeper.controller.files import FileResourceSource, file_source
from poolkeeper.datastore import Datastore
from poolkeeper.envoy.process import EnvoyOptions, EnvoySupervisor
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.outcome import Outcome
from poolkeeper.server.envoy_bootstrap import bootstrap_params
from poolkeeper.server.options import ServeOptions
from tests.support.gateway_files import one_pool
from tests.support.sim_gateway import running_gateway, sim_server

pytestmark = pytest.mark.integration

MODEL = "m"
ANY = "0.0.0.0"  # the listeners' address: the EPP's own ports must still bind loopback only


def _headers() -> pb.ProcessingRequest:
    values = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        ":authority": "gw",
        "content-type": "application/json",
    }
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers))


def _body() -> pb.ProcessingRequest:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}'
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def _forged_entry(key: str) -> als_pb2.StreamAccessLogsMessage:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    meta = struct_pb2.Struct()
    meta.update({wire.EXCHANGE: key, wire.COMPLETION_TOKENS: 10_000_000, wire.EVENTS: 1})
    entry.common_properties.metadata.filter_metadata[wire.NAMESPACE].CopyFrom(meta)
    entry.response.response_code.value = 200
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.append(entry)
    return message


def _reachable(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((address, port)) == 0


def test_waiting_room_keys_are_random_per_request() -> None:
    """Keys were a per-process prefix and a counter: one routing told the next key."""

    class Held:
        def observed(self, outcome: object) -> None:
            pass

        def first_byte_passed(self) -> None:
            pass

    room = DetachedExchanges()
    keys = [room.hold(Held()) for _ in range(200)]
    assert len(set(keys)) == 200
    prefixes = {key[:6] for key in keys}
    assert len(prefixes) > 150  # no shared prefix: nothing to learn from one key
    assert all(len(key) >= 16 for key in keys)


@pytest.mark.parametrize("transport", ["grpcio", "lean"])
async def test_a_direct_client_of_the_epp_port_changes_nothing(
    tmp_path: Path, transport: str
) -> None:
    async with (
        sim_server(MODEL) as sim_port,
        running_gateway(
            ServeOptions(
                source=file_source(
                    [one_pool(tmp_path, sim_port, transport=transport, address=ANY)]
                ),
                ready_wait_s=5,
            )
        ) as runtime,
    ):
        assert runtime.config is not None
        assert runtime.director is not None
        assert runtime.detached is not None
        assert runtime.metrics is not None
        listeners = runtime.config.spec.listeners
        # The public listener serves every address; the EPP's own ports only loopback.
        assert _reachable("127.0.0.2", listeners.http)
        for port in (listeners.ext_proc, listeners.health, listeners.metrics):
            assert not _reachable("127.0.0.2", port), port
            assert _reachable("127.0.0.1", port), port
        url = f"http://127.0.0.1:{listeners.http}/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        for _ in range(100):  # Envoy's access log reaches the EPP (it carries the token)
            if runtime.detached.settled >= 1:
                break
            await asyncio.sleep(0.05)
        assert runtime.detached.settled == 1
        inflight_before = len(runtime.director.inflight)  # type: ignore[arg-type]
        waiting_before = len(runtime.detached)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{listeners.ext_proc}") as channel:
            process = pb_grpc.ExternalProcessorStub(channel).Process(iter([_headers(), _body()]))
            with pytest.raises(grpc.aio.AioRpcError) as routed:
                await process.read()  # refused before any reply: not routed, nothing named
            # The refusal is a trailers-only UNAUTHENTICATED plus RST_STREAM(NO_ERROR) while
            # the client may still be sending; grpc-core then sometimes reports the reset
            # (INTERNAL) instead of the status. That it was the token check that refused is
            # proven below by the refused-calls counter (3: this call and the two after it).
            assert routed.value.code() in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.INTERNAL,
            )
            logs = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(
                iter([_forged_entry("any-key")])
            )
            with pytest.raises(grpc.aio.AioRpcError) as forged:
                await logs
            assert forged.value.code() == grpc.StatusCode.UNAUTHENTICATED
            first_byte = channel.unary_unary(
                wire.FIRST_BYTE_PATH,
                request_serializer=wrappers_pb2.StringValue.SerializeToString,
                response_deserializer=empty_pb2.Empty.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as reported:
                await first_byte(wrappers_pb2.StringValue(value="any-key"))
            assert reported.value.code() == grpc.StatusCode.UNAUTHENTICATED

        assert len(runtime.director.inflight) == inflight_before  # type: ignore[arg-type]
        assert len(runtime.detached) == waiting_before
        assert runtime.detached.settled == 1
        page = runtime.metrics.render().decode()
        assert "inference_extension_epp_refused_calls_total 3.0" in page
        # The stream cap's figures are exported (a refused direct call never held a stream).
        assert "poolkeeper_extproc_streams 0.0" in page
        assert "poolkeeper_extproc_streams_refused_total 0.0" in page
        # And the gateway still serves: Envoy's own calls carry the token.
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
            assert resp.status == 200


@pytest.mark.parametrize(("managed", "expected"), [(True, "127.0.0.1"), (False, "10.1.2.3")])
async def test_the_managed_envoy_reaches_the_epp_on_loopback(
    tmp_path: Path, managed: bool, expected: str
) -> None:
    """With a specific public address the EPP still listens on loopback for its own Envoy,
    so that Envoy must look for it there; another host's Envoy uses the public address."""
    directory = one_pool(tmp_path, 8000, address="10.1.2.3")
    store = Datastore()
    source = FileResourceSource([directory], store)
    config = await source.start()
    params = bootstrap_params(config, store.snapshot(), managed=managed)
    assert params.extproc_address == expected
    assert params.listen_address == "10.1.2.3"


async def test_a_dead_envoys_routed_requests_are_settled_at_once(tmp_path: Path) -> None:
    """Envoy's access-log entries of the requests it routed die with it: the waiting room is
    emptied when the supervisor sees it die, instead of holding them for the hour-long TTL."""
    outcomes: list[Outcome] = []

    class Waiting:
        def observed(self, outcome: Outcome) -> None:
            outcomes.append(outcome)

        def first_byte_passed(self) -> None:
            raise AssertionError("no first-byte report here")

    room = DetachedExchanges()
    for _ in range(3):
        room.hold(Waiting())
    fake = tmp_path / "envoy"
    fake.write_text("#!/bin/sh\nsleep 0.1\nexit 1\n")  # an Envoy that dies at once
    fake.chmod(0o755)
    supervisor = EnvoySupervisor(
        EnvoyOptions(
            binary=str(fake),
            config_path=tmp_path / "envoy.json",
            log_path=tmp_path / "envoy.log",
            restart_initial_s=5.0,
        )
    )
    supervisor.on_death = lambda: room.give_up_all("envoy died")
    await supervisor.start()
    try:
        for _ in range(300):
            if outcomes:
                break
            await asyncio.sleep(0.01)
    finally:
        await supervisor.stop(grace_s=1)
    assert [o.status for o in outcomes] == [0, 0, 0]
    assert len(room) == 0
    assert room.expired == 3


async def test_the_managed_envoys_admin_gives_nothing_away(tmp_path: Path) -> None:
    """Envoy's admin listens on loopback, which any process on the host reaches: its config
    dump handed out the EPP's token (the key to everything above), and /quitquitquit stopped
    the gateway. Only what `serve` reads and the drain are answered; the bootstrap file that
    holds the token is readable by its owner only."""
    workdir = tmp_path / "work"
    async with (
        sim_server(MODEL) as sim_port,
        running_gateway(
            ServeOptions(
                source=file_source([one_pool(tmp_path, sim_port, address=ANY)]),
                ready_wait_s=5,
                workdir=workdir,
            )
        ) as runtime,
    ):
        assert runtime.config is not None
        listeners = runtime.config.spec.listeners
        admin = f"http://127.0.0.1:{listeners.admin}"
        token = runtime._epp_token
        assert token
        async with aiohttp.ClientSession() as session:
            for method, path in (("GET", "/config_dump"), ("POST", "/quitquitquit"),
                                 ("POST", "/runtime_modify?a=b"), ("POST", "/healthcheck/fail"),
                                 ("GET", "/clusters")):  # fmt: skip
                async with session.request(method, admin + path) as resp:
                    text = await resp.text()
                    assert resp.status == 403, (path, resp.status)
                    assert token not in text
            async with session.get(admin + "/stats/prometheus") as resp:
                assert resp.status == 200
                assert token not in await resp.text()
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            url = f"http://127.0.0.1:{listeners.http}/v1/completions"
            async with session.post(url, json=body) as resp:
                assert resp.status == 200  # still serving
        assert (workdir / "envoy.json").stat().st_mode & 0o077 == 0
