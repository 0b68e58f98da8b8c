"""Model-server faults through a real Envoy (checklist D1-D3, findings 6 and 7): a server that
drops the connection before answering is retried on the next listed endpoint; a silent one
gets a 504 in OpenAI JSON after the first-byte timeout (not after the stream has started);
a stream cut at any byte is never a clean end (silent truncations: 0 of N)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import aiohttp
import pytest

from tests.reliability.faultproxy import Fault, FaultProxy
from tests.reliability.rel_harness import gate

pytestmark = pytest.mark.integration

CHAT: dict[str, object] = {"model": "m", "messages": []}


async def _post(url: str, body: dict[str, object]) -> tuple[int, bytes]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        return resp.status, await resp.read()


async def test_drop_before_first_byte_is_retried_on_the_next_endpoint(tmp_path: Path) -> None:
    """Finding 6 (D2): 50 of 50 such requests got 503; now each is served by the fallback."""
    proxy = FaultProxy(fault=Fault.CLOSE)
    await proxy.start()
    try:
        # The EPP lists the dropping server first, a healthy one second (protocol v0.4+).
        async with gate(tmp_path, fixed=(proxy.hostport,)) as g:
            g.router.fixed = (proxy.hostport, g.backends[0].hostport)
            for _ in range(10):
                status, raw = await _post(g.url, CHAT)
                assert status == 200, raw
                assert json.loads(raw)["served_by"] == "a"
            assert proxy.connections >= 10  # every request did try the dropping server first
            g.router.fixed = (proxy.hostport,)  # nothing else listed: a clean 503, JSON
            status, raw = await _post(g.url, CHAT)
            assert status == 503
            assert json.loads(raw)["error"]["code"] == "upstream_unavailable"
    finally:
        await proxy.stop()


async def test_silent_server_is_bounded_by_the_first_byte_timeout(tmp_path: Path) -> None:
    """Finding 7 (D3): a stalled server held requests 300 s, then a plain-text 504. Now the
    first-byte timeout (configurable) ends the try; nothing was sent to the client, so Envoy
    moves on to the next listed endpoint like for a dropped connection ("reset" includes a
    read timeout), and when none is left the answer is OpenAI JSON."""
    holes = [FaultProxy(fault=Fault.BLACK_HOLE) for _ in range(2)]
    for hole in holes:
        await hole.start()
    try:
        async with gate(tmp_path, fixed=(holes[0].hostport,), first_byte_timeout_s=1.0) as g:
            g.router.fixed = (holes[0].hostport, g.backends[0].hostport)
            status, raw = await _post(g.url, CHAT)
            assert status == 200
            assert json.loads(raw)["served_by"] == "a"
            g.router.fixed = (holes[0].hostport,)  # the only one listed
            status, raw = await _post(g.url, CHAT)
            assert status in (503, 504)
            error = json.loads(raw)["error"]
            assert error["code"] in ("upstream_unavailable", "upstream_timeout")
    finally:
        for hole in holes:
            await hole.stop()


async def test_first_byte_timeout_does_not_cut_a_started_stream(tmp_path: Path) -> None:
    async with gate(tmp_path, first_byte_timeout_s=0.5) as g:
        status, raw = await _post(g.url, {"model": "slow", "stream": True, "messages": []})
        assert status == 200
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert b"world" in raw


async def test_streams_cut_at_any_byte_are_never_a_clean_end(tmp_path: Path) -> None:
    """Headline figure 1 (D1): N streams, each cut by a reset after a random number of bytes
    of the server's answer; every one must end in an error at the client, none in [DONE]."""
    rng = random.Random(13)
    n = 20
    silent = 0
    errors = 0
    async with gate(tmp_path) as g:
        for _ in range(n):
            proxy = FaultProxy(
                upstream_port=g.backends[0].port,
                fault=Fault.RESET_AFTER,
                reset_after=rng.randrange(150, 420),  # inside the SSE body
            )
            await proxy.start()
            try:
                g.router.fixed = (proxy.hostport,)
                timeout = aiohttp.ClientTimeout(total=30)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    try:
                        async with session.post(
                            g.url + "/v1/chat/completions",
                            json={"model": "m", "stream": True, "messages": []},
                        ) as resp:
                            body = await resp.read()
                            if resp.status == 200 and body.rstrip().endswith(b"[DONE]"):
                                silent += 1
                            else:
                                errors += 1
                    except aiohttp.ClientError:
                        errors += 1
            finally:
                await proxy.stop()
    assert silent == 0
    assert errors == n
