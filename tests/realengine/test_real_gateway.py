"""End to end with a real engine: the official openai client → real Envoy → `poolkeeper serve`
(EPP) → three llama.cpp `llama-server` processes serving SmolLM2-135M (one pool), plus one more
in a pool of its own that a test kills mid-stream.

Opt-in (`make e2e-real`; marker `real_engine`, deselected by default): the server is built from
source on first install (scripts/install-real-engine.sh). Each assertion reads what the engine
itself says where it can (its /metrics and /slots, the `usage` it reports), not the gateway's
view of it.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.netutil import free_ports
from tests.realengine.llama import BASE_MODEL, LlamaServer, start_server, wait_healthy
from tests.support.gateway_files import POOL, gateway_doc, gateway_ports, model_doc, write_config
from tests.support.processes import Proc, poolkeeper, wait_for_text, wait_ready

pytestmark = [pytest.mark.real_engine, pytest.mark.usefixtures("real_engine")]

SERVED = "x-gateway-destination-endpoint-served"
SPLIT = "smol-split"  # 80 / 20 over two target names, both the one base model
BATCH = "smol-batch"  # Sheddable, same base model
VICTIM = "smol-victim"  # the pool whose only server a test kills
# llama.cpp's own request field: generate to max_tokens (the small model often stops early).
LONG = {"ignore_eos": True}

# The servers answer /metrics from the same loop that runs the model, between two passes of at
# most one 64-token batch (tests/realengine/llama.py): on a loaded 2-core machine that can take
# longer than the 50 ms defaults assume, so scrapes get a longer timeout and metrics stay
# fresh for 2 s (docs/engines.md, "llama.cpp").
SCRAPING = "{intervalMs: 100, timeoutMs: 3000, stalenessMs: 2000}"


@dataclass
class Gateway:
    url: str
    ports: dict[str, int]
    proc: Proc
    servers: list[LlamaServer]  # the "llama" pool
    victim: LlamaServer  # the "victim" pool
    opened: list[openai.AsyncOpenAI]

    def client(self, **kw: Any) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kw
        )
        self.opened.append(client)
        return client

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()  # type: ignore[no-any-return]

    def server(self, hostport: str) -> LlamaServer:
        (server,) = [s for s in (*self.servers, self.victim) if s.hostport == hostport]
        return server


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    logs = tmp_path_factory.mktemp("llama")
    *ports, victim_port = free_ports(4)
    servers = [start_server(p, logs / f"llama-{p}.log") for p in ports]
    victim = start_server(victim_port, logs / "victim.log")
    proc: Proc | None = None
    try:
        wait_healthy([*servers, victim])
        gw_ports = gateway_ports()
        endpoints = [(f"llama-{i}", p, "llama") for i, p in enumerate(ports)]
        endpoints.append(("victim-0", victim_port, "victim"))
        docs = [
            gateway_doc(gw_ports, endpoints, engine="llamacpp", scraping=SCRAPING),
            POOL.format(name="llama", app="llama", failure_mode="FailClose"),
            POOL.format(name="victim", app="victim", failure_mode="FailClose"),
            model_doc(BASE_MODEL, "llama", "Critical"),
            model_doc(SPLIT, "llama", "Standard", {"smol-a": 80, "smol-b": 20}),
            model_doc(BATCH, "llama", "Sheddable", [BASE_MODEL]),
            model_doc(VICTIM, "victim", "Critical", [BASE_MODEL]),
        ]
        directory = write_config(tmp_path_factory.mktemp("gateway"), docs)
        proc = poolkeeper(
            ["serve", "-f", str(directory), "--workdir", str(directory) + "-envoy",
             "--drain-grace", "1", "--log-format", "text"],
            directory / "serve.log",
        )  # fmt: skip
        wait_for_text(proc, "gateway ready on", timeout=60)
        wait_ready(gw_ports["health"], proc, timeout=60)
        yield Gateway(f"http://127.0.0.1:{gw_ports['http']}", gw_ports, proc, servers, victim, [])
    finally:
        if proc is not None:
            proc.stop(signal.SIGINT)
        for server in (*servers, victim):
            server.stop()


@pytest.fixture(autouse=True)
async def _close_clients(gateway: Gateway) -> AsyncIterator[None]:
    yield
    while gateway.opened:
        await gateway.opened.pop().close()


async def _until(predicate: Any, within: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return True
        await asyncio.sleep(step)
    return bool(await asyncio.to_thread(predicate))


def _idle(servers: list[LlamaServer]) -> bool:
    return all(s.metrics()["llamacpp:requests_processing"] == 0 for s in servers)


async def test_chat_and_completions_carry_the_client_model_name(gateway: Gateway) -> None:
    client = gateway.client()
    chat = await client.chat.completions.with_raw_response.create(
        model=BASE_MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5
    )
    assert chat.headers[SERVED] in {s.hostport for s in gateway.servers}
    body = chat.parse()
    assert body.model == BASE_MODEL
    assert body.choices[0].message.content
    assert body.usage is not None
    assert 0 < body.usage.completion_tokens <= 5
    assert body.usage.prompt_tokens > 5  # the real tokenizer and chat template

    completion = await client.completions.create(model=SPLIT, prompt="Once upon", max_tokens=4)
    assert completion.model == SPLIT  # the server answers with its own name; given back
    assert completion.choices[0].text
    assert completion.usage is not None


async def test_streaming_with_and_without_usage(gateway: Gateway) -> None:
    client = gateway.client()
    stream = await client.chat.completions.create(
        model=SPLIT, messages=[{"role": "user", "content": "Count to five"}], max_tokens=8,
        stream=True,
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert {c.model for c in chunks} == {SPLIT}
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    # The gateway asked for usage on the client's behalf (its own accounting) and took it out.
    assert all(c.usage is None for c in chunks)

    asked = await client.chat.completions.create(
        model=BASE_MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    pieces = [c async for c in asked]
    usage = pieces[-1].usage
    assert usage is not None  # asked for: delivered, as the engine counted it
    assert 0 < usage.completion_tokens <= 6
    assert usage.prompt_tokens > 0


async def test_a_repeated_prompt_reuses_the_engine_prompt_cache(gateway: Gateway) -> None:
    """Prefix-aware routing sends the repeat to the server that holds the prompt, and that
    server's own counters and `usage` say it was served from its cache."""
    client = gateway.client()
    system = "You are a terse assistant for a garden centre. " * 30  # ~300 tokens
    messages: Any = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which plants like shade?"},
    ]
    first = await client.chat.completions.with_raw_response.create(
        model=BASE_MODEL, messages=messages, max_tokens=2
    )
    host = first.headers[SERVED]
    before = await asyncio.to_thread(gateway.server(host).metrics)
    second = await client.chat.completions.with_raw_response.create(
        model=BASE_MODEL, messages=messages, max_tokens=2
    )
    assert second.headers[SERVED] == host
    usage = second.parse().usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= usage.prompt_tokens // 2, usage
    after = await asyncio.to_thread(gateway.server(host).metrics)
    key = "llamacpp:prompt_tokens_cached_total"
    assert after[key] - before[key] == cached


