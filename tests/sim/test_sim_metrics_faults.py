"""/metrics parsed with prometheus-client moves with load; fault injection by header and config."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.sim.cluster import Listening, SimCluster
from poolkeeper.sim.params import DEFAULT_MODEL
from tests.support.waiting import until

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
StartCluster = Callable[..., Awaitable[tuple[SimCluster, list[Listening]]]]


async def scrape(http: aiohttp.ClientSession, url: str) -> Samples:
    async with http.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/plain")
        text = await response.text()
    values: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


async def complete(http: aiohttp.ClientSession, url: str, model: str, prompt: str, n: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": n}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        await response.read()
        return response.status


async def test_metrics_move_with_load(sim_cluster: StartCluster) -> None:
    cluster, (where,) = await sim_cluster(1, max_num_seqs=2, lora_adapters=["a"], max_loras=1)
    async with aiohttp.ClientSession() as http:
        idle = await scrape(http, where.url)
        assert idle[("vllm:num_requests_running", ())] == 0
        assert idle[("vllm:kv_cache_usage_perc", ())] == 0
        config = next(k for k in idle if k[0] == "vllm:cache_config_info")
        assert dict(config[1])["num_gpu_blocks"] == "28000"
        assert dict(config[1])["block_size"] == "16"
        shared = "The same long system prompt for every request. " * 20
        # The engine's clock is the wall clock: on a loaded machine the first request could end
        # before the sixth arrives. Hold arrivals, hand all six over at one instant, and freeze
        # the steps while /metrics is read, so what the test sees does not depend on speed.
        cluster.driver.hold()
        driver = cluster.driver
        jobs = []
        for i in range(6):  # the adapter's request first: the engine admits in arrival order
            model = "a" if i == 0 else DEFAULT_MODEL
            jobs.append(
                asyncio.create_task(complete(http, where.url, model, shared + f"q{i}", 150))
            )
            await until(lambda: driver.held_count() >= 1, "the adapter's request arrives")
        await until(lambda: driver.held_count() == 6, "all six requests arrive")
        driver.release()
        try:
            busy = await scrape(http, where.url)
        finally:
            driver.resume()
        assert busy[("vllm:num_requests_running", ())] == 2
        assert busy[("vllm:num_requests_waiting", ())] == 4
        assert busy[("vllm:gpu_cache_usage_perc", ())] > 0
        assert busy[("vllm:kv_cache_usage_perc", ())] == busy[("vllm:gpu_cache_usage_perc", ())]
        lora = [(dict(k[1]), v) for k, v in busy.items() if k[0] == "vllm:lora_requests_info"]
        newest = max(lora, key=lambda item: item[1])[0]
        assert newest == {"max_lora": "1", "running_lora_adapters": "a",
                          "waiting_lora_adapters": ""}  # fmt: skip
        assert await asyncio.gather(*jobs) == [200] * 6
        done = await scrape(http, where.url)
    assert done[("vllm:num_requests_running", ())] == 0
    assert done[("vllm:num_requests_waiting", ())] == 0
    assert done[("vllm:request_success_total", (("finished_reason", "length"),))] == 6
    assert done[("vllm:generation_tokens_total", ())] == 6 * 150
    assert done[("vllm:time_to_first_token_seconds_count", ())] == 6
    assert done[("vllm:e2e_request_latency_seconds_count", ())] == 6
    assert done[("vllm:inter_token_latency_seconds_count", ())] == 6 * 149
    assert done[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 6
    # Requests 1..5 share the base model's prefix; request 0 used the adapter's own cache.
    assert done[("vllm:prefix_cache_hits_total", ())] > 0
    assert (
        done[("vllm:prefix_cache_queries_total", ())] > done[("vllm:prefix_cache_hits_total", ())]
    )
    # Queued requests waited: the slowest time to first token is far above one step.
    assert done[("vllm:time_to_first_token_seconds_sum", ())] > 1.0


def api(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=20)


HEADER_FAULTS = {"faults": {"header_faults": True}}  # as `poolkeeper sim --fault-headers`


async def test_fault_header_is_ignored_unless_the_server_was_told_to_obey_it(
    sim_cluster: StartCluster,
) -> None:
    """A client of a gateway must not be able to make a server fail (round 2, finding 6)."""
    _, (where,) = await sim_cluster(1)
    async with api(where.url) as client:
        reply = await client.completions.create(
            model=DEFAULT_MODEL, prompt="x", max_tokens=1,
            extra_headers={"x-sim-fault": "status=503"},
        )  # fmt: skip
        assert reply.choices


async def test_fault_header_status_latency_and_bad_spec(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, **HEADER_FAULTS)
    async with api(where.url) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(
                model=DEFAULT_MODEL, prompt="x", max_tokens=1,
                extra_headers={"x-sim-fault": "status=503"},
            )  # fmt: skip
        assert info.value.status_code == 503
        started = time.monotonic()
        await client.completions.create(
            model=DEFAULT_MODEL,
            prompt="x",
            max_tokens=1,
            extra_headers={"x-sim-fault": "latency=0.4"},
        )
        assert time.monotonic() - started >= 0.4
        with pytest.raises(openai.BadRequestError, match="unknown fault 'explode'"):
            await client.completions.create(
                model=DEFAULT_MODEL,
                prompt="x",
                max_tokens=1,
                extra_headers={"x-sim-fault": "explode=1"},
            )


async def test_stall_before_first_byte_and_cut_stream(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, **HEADER_FAULTS)
    body = {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 20, "stream": True}
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.post(f"{where.url}/v1/completions", json=body,
                             headers={"x-sim-fault": "stall=0.4"}) as response:  # fmt: skip
            first = await response.content.readline()
            assert time.monotonic() - started >= 0.4
            assert first.startswith(b"data: ")
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
        events: list[bytes] = []

        async def read_events() -> None:
            async with http.post(f"{where.url}/v1/completions", json=body,
                                 headers={"x-sim-fault": "cut-after=3"}) as response:  # fmt: skip
                async for line in response.content:
                    if line.startswith(b"data: "):
                        events.append(line)

        with pytest.raises(aiohttp.ClientPayloadError):
            await read_events()
        assert len(events) == 3
        assert not any(b"[DONE]" in e for e in events)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await http.post(f"{where.url}/v1/completions", json={**body, "stream": False},
                            headers={"x-sim-fault": "cut-after=0"})  # fmt: skip


async def test_metrics_faults_and_standing_faults(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, **HEADER_FAULTS)
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"{where.url}/metrics", headers={"x-sim-fault": "metrics=garbage"}
        ) as r:
            text = await r.text()
        with pytest.raises(ValueError):  # noqa: PT011 - the parser's own error type
            list(text_string_to_metric_families(text))
        settings = {
            "metrics": "slow",
            "metrics_delay_s": 0.4,
            "error_rate": 1.0,
            "error_status": 429,
        }
        async with http.post(f"{where.url}/sim/faults", json=settings) as response:
            assert response.status == 200
        started = time.monotonic()
        await scrape(http, where.url)
        assert time.monotonic() - started >= 0.4
        statuses = [await complete(http, where.url, DEFAULT_MODEL, "x", 1) for _ in range(3)]
        assert statuses == [429, 429, 429]
        async with http.post(f"{where.url}/sim/faults", json={"error_rate": 2}) as response:
            assert response.status == 400
        async with http.post(f"{where.url}/sim/faults", json={}) as response:
            assert response.status == 200
        assert await complete(http, where.url, DEFAULT_MODEL, "x", 1) == 200
