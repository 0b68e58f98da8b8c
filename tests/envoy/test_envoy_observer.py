"""The response observer against the real Envoy: its Lua filter and gRPC access log tell the
EPP how each routed response ended, after the EPP has left the request's ext_proc stream.

What only a real Envoy shows: a stream in flight survives the EPP's death under FailOpen
(with every response body passing the EPP it is cut: Envoy cannot fail open once a
FULL_DUPLEX body was sent), and the status, first-byte time, usage, serving host, client
resets and backend cuts all arrive through the access log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.netutil import free_port
from tests.envoy.envoy_harness import (
    Backend,
    Epp,
    RoundRobinRouter,
    rig_params,
    running_envoy,
    start_epp,
)

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


@dataclass
class Rig:
    url: str
    backends: list[Backend]
    router: RoundRobinRouter
    epp: Epp
    detached: DetachedExchanges | None


@asynccontextmanager
async def rig(
    tmp_path: Path,
    transport: str,
    *,
    observe: bool,
    inject_usage: bool = False,
    fail_open: bool = True,
    report: bool = False,
) -> AsyncIterator[Rig]:
    backends = [Backend("a"), Backend("b")]
    for b in backends:
        await b.start()
    router = RoundRobinRouter(backends, inject_usage=inject_usage)
    detached = DetachedExchanges() if observe else None
    server = await start_epp(
        transport, ExtProcServicer(router, detached=detached), free_port(), detached=detached
    )
    epp_port = server.port
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write([b.hostport for b in backends])
    params = rig_params(
        backends, epp_port, endpoints.path, fail_open=fail_open, observe_responses=observe,
        report_first_bytes=report,
    )  # fmt: skip
    try:
        async with running_envoy(params, tmp_path):
            yield Rig(f"http://127.0.0.1:{params.listen_port}", backends, router, server, detached)
    finally:
        await server.stop(None)
        for b in backends:
            await b.stop()


async def _until(condition: Callable[[], object], seconds: float = 60.0) -> None:
    """Polls until `condition` holds; the bound only ends a failing test, so it is generous:
    Envoy flushes its access log on a timer, which a loaded machine can delay by seconds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("observe", [True, False])
async def test_a_stream_in_flight_outlives_the_epp_only_with_the_observer(
    tmp_path: Path, transport: str, observe: bool
) -> None:
    async with rig(tmp_path, transport, observe=observe) as r:
        body = {"model": "gated", "stream": True, "stream_options": {"include_usage": True}}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{r.url}{CHAT}", json=body) as resp,
        ):
            assert resp.status == 200
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 20)
            await r.epp.stop(None)  # the EPP dies while the answer is being generated
            for backend in r.backends:
                backend.gate.set()
            try:
                rest = await asyncio.wait_for(resp.read(), 20)
            except aiohttp.ClientPayloadError:
                rest = b"<cut>"
        assert b"hello" in first
        if observe:
            assert rest.endswith(b"data: [DONE]\n\n"), rest
            assert b"world" in rest
        else:  # the body went through the EPP: Envoy cannot fail open any more
            assert not rest.endswith(b"data: [DONE]\n\n"), rest


async def test_the_outcome_of_a_stream_arrives_through_the_access_log(
    tmp_path: Path, transport: str
) -> None:
    async with rig(tmp_path, transport, observe=True) as r:
        body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{r.url}{CHAT}", json=body) as resp,
        ):
            raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        await _until(lambda: r.router.completed)
        ((status, usage, served),) = r.router.completed
        assert status == 200
        assert served in {b.hostport for b in r.backends}
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens, usage.estimated) == (5, 2, False)
        (after,) = r.router.first_byte_after
        assert after is not None
        assert 0 <= after < 5
        assert r.detached is not None
        assert len(r.detached) == 0


@pytest.mark.parametrize("report", [True, False])
async def test_the_first_byte_is_reported_while_the_stream_is_still_open(
    tmp_path: Path, transport: str, report: bool
) -> None:
    """With the report (a scheduler that learns from first tokens), the Lua filter tells the
    EPP as the first byte passes; without it the EPP learns it from the access log only."""
    async with rig(tmp_path, transport, observe=True, report=report) as r:
        body = {"model": "gated", "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{r.url}{CHAT}", json=body) as resp,
        ):
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 20)
            assert b"hello" in first
            if report:
                await _until(lambda: r.router.first_byte_after)
                assert r.router.first_byte_after == [None]  # told now, not afterwards
            else:
                await asyncio.sleep(0.3)  # time enough for a report, were one sent
                assert r.router.first_byte_after == []
            assert r.router.completed == []  # the response is still being generated
            for backend in r.backends:
                backend.gate.set()
            rest = await asyncio.wait_for(resp.read(), 20)
        assert rest.endswith(b"data: [DONE]\n\n")
        await _until(lambda: r.router.completed)
        ((status, _usage, _served),) = r.router.completed
        assert status == 200
        # Told once either way: the access log's timing only when no report came first.
        (after,) = r.router.first_byte_after
        assert (after is None) == report