def _requests_by_target(text: str, model: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "inference_model_request_total"
                and sample.labels["model_name"] == model
            ):
                out[sample.labels["target_model_name"]] += int(sample.value)
    return out


async def test_weighted_split_over_one_base_model(gateway: Gateway) -> None:
    client = gateway.client()
    n = 40
    semaphore = asyncio.Semaphore(6)
    before = _requests_by_target(gateway.metrics(), SPLIT)

    async def one(i: int) -> str:
        async with semaphore:
            r = await client.completions.create(model=SPLIT, prompt=f"Item {i}:", max_tokens=1)
            return r.model

    assert set(await asyncio.gather(*(one(i) for i in range(n)))) == {SPLIT}
    counts = _requests_by_target(gateway.metrics(), SPLIT) - before
    assert sum(counts.values()) == n
    # 80/20: binomial sd = sqrt(40 * 0.8 * 0.2) ≈ 2.5; allow 4 sd.
    assert abs(counts["smol-a"] - 32) <= 10, counts


async def test_client_cancel_stops_generation_on_the_server(gateway: Gateway) -> None:
    client = gateway.client()
    assert await _until(lambda: _idle(gateway.servers), 30)
    raw = await client.completions.with_raw_response.create(
        model=BASE_MODEL, prompt="Write a very long story about a lighthouse.",
        max_tokens=1500, stream=True, extra_body=LONG,
    )  # fmt: skip
    server = gateway.server(raw.headers[SERVED])
    stream = raw.parse()
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].text)
        if seen >= 3:
            break
    assert server.metrics()["llamacpp:requests_processing"] == 1
    started = time.monotonic()
    await stream.close()
    # 1500 tokens take the server tens of seconds; a cancelled request frees its slot at once.
    assert await _until(lambda: server.metrics()["llamacpp:requests_processing"] == 0, 10)
    slots = await asyncio.to_thread(server.slots)
    assert not any(s["is_processing"] for s in slots)
    decoded = max(s.get("next_token", [{}])[0].get("n_decoded", 0) for s in slots)
    assert decoded < 1500, slots
    assert time.monotonic() - started < 10


