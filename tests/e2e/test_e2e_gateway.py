"""End to end: the official openai client → real Envoy → `poolkeeper serve` (EPP) → simulators.

One gateway is shared by the module, with four pools: a LoRA-serving fleet; three real-speed
servers with one adapter slot each, whose adapters the LoRA test sets up; a one-slot pool that
saturates; and a pool with no endpoints. The killed-`serve` case starts its own small gateway
over the same simulators.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.tokens import count_tokens
from tests.support.gateway_files import POOL, gateway_doc, gateway_ports, model_doc, write_config
from tests.support.processes import (
    STARTUP_S,
    Proc,
    killing_orphans,
    listening_ports,
    poolkeeper,
    wait_for_text,
    wait_ready,
)
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

BASE = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTERS = ("food-review-v1", "food-review-v2", "tweet-summary-1")
DEST = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
# The "adapters" pool: one adapter slot per server (--max-loras 1), real speed, a small KV cache.
LORA_ONLY = ("lora-a", "lora-b", "lora-c")
HOLDER_PROMPT_TOKENS = 8000  # 500 of the 2000 KV blocks while its request runs
HOLDER_MAX_TOKENS = 1500  # adds at most 94 blocks; about 90 s of decoding at LORA_STEP_S
# A step of the "adapters" servers (the default is 6 ms): a holder must outlive the test's steps,
# which take well over 10 s on a loaded machine; the test closes the holders when it is done.
LORA_STEP_S = 0.06


@dataclass
class Fleet:
    ports: list[int]  # the LoRA fleet (app: sim)
    tiny_port: int  # one slow single-slot server (app: tiny)
    lora_ports: list[int]  # three real-speed servers, one adapter slot each (app: lora)
    procs: list[Proc]


@dataclass
class Gateway:
    url: str
    ports: dict[str, int]
    proc: Proc
    fleet: Fleet
    opened: list[openai.AsyncOpenAI]

    def client(self, **kw: Any) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30, **kw
        )
        self.opened.append(client)
        return client

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("sims")
    # --port 0: each server binds a port of the kernel's choosing (listening_ports says why).
    main = poolkeeper(
        ["sim", "--count", "3", "--port", "0", "--lora-adapters", ",".join(ADAPTERS),
         "--max-loras", "2", "--time-scale", "0.02", "--seed", "1"],
        logs / "fleet.log",
    )  # fmt: skip
    tiny = poolkeeper(
        ["sim", "--count", "1", "--port", "0", "--model", "tiny-base", "--max-num-seqs", "1"],
        logs / "tiny.log",
    )  # fmt: skip
    lora_config = logs / "lora.yaml"
    lora_config.write_text(f"defaults:\n  step_overhead_s: {LORA_STEP_S}\n")
    lora = poolkeeper(
        ["sim", "--count", "3", "--port", "0", "--config", str(lora_config),
         "--lora-adapters", ",".join(LORA_ONLY), "--max-loras", "1", "--num-gpu-blocks", "2000",
         "--seed", "2"],
        logs / "lora.log",
    )  # fmt: skip
    procs = [main, tiny, lora]
    try:
        ports = listening_ports(main, 3)
        (tiny_port,) = listening_ports(tiny, 1)
        lora_ports = listening_ports(lora, 3)
        yield Fleet(ports, tiny_port, lora_ports, procs)
    finally:
        for p in procs:
            p.stop()


def _serve(directory: Path, ports: dict[str, int]) -> Proc:
    workdir = directory.with_name(directory.name + "-envoy")
    proc = poolkeeper(
        ["serve", "-f", str(directory), "--workdir", str(workdir),
         "--drain-grace", "1", "--log-format", "text"],
        directory / "serve.log",
    )  # fmt: skip
    wait_for_text(proc, "gateway ready on")
    wait_ready(ports["health"], proc)
    return proc


@pytest.fixture(scope="module", params=["grpcio", "lean"])
def gateway(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Gateway]:
    ports = gateway_ports()
    endpoints = [(f"sim-{i}", p, "sim") for i, p in enumerate(fleet.ports)]
    endpoints.append(("tiny-0", fleet.tiny_port, "tiny"))
    endpoints += [(f"lora-{i}", p, "lora") for i, p in enumerate(fleet.lora_ports)]
    docs = [
        # Four pools behind one gateway: the EPP answers the model list for all of them.
        gateway_doc(ports, endpoints, request.param)
        + "  requestHandling: {answerModelsList: true}\n",
        POOL.format(name="fleet", app="sim", failure_mode="FailClose"),
        POOL.format(name="tiny", app="tiny", failure_mode="FailClose"),
        POOL.format(name="empty", app="nothing-selected", failure_mode="FailClose"),
        POOL.format(name="adapters", app="lora", failure_mode="FailClose"),
        *(model_doc(adapter, "adapters", "Critical") for adapter in LORA_ONLY),
        model_doc(BASE, "fleet", "Critical"),
        model_doc("food-review", "fleet", "Standard", {"food-review-v1": 70, "food-review-v2": 30}),
        model_doc("tweet-summary", "fleet", "Sheddable", ["tweet-summary-1"]),
        model_doc("tiny-critical", "tiny", "Critical", ["tiny-base"]),
        model_doc("tiny-batch", "tiny", "Sheddable", ["tiny-base"]),
        model_doc("ghost", "empty", "Critical"),
    ]
    directory = write_config(tmp_path_factory.mktemp("gateway"), docs)
    proc = _serve(directory, ports)
    try:
        yield Gateway(f"http://127.0.0.1:{ports['http']}", ports, proc, fleet, [])
    finally:
        proc.stop(signal.SIGINT)
        assert proc.process.returncode == 0, proc.log_text()[-2000:]


@pytest.fixture(autouse=True)
async def _close_clients(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    yield
    if "gateway" in request.fixturenames:
        gateway: Gateway = request.getfixturevalue("gateway")
        while gateway.opened:
            await gateway.opened.pop().close()


async def test_models_listing(gateway: Gateway) -> None:
    models = await gateway.client().models.list()
    assert {m.id for m in models.data} == {
        BASE, "food-review", "tweet-summary", "tiny-critical", "tiny-batch", "ghost", *LORA_ONLY,
    }  # fmt: skip


async def test_chat_and_completions_streaming_and_not(gateway: Gateway) -> None:
    client = gateway.client()
    chat = await client.chat.completions.with_raw_response.create(
        model=BASE, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5
    )
    served = chat.headers[SERVED]
    assert int(served.rpartition(":")[2]) in gateway.fleet.ports
    body = chat.parse()
    assert body.choices[0].message.content
    assert body.usage is not None
    assert body.usage.completion_tokens == 5

    completion = await client.completions.create(model=BASE, prompt="Once", max_tokens=4)
    assert completion.choices[0].text
    assert completion.usage is not None

    stream = await client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Count"}], max_tokens=6, stream=True
    )
    chunks = [c async for c in stream]
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    # The gateway injected include_usage for its own accounting and stripped it again.
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)

    completion_stream = await client.completions.create(
        model=BASE,
        prompt="Count",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = [c async for c in completion_stream]
    assert pieces[-1].usage is not None  # asked for: delivered
    assert pieces[-1].usage.completion_tokens == 6


async def test_usage_is_counted_in_gateway_metrics(gateway: Gateway) -> None:
    client = gateway.client()
    stream = await client.chat.completions.create(
        model="food-review", messages=[{"role": "user", "content": "x"}], max_tokens=7,
        stream=True,
    )  # fmt: skip
    async for _ in stream:
        pass
    for _ in range(50):
        text = gateway.metrics()
        lines = [
            line for line in text.splitlines()
            if line.startswith("inference_model_output_tokens_sum{model_name=\"food-review\"")
        ]  # fmt: skip
        if lines and sum(float(line.rsplit(" ", 1)[1]) for line in lines) >= 7:
            break
        await asyncio.sleep(0.1)
    assert lines
    assert sum(float(line.rsplit(" ", 1)[1]) for line in lines) >= 7
    assert 'inference_pool_ready_pods{name="fleet"} 3.0' in text


def _requests_by_target(text: str, model: str) -> Counter[str]:
    """inference_model_request_total per target_model_name for one client model name."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "inference_model_request_total"
                and sample.labels["model_name"] == model
            ):
                out[sample.labels["target_model_name"]] += int(sample.value)
    return out