async def test_no_first_byte_report_for_a_json_answer(tmp_path: Path, transport: str) -> None:
    async with (
        rig(tmp_path, transport, observe=True, report=True) as r,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{r.url}{CHAT}", json={"model": "m"}) as resp:
            assert resp.status == 200
            await resp.read()
        await _until(lambda: r.router.completed)
        await asyncio.sleep(0.2)
        # A JSON answer's first byte is its whole body: no report, only the access log's.
        (after,) = r.router.first_byte_after
        assert after is not None


async def test_a_json_answer_and_a_stream_without_usage(tmp_path: Path, transport: str) -> None:
    async with rig(tmp_path, transport, observe=True) as r, aiohttp.ClientSession() as session:
        async with session.post(f"{r.url}{CHAT}", json={"model": "m"}) as resp:
            assert resp.status == 200
            await resp.read()
        await _until(lambda: len(r.router.completed) == 1)
        async with session.post(f"{r.url}{CHAT}", json={"model": "m", "stream": True}) as resp:
            raw = await resp.read()
        assert b"usage" in raw
        assert b'"prompt_tokens"' not in raw
        await _until(lambda: len(r.router.completed) == 2)
    (json_status, json_usage, _), (sse_status, sse_usage, _) = r.router.completed
    assert json_status == sse_status == 200
    assert json_usage is not None
    assert (json_usage.prompt_tokens, json_usage.estimated) == (3, False)
    assert json_usage.completion_tokens == 4
    # Two content events and `[DONE]`: two tokens, counted by the gateway.
    assert sse_usage is not None
    assert (sse_usage.completion_tokens, sse_usage.estimated) == (2, True)


async def test_events_split_across_body_chunks_are_counted_once(
    tmp_path: Path, transport: str
) -> None:
    """A stream written 3 bytes at a time: every `data:` and `[DONE]` marker is split between
    chunks, and the Lua filter still counts each event once."""
    async with rig(tmp_path, transport, observe=True) as r, aiohttp.ClientSession() as session:
        body = {"model": "trickle", "stream": True}
        async with session.post(f"{r.url}{CHAT}", json=body) as resp:
            raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        await _until(lambda: r.router.completed)
    ((status, usage, _),) = r.router.completed
    assert status == 200
    assert usage is not None
    assert (usage.completion_tokens, usage.estimated) == (3, True)  # 4 events, one [DONE]


async def test_a_usage_object_split_across_body_chunks_is_read(
    tmp_path: Path, transport: str
) -> None:
    """The same 3-byte stream with `"usage": null` in every event and the counts at the end:
    the key, its `null`s and the object are all split between chunks, and the object is still
    read (and the nulls are not taken for it). The splits are the harness's 3-byte writes 2 ms
    apart; a loaded Envoy may merge some, which can only make the test easier, never fail it
    falsely (a split-independent check would need a standalone LuaJIT, not a dependency)."""
    async with rig(tmp_path, transport, observe=True) as r, aiohttp.ClientSession() as session:
        body = {"model": "trickle", "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{r.url}{CHAT}", json=body) as resp:
            raw = await resp.read()
        assert raw.count(b'"usage": null') == 3
        assert raw.endswith(b"data: [DONE]\n\n")
        await _until(lambda: r.router.completed)
    ((status, usage, _),) = r.router.completed
    assert status == 200
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.estimated) == (5, 3, False)


async def test_a_client_leaving_mid_stream_and_a_backend_cut_are_reported_cut(
    tmp_path: Path,
    transport: str,
) -> None:
    async with rig(tmp_path, transport, observe=True) as r, aiohttp.ClientSession() as session:
        body = {"model": "gated", "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{r.url}{CHAT}", json=body) as resp:
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 20)
            resp.close()  # the client walks away
        await _until(lambda: r.router.completed)
        for backend in r.backends:
            backend.gate.set()
        async with session.post(f"{r.url}{CHAT}", json={"model": "cut", "stream": True}) as resp:
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        await _until(lambda: len(r.router.completed) == 2)
    assert [status for status, _, _ in r.router.completed] == [499, 499]
    assert r.detached is not None
    assert len(r.detached) == 0


@pytest.mark.parametrize("fail_open", [True, False])
async def test_responses_the_epp_rewrites_still_pass_it(
    tmp_path: Path, transport: str, fail_open: bool
) -> None:
    """An injected usage chunk must be stripped: that stream goes to the EPP (through the
    response processor, on the route the EPP's metadata chooses)."""
    async with rig(tmp_path, transport, observe=True, inject_usage=True, fail_open=fail_open) as r:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{r.url}{CHAT}", json={"model": "m", "stream": True}) as resp,
        ):
            raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        assert b'"prompt_tokens"' not in raw  # the injected usage chunk was removed
        await _until(lambda: r.router.completed)
        ((status, usage, _),) = r.router.completed
        assert status == 200
        assert usage is not None
        assert (usage.completion_tokens, usage.estimated) == (2, False)
        assert r.detached is not None
        assert len(r.detached) == 0