async def test_sheddable_is_held_then_refused_when_saturated_critical_is_not(
    gateway: Gateway,
) -> None:
    """Every slot of every server busy and requests deferred on each: Sheddable waits in the
    EPP's queue and gets 429 queue_timeout at its TTL (as llm-d-router); Critical is still sent."""
    client = gateway.client()
    assert await _until(lambda: _idle(gateway.servers), 30)
    slots = sum(len(s.slots()) for s in gateway.servers)

    async def hold() -> None:  # a deferred request gets its response headers only once it runs
        stream = await client.completions.create(
            model=BASE_MODEL, prompt="A long story:", max_tokens=2000, stream=True,
            extra_body=LONG,
        )  # fmt: skip
        async for _ in stream:
            pass

    holders: list[asyncio.Task[Any]] = [
        asyncio.create_task(hold()) for _ in range(slots + 2 * len(gateway.servers))
    ]
    try:
        assert await _until(
            lambda: all(s.metrics()["llamacpp:requests_deferred"] >= 1 for s in gateway.servers),
            60,
        )
        refused = None
        for _ in range(10):
            started = time.monotonic()
            try:
                await client.with_options(timeout=8).completions.create(
                    model=BATCH, prompt="x", max_tokens=1
                )
            except openai.APITimeoutError:
                # Sent before the gateway saw every server's queue (a scrape behind): it waits
                # on a server, adding to the queue the next attempt sees.
                continue
            except openai.APIStatusError as exc:
                refused, waited = exc, time.monotonic() - started
                break
        assert refused is not None, "the saturated pool never held the Sheddable request"
        assert refused.status_code == 429
        assert isinstance(refused.body, dict)
        assert refused.body["code"] == "queue_timeout"
        assert 1.0 < waited < 10.0
        # Critical is not held: it reaches a server, where it waits for a slot (deferred).
        # max_tokens=1: without it llama-server generates to its context limit, and a cancelled
        # non-streaming request it has not noticed kept a slot busy past the final idle wait.
        deferred = sum(s.metrics()["llamacpp:requests_deferred"] for s in gateway.servers)
        holders.append(
            asyncio.create_task(
                client.completions.create(model=BASE_MODEL, prompt="x", max_tokens=1)
            )
        )
        assert await _until(
            lambda: (
                sum(s.metrics()["llamacpp:requests_deferred"] for s in gateway.servers) > deferred
            ),
            10,
        )
    finally:
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    assert await _until(lambda: _idle(gateway.servers), 30)


async def test_a_server_killed_mid_stream_is_an_error_at_the_client(gateway: Gateway) -> None:
    client = gateway.client()
    raw = await client.chat.completions.with_raw_response.create(
        model=VICTIM, messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=1500, stream=True, extra_body=LONG,
    )  # fmt: skip
    assert raw.headers[SERVED] == gateway.victim.hostport
    stream = raw.parse()
    chunks: list[Any] = []

    async def read() -> None:
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                gateway.victim.process.kill()

    # A body cut short surfaces as the client's transport error (httpx's or httpx2's,
    # whichever this openai release is built on), or as an openai error.
    with pytest.raises(Exception) as cut:  # noqa: PT011
        await read()
    assert type(cut.value).__module__.split(".")[0] in {"openai", "httpx", "httpx2"}, cut.value
    assert len(chunks) >= 3
    assert not any(c.choices and c.choices[0].finish_reason for c in chunks)