async def test_weighted_split_within_statistical_bounds(gateway: Gateway) -> None:
    client = gateway.client()
    n = 200
    semaphore = asyncio.Semaphore(16)
    before = _requests_by_target(gateway.metrics(), "food-review")

    async def one() -> str:
        async with semaphore:
            r = await client.chat.completions.create(
                model="food-review", messages=[{"role": "user", "content": "ok"}], max_tokens=1
            )
            return r.model

    # Responses carry the name the client asked for; the split shows in the gateway's metrics.
    assert set(await asyncio.gather(*(one() for _ in range(n)))) == {"food-review"}
    counts = _requests_by_target(gateway.metrics(), "food-review") - before
    assert set(counts) == {"food-review-v1", "food-review-v2"}
    assert sum(counts.values()) == n
    # 70/30 split: binomial sd = sqrt(200 * 0.7 * 0.3) ≈ 6.5; allow 4 sd.
    assert abs(counts["food-review-v1"] - 140) <= 26, counts


def _scrape(hostport: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus endpoint by name: [(labels, value)]."""
    with urllib.request.urlopen(f"http://{hostport}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


async def test_responses_carry_the_client_model_name(gateway: Gateway) -> None:
    client = gateway.client()
    r = await client.chat.completions.with_raw_response.create(
        model="tweet-summary", messages=[{"role": "user", "content": "sum"}], max_tokens=2
    )
    assert r.parse().model == "tweet-summary"  # the client's name, not the adapter's
    stream = await client.chat.completions.create(
        model="tweet-summary", messages=[{"role": "user", "content": "s"}], max_tokens=3,
        stream=True,
    )  # fmt: skip
    assert {c.model async for c in stream} == {"tweet-summary"}


def _adapters(labels: dict[str, str]) -> set[str]:
    return {a for a in labels["running_lora_adapters"].split(",") if a}


def _running_adapters(hostport: str) -> tuple[set[str], set[str], float]:
    """A server's running adapters now (the newest vllm:lora_requests_info series), every
    adapter any of its series ever showed running, and its KV-cache usage."""
    samples = _scrape(hostport)
    series = samples["vllm:lora_requests_info"]  # value: when that combination was last seen
    newest = max(series, key=lambda item: item[1])[0]
    ever = set().union(*(_adapters(labels) for labels, _ in series))
    (kv,) = [value for _, value in samples["vllm:kv_cache_usage_perc"]]
    return _adapters(newest), ever, kv


def _pool_gauge(gateway: Gateway, pool: str, family: str) -> float:
    """One of the gateway's own pool gauges (what its scrapes of the servers have seen)."""
    samples = _scrape(f"127.0.0.1:{gateway.ports['metrics']}")
    (value,) = [v for labels, v in samples[family] if labels["name"] == pool]
    return value


def _pool_kv(gateway: Gateway, pool: str) -> float:
    return _pool_gauge(gateway, pool, "inference_pool_average_kv_cache_utilization")


async def test_lora_requests_land_on_the_pod_running_the_adapter(gateway: Gateway) -> None:
    hosts = [f"127.0.0.1:{port}" for port in gateway.fleet.lora_ports]
    holders = [
        openai.AsyncOpenAI(base_url=f"http://{h}/v1", api_key="x", max_retries=0, timeout=30)
        for h in hosts
    ]
    streams = []
    try:
        # One long request straight to each server, each for another adapter: with one adapter
        # slot per server, each server now holds a different adapter.
        for client, adapter in zip(holders, LORA_ONLY, strict=True):
            stream = await client.completions.create(
                model=adapter,
                prompt=[7] * HOLDER_PROMPT_TOKENS,
                max_tokens=HOLDER_MAX_TOKENS,
                stream=True,
            )
            streams.append(stream)
            await anext(aiter(stream))  # its first token: the request is running
        loaded = [await asyncio.to_thread(_running_adapters, h) for h in hosts]
        assert [running for running, _, _ in loaded] == [{a} for a in LORA_ONLY]
        # Wait (polling) until the gateway has scraped every server since its holder started:
        # the pool's average KV usage reaches the servers' own average only then (one stale
        # server would leave it at most 2 x (500 + 94) / 3 blocks, below 500).
        target = sum(kv for _, _, kv in loaded) / len(loaded)
        assert target >= 0.25
        deadline = time.monotonic() + 60  # a few scrapes; generous for a loaded machine
        while time.monotonic() < deadline:
            if await asyncio.to_thread(_pool_kv, gateway, "adapters") >= target - 1e-9:
                break
            await asyncio.sleep(0.025)
        assert await asyncio.to_thread(_pool_kv, gateway, "adapters") >= target - 1e-9
        client = gateway.client()
        for host, adapter in zip(hosts, LORA_ONLY, strict=True):
            for i in range(2):
                r = await client.chat.completions.with_raw_response.create(
                    model=adapter,
                    messages=[{"role": "user", "content": f"summarise {adapter} {i}"}],
                    max_tokens=2,
                )
                assert r.parse().model == adapter
                assert r.headers[SERVED] == host, (adapter, r.headers[SERVED])
        # No server ever ran another server's adapter (its series keep each combination seen).
        for host, adapter in zip(hosts, LORA_ONLY, strict=True):
            running, ever, _ = await asyncio.to_thread(_running_adapters, host)
            assert running == {adapter}  # the holder still runs: the test ran inside its window
            assert ever == {adapter}
    finally:
        for stream in streams:
            await stream.close()
        for client in holders:
            await client.close()


async def test_openai_errors_400_404_503(gateway: Gateway) -> None:
    client = gateway.client()
    with pytest.raises(openai.NotFoundError) as nf:
        await client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert nf.value.status_code == 404
    assert nf.value.code == "model_not_found"
    bad = urllib.request.Request(
        f"{gateway.url}/v1/chat/completions",
        data=b'{"model": "food-review", "messages": [',
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        await asyncio.to_thread(urllib.request.urlopen, bad, timeout=5)
    assert raw.value.code == 400
    assert raw.value.headers["content-type"] == "application/json"
    assert json.loads(raw.value.read())["error"]["type"] == "invalid_request_error"
    raw.value.close()
    with pytest.raises(openai.BadRequestError):
        await client.post("/chat/completions", body={"messages": []}, cast_to=object)
    with pytest.raises(openai.InternalServerError) as unavailable:
        await client.chat.completions.create(
            model="ghost", messages=[{"role": "user", "content": "x"}]
        )
    assert unavailable.value.status_code == 503
    body = unavailable.value.body
    assert isinstance(body, dict)
    assert body["type"] == "service_unavailable_error"


async def test_sheddable_waits_then_429_when_pool_saturated_critical_does_not(
    gateway: Gateway,
) -> None:
    """Flow control (default): on a saturated pool a Sheddable request waits in the EPP's queue
    and, as the server never frees up, is answered 429 queue_timeout (llm-d-router's
    `x-llm-d-request-dropped-reason: rejected-ttl-expired`) at its 1.5 s TTL: fast,
    never left to a client timeout. Critical requests are never held."""
    client = gateway.client()
    # Long Critical streams on a one-slot server: one runs, the others wait on the server.
    streams = []
    for _ in range(7):
        streams.append(
            await client.completions.create(
                model="tiny-critical", prompt="long story", max_tokens=4000, stream=True
            )
        )
    try:
        # Probe only once the gateway's scrapes show the waiting streams: a Sheddable request
        # sent before that is dispatched, and waits behind 4,000-token streams past the
        # client's timeout (seen on a loaded machine).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            queued = await asyncio.to_thread(
                _pool_gauge, gateway, "tiny", "inference_pool_average_queue_size"
            )
            if queued >= len(streams) - 1:
                break
            await asyncio.sleep(0.05)
        expired = None
        deadline = time.monotonic() + 60  # until the gateway has seen the saturation
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                await client.completions.create(model="tiny-batch", prompt="x", max_tokens=1)
            except openai.RateLimitError as exc:
                expired, waited = exc, time.monotonic() - started
                break
            await asyncio.sleep(0.1)
        assert expired is not None, "the saturated pool never held the Sheddable request"
        assert expired.status_code == 429
        assert expired.response.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
        assert isinstance(expired.body, dict)
        assert expired.body["code"] == "queue_timeout"
        # Held for its TTL (1.5 s), and answered by the EPP, not left to the client's timeout
        # (that would be an APITimeoutError). How soon after the TTL is wall-clock speed: the
        # TTL's timing is tested on injected clocks (test_fc_dispatcher, test_rc_flowgate).
        assert waited > 1.4
        # Critical is still sent while saturated (it queues on the server).
        extra = await client.completions.create(
            model="tiny-critical", prompt="x", max_tokens=1, stream=True
        )
        await extra.close()
    finally:
        for s in streams:
            await s.close()


async def test_spoofed_destination_header_is_ignored(gateway: Gateway) -> None:
    from tests.envoy.envoy_harness import Canary

    canary = Canary()
    await canary.start()
    try:
        client = gateway.client(default_headers={DEST: f"127.0.0.1:{canary.port}"})
        for _ in range(3):
            r = await client.chat.completions.with_raw_response.create(
                model=BASE, messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
            assert int(r.headers[SERVED].rpartition(":")[2]) in gateway.fleet.ports
        assert canary.connections == 0
    finally:
        await canary.stop()


def _small_gateway(
    fleet: Fleet, directory: Path, failure_mode: str, spec: str = ""
) -> tuple[Proc, dict[str, int]]:
    """`spec`: more lines of the GatewayConfig's spec (indented by two spaces)."""
    ports = gateway_ports()
    docs = [
        gateway_doc(ports, [(f"sim-{i}", p, "sim") for i, p in enumerate(fleet.ports)]) + spec,
        POOL.format(name="fleet", app="sim", failure_mode=failure_mode),
        model_doc(BASE, "fleet", "Critical"),
    ]
    write_config(directory, docs)
    return _serve(directory, ports), ports


async def test_a_killed_serve_cuts_its_streams_as_errors_and_takes_envoy_with_it(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Envoy dies with `serve` (envoy/tether.py: no orphan keeps the ports), so a SIGKILL of
    `serve` ends the streams in flight, even under FailOpen with the response observer; the
    client sees an error, never a clean end, and the next connection is refused. What a dead
    EPP leaves to an Envoy that outlives it (FailOpen serving, streams finishing through the
    observer) needs an EPP outside Envoy's process tree: `tests/envoy/test_envoy_gateway.py::
    test_epp_killed_while_running`, `tests/envoy/test_envoy_observer.py`."""
    proc, ports = _small_gateway(fleet, tmp_path, "FailOpen")
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="x", max_retries=0, timeout=30
    )
    chunks: list[Any] = []
    with killing_orphans(proc):
        try:
            stream = await client.chat.completions.create(
                model=BASE, messages=[{"role": "user", "content": "a long story"}],
                max_tokens=1500, stream=True,
            )  # fmt: skip

            async def read() -> None:
                async for chunk in stream:
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        proc.stop(signal.SIGKILL)  # serve dies, and Envoy with it

            # A body cut short: an openai error, or the transport's own (httpx's or httpx2's).
            with pytest.raises(Exception) as cut:  # noqa: PT011
                await read()
            assert type(cut.value).__module__.split(".")[0] in {"openai", "httpx", "httpx2"}
        finally:
            await client.close()

        def refused() -> bool:  # nothing listens: no orphaned Envoy serves on unmanaged
            with socket.socket() as s:
                s.settimeout(5)
                return s.connect_ex(("127.0.0.1", ports["http"])) != 0

        await until(refused, "the gateway's port closed once serve was killed")
    assert not any(c.choices and c.choices[0].finish_reason for c in chunks)


async def test_sigterm_drains_an_inflight_stream(fleet: Fleet, tmp_path: Path) -> None:
    ports = gateway_ports()
    docs = [
        gateway_doc(ports, [("tiny-0", fleet.tiny_port, "tiny")]),
        POOL.format(name="tiny", app="tiny", failure_mode="FailClose"),
        model_doc("tiny-base", "tiny", "Critical"),
    ]
    write_config(tmp_path, docs)
    proc = _serve(tmp_path, ports)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="x", max_retries=0, timeout=30
    )
    try:
        stream = await client.completions.create(
            model="tiny-base", prompt="a story", max_tokens=40, stream=True
        )
        chunks = [await anext(aiter(stream))]
        proc.process.send_signal(signal.SIGTERM)  # drain starts while the stream is running
        chunks += [c async for c in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        # Every token arrived (counted in the text: a loaded machine may merge steps into
        # fewer events, so the number of events says nothing about a cut).
        assert count_tokens("".join(c.choices[0].text for c in chunks if c.choices)) == 40
        # The drain waited for the stream: nothing was cut, and the process exits cleanly.
        returncode = await asyncio.to_thread(proc.process.wait, STARTUP_S)
        assert returncode == 0, proc.log_text()[-2000:]
    finally:
        await client.close()
        proc.stop()
