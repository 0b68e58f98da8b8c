"""Streaming details: --stream-interval batching, and a client that hangs up mid-stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from poolkeeper.sim.params import DEFAULT_MODEL
from poolkeeper.sim.server import Listening, SimCluster
from poolkeeper.tokens import count_tokens

pytestmark = pytest.mark.integration

StartCluster = Callable[..., Awaitable[tuple[SimCluster, list[Listening]]]]


async def test_stream_interval_batches_tokens_per_event(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, stream_interval=4, time_scale=3.0)
    body = {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 10, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{where.url}/v1/completions", json=body) as response,
    ):
        raw = (await response.read()).decode()
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: {")]
    texts = [json.loads(e)["choices"][0]["text"] for e in events]
    assert count_tokens("".join(texts)) == 10
    # The first token alone, then groups of 4, then the rest with the finish reason.
    assert [count_tokens(t) for t in texts] == [1, 4, 4, 1]
    assert json.loads(events[-1])["choices"][0]["finish_reason"] == "length"


async def test_client_hanging_up_cancels_the_request(sim_cluster: StartCluster) -> None:
    cluster, (where,) = await sim_cluster(1)
    body = {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 5000, "stream": True}
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{where.url}/v1/completions", json=body)
        await response.content.readline()
        assert cluster.servers[0].engine.stats().running == 1
        response.close()
    for _ in range(100):
        if cluster.servers[0].engine.stats().running == 0:
            break
        await asyncio.sleep(0.02)
    engine = cluster.servers[0].engine
    assert engine.stats().running == 0
    assert engine.counters.finished["abort"] == 1
    assert engine.kv.referenced == 0


async def test_non_streaming_client_leaving_aborts_the_request(sim_cluster: StartCluster) -> None:
    cluster, (where,) = await sim_cluster(1)
    engine = cluster.servers[0].engine
    body = {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 5000}
    timeout = aiohttp.ClientTimeout(total=0.2)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        with pytest.raises(TimeoutError):
            await http.post(f"{where.url}/v1/completions", json=body)
    assert engine.stats().running == 1
    for _ in range(100):
        if engine.stats().running == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.stats().running == 0
    assert engine.counters.finished["abort"] == 1


async def test_chat_role_chunk_comes_with_the_first_token_after_prefill(
    sim_cluster: StartCluster,
) -> None:
    """vLLM (`serving_chat.py`) emits the role chunk on the engine's first output, so a client
    timing its first chunk sees queueing and prefill. When the first event reaches the client
    the request must already have produced a token (a causal check, no timing)."""
    cluster, (where,) = await sim_cluster(1, time_scale=3.0)
    engine = cluster.servers[0].engine
    prompt = "many words of a long prompt " * 400
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 5000,
        "stream": True,
    }
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{where.url}/v1/chat/completions", json=body)
        first = await response.content.readline()
        (request,) = engine.running
        assert request.output_tokens >= 1
        assert json.loads(first[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        lines = [await response.content.readline() for _ in range(3)]
        token = json.loads(lines[1][6:])["choices"][0]["delta"]
        assert lines[0] == b"\n"
        assert lines[2] == b"\n"
        assert token["content"]
        assert "role" not in token
        response.close()
