"""A live simulated server publishes its KV-cache events over ZMQ as vLLM does, and the EPP's
subscriber turns them into an exact prefix index (real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.kvsubscriber import KVEventSubscriber, events_address
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.sim.params import DEFAULT_MODEL

pytestmark = pytest.mark.integration


def test_events_address() -> None:
    assert events_address("10.0.0.1:8000", port=5557, port_offset=None) == "tcp://10.0.0.1:5557"
    assert events_address("10.0.0.1:8000", port=5557, port_offset=100) == "tcp://10.0.0.1:8100"
    assert events_address("fd00::1:8000", port=5557, port_offset=None) == "tcp://[fd00::1]:5557"


async def _sim_and_subscriber(
    thread: bool = False,
) -> tuple[SimCluster, str, ExactPrefixIndex, KVEventSubscriber]:
    """One simulated server publishing KV events, and a subscriber following it."""
    http_port, events_port = free_ports(2)
    specs = build_fleet(count=1, cli=ServerSettings.model_validate({}))
    cluster = SimCluster(specs, base_port=http_port, kv_events_port_offset=events_port - http_port)
    await cluster.start()
    index = ExactPrefixIndex()
    subscriber = KVEventSubscriber(
        index,
        lambda hp: events_address(hp, port=0, port_offset=events_port - http_port),
        thread=thread,
    )
    return cluster, f"127.0.0.1:{http_port}", index, subscriber


async def _reported(index: ExactPrefixIndex, hashes: list[int]) -> bool:
    """Whether the index holds any of `hashes` within 0.2 s."""
    for _ in range(20):
        if index.match(hashes):
            return True
        await asyncio.sleep(0.01)
    return False


async def _sent_until_reported(endpoint: str, index: ExactPrefixIndex, repeat: int = 16) -> str:
    """Send one-token completions of new prompts (`repeat` x 4 characters) to `endpoint`
    until the index holds one's blocks (a SUB socket misses what is sent before it has
    connected: ZMQ's slow joiner); the prompt that got there."""
    async with aiohttp.ClientSession() as http:
        for attempt in range(200):
            prompt = f"{attempt:04d}" * repeat
            body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1}
            async with http.post(f"http://{endpoint}/v1/completions", json=body) as r:
                assert r.status == 200
            if await _reported(index, engine_block_hashes(DEFAULT_MODEL, prompt, 16)):
                return prompt
    pytest.fail(f"no KV event from {endpoint}")


async def test_served_prompts_reach_the_exact_index_through_zmq() -> None:
    cluster, endpoint, index, subscriber = await _sim_and_subscriber()
    subscriber.follow([endpoint])
    try:
        async with aiohttp.ClientSession() as http:
            # A PUB socket drops what it sends before the subscription is in place (ZMQ's slow
            # joiner): send distinct prompts until one is reported, within a generous bound.
            for attempt in range(200):
                prompt = f"{attempt:04d}" * 64  # 256 characters = 4 blocks of 16 tokens
                body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1}
                async with http.post(f"http://{endpoint}/v1/completions", json=body) as r:
                    assert r.status == 200
                hashes = engine_block_hashes(DEFAULT_MODEL, prompt, 16)
                if await _reported(index, hashes):
                    break
            assert index.match(hashes) == {endpoint: 4}
            assert subscriber.received >= 1
            assert index.fresh(endpoint, time.monotonic())
    finally:
        await subscriber.close()
        await cluster.stop()


