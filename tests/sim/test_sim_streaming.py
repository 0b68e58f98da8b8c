"""Streaming details: --stream-interval batching, and a client that hangs up mid-stream."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from poolkeeper.sim.cluster import Listening, SimCluster
from poolkeeper.sim.direct_stream import DirectStream
from poolkeeper.sim.driver import TokenWaiter
from poolkeeper.sim.openai_format import ChunkWriter
from poolkeeper.sim.params import DEFAULT_MODEL
from poolkeeper.sim.request import RequestStatus, SimRequest
from poolkeeper.tokens import count_tokens
from tests.support.waiting import until

pytestmark = pytest.mark.integration

StartCluster = Callable[..., Awaitable[tuple[SimCluster, list[Listening]]]]


def _event_sizes(raw: str) -> tuple[list[int], str | None]:
    """Tokens per SSE text event, and the last event's finish reason."""
    events = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    return [count_tokens(c["text"]) for c in choices], choices[-1]["finish_reason"]


async def test_stream_interval_batches_tokens_per_event(sim_cluster: StartCluster) -> None:
    """Over HTTP in real time, events fall on the interval's boundaries: the first token alone,
    then every 4 tokens, then the rest with the finish reason. A loaded machine may deliver
    several steps at once, which merges whole groups (as vLLM merges outputs a slow client has
    not read) but never cuts one; the exact sequence is test_direct_stream_* below."""
    _, (where,) = await sim_cluster(1, stream_interval=4, time_scale=3.0)
    body = {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 10, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{where.url}/v1/completions", json=body) as response,
    ):
        raw = (await response.read()).decode()
    sizes, reason = _event_sizes(raw)
    assert sum(sizes) == 10
    assert set(itertools.accumulate(sizes)) <= {1, 5, 9, 10}, sizes
    assert reason == "length"


class _Socket(asyncio.WriteTransport):
    """A client socket that keeps what the driver writes (HTTP/1.1 chunks)."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        size, _, rest = bytes(data).partition(b"\r\n")
        assert int(size, 16) == len(rest) - 2
        self.chunks.append(rest[:-2])

    def is_closing(self) -> bool:
        return False


def _direct_stream(interval: int) -> tuple[SimRequest, DirectStream, _Socket]:
    request = SimRequest("r", "m", None, 1, max_tokens=10, arrival=0.0, block_hashes=[])
    writer = ChunkWriter(
        chat=False, response_id="cmpl-r", created=0, model="m", include_usage=False
    )
    socket = _Socket()
    return (
        request,
        DirectStream(socket, TokenWaiter(request, stream=True), writer, 7, 0, interval),
        socket,
    )


@pytest.mark.parametrize(
    ("tokens_per_push", "expected"),
    [
        ([1] * 10, [1, 4, 4, 1]),  # on time: one push per step
        ([3, 3, 4], [1, 4, 5]),  # late: the complete groups go, merged; the finish takes the rest
        ([6, 4], [5, 5]),
        ([10], [10]),
    ],
)
def test_direct_stream_sends_on_the_interval_boundaries(
    tokens_per_push: list[int], expected: list[int]
) -> None:
    request, stream, socket = _direct_stream(interval=4)
    for n in tokens_per_push:
        request.output_tokens += n
        if request.output_tokens == request.max_tokens:
            request.status = RequestStatus.FINISHED
        stream.push()
        stream.push()  # the driver pushes once per step outcome: a second push adds nothing
    sizes, reason = _event_sizes(b"".join(socket.chunks).decode())
    assert sizes == expected
    assert reason == "length"
    assert stream.finished


async def test_client_hanging_up_cancels_the_request(sim_cluster: StartCluster) -> None:
    cluster, (where,) = await sim_cluster(1)
    body = {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 5000, "stream": True}
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{where.url}/v1/completions", json=body)
        await response.content.readline()
        assert cluster.servers[0].engine.stats().running == 1
        response.close()
    engine = cluster.servers[0].engine
    await until(lambda: engine.stats().running == 0, "the request aborted")
    assert engine.counters.finished["abort"] == 1
    assert engine.kv.referenced == 0


async def test_non_streaming_client_leaving_aborts_the_request(sim_cluster: StartCluster) -> None:
    cluster, (where,) = await sim_cluster(1)
    engine = cluster.servers[0].engine
    body = {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 5000}
    async with aiohttp.ClientSession() as http:
        # The client leaves once the request runs (not after a fixed time: on a loaded
        # machine it might not have reached the server yet).
        post = asyncio.create_task(http.post(f"{where.url}/v1/completions", json=body))
        await until(lambda: engine.stats().running == 1, "the request running")
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
    await until(lambda: engine.stats().running == 0, "the request aborted")
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