async def test_the_epp_subscribes_when_it_learns_the_endpoints_not_at_a_first_decision() -> None:
    """An engine reports a block once; a subscription made at the first decision would miss
    every block stored before it. Wired from a config, the scorer follows the pool's endpoints
    from the first metrics write: what the engine stores before any decision is indexed."""
    from poolkeeper.api.pool import InferencePool
    from poolkeeper.config.gateway import GatewayConfig
    from poolkeeper.datastore.endpoint import EndpointMetrics
    from poolkeeper.datastore.snapshot import EndpointSpec
    from poolkeeper.datastore.store import Datastore
    from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
    from poolkeeper.scheduling.presets import preset_document
    from poolkeeper.scheduling.scheduler import Scheduler
    from poolkeeper.server.wiring import build_director

    http_port, events_port = free_ports(2)
    specs = build_fleet(count=1, cli=ServerSettings.model_validate({}))
    cluster = SimCluster(specs, base_port=http_port, kv_events_port_offset=events_port - http_port)
    await cluster.start()
    endpoint = f"127.0.0.1:{http_port}"
    doc = preset_document("default")
    for p in doc["plugins"]:
        if p["type"] == "prefix-cache-scorer":
            p["parameters"].update(kvEvents=True, kvEventsPortOffset=events_port - http_port)
    config = GatewayConfig.model_validate({"spec": {"scheduling": doc}})
    store = Datastore()
    pool = {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
            "metadata": {"name": "pool"}, "spec": {"selector": {"app": "sim"},
            "targetPortNumber": http_port, "extensionRef": {"name": "epp"}}}  # fmt: skip
    store.set_resources([InferencePool.model_validate(pool)], [])
    store.set_endpoints([EndpointSpec("sim-0", "127.0.0.1", labels={"app": "sim"})])
    scheduler = build_director(config, store, rng=random.Random(1)).scheduler
    assert isinstance(scheduler, Scheduler)
    (scorer,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    exact = scorer.exact
    assert exact is not None
    # Written before the loop ran anything: nothing followed yet; the first scrape on the loop.
    store.update_metrics(endpoint, EndpointMetrics(updated_at=time.monotonic()))
    try:
        prompt = await _sent_until_reported(endpoint, exact, repeat=64)
        assert exact.match(engine_block_hashes(DEFAULT_MODEL, prompt, 16)) == {endpoint: 4}
    finally:
        subscriber = scorer._subscriber
        if subscriber is not None:
            await subscriber.close()
        await cluster.stop()


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_answers_blocks_reach_the_index_in_per_step_batches_seen_by_on_batch(
    thread: bool,
) -> None:
    """The engine's output blocks are published as they fill (the answer's text continues
    the prompt's chain), and the subscriber's `on_batch` hears of every batch with its
    engine stamp and receipt time, whether the sockets are read on the loop or a thread."""
    cluster, endpoint, index, subscriber = await _sim_and_subscriber(thread)
    seen: list[tuple[str, float, float]] = []
    subscriber.on_batch = lambda e, ts, at: seen.append((e, ts, at))
    subscriber.follow([endpoint])
    try:
        async with aiohttp.ClientSession() as http:
            for attempt in range(200):  # until the SUB socket is connected (slow joiner)
                prompt = f"{attempt:04d}" * 16  # one block
                body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 50}
                async with http.post(f"http://{endpoint}/v1/completions", json=body) as r:
                    assert r.status == 200
                    text = (await r.json())["choices"][0]["text"]
                # 16 + 50 tokens, 65 computed: blocks 2-4 are the answer's.
                hashes = engine_block_hashes(DEFAULT_MODEL, prompt + text, 16)
                if await _reported(index, hashes):
                    break
            assert len(hashes) == 4
            assert index.match(hashes) == {endpoint: 4}
    finally:
        await subscriber.close()
        await cluster.stop()
    assert len(seen) == subscriber.received >= 2  # the prefill's batch, then decode steps'
    assert {e for e, _, _ in seen} == {endpoint}
    assert all(ts <= at for _, ts, at in seen)  # stamped by the engine before it was sent


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_an_endpoint_with_a_bad_address_loses_only_its_own_events(thread: bool) -> None:
    """A ZMQ address the socket refuses (a bad host name from a hand-written endpoint) loses
    that endpoint's events, not the others' (the receiving thread died of it), and `close`
    still returns (a socket left open by the failed connect blocked the context's term)."""
    cluster, endpoint, index, subscriber = await _sim_and_subscriber(thread)
    good = subscriber._address(endpoint)
    subscriber._address = lambda hp: good if hp == endpoint else "tcp://no such host:x"
    subscriber.follow(["bad:1"])
    await asyncio.sleep(0.1)  # the bad one is tried first
    subscriber.follow([endpoint])
    try:
        await _sent_until_reported(endpoint, index)  # the good endpoint's events arrive
    finally:
        await asyncio.wait_for(subscriber.close(), timeout=10)
        await cluster.stop()
