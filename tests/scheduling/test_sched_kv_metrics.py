"""The KV-event path on /metrics: a real subscriber fed real ZMQ messages on 127.0.0.1, wired
from a config as the runtime wires it, and the metrics page scraped over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.datastore.endpoint import EndpointMetrics
from poolkeeper.kvevents import BlockRemoved, BlockStored, KVEventBatch, encode, engine_block_hashes
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.interfaces import CycleState
from poolkeeper.scheduling.kvsubscriber import KVEventSubscriber
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.presets import preset_document
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.telemetry.metrics import GatewayMetrics
from tests.server.test_server_kv_events_clock import FAR, _wired
from tests.support.kvpub import Publisher
from tests.support.waiting import until

pytestmark = pytest.mark.integration

ENDPOINT = "127.0.0.1:8000"  # the wired pool's one endpoint
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def _scrape(metrics: GatewayMetrics) -> Samples:
    """The /metrics page over HTTP, as Prometheus reads it."""
    async with TestClient(TestServer(metrics.app(), host="127.0.0.1")) as client:
        response = await client.get("/metrics")
        assert response.status == 200
        text = await response.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _kv(samples: Samples) -> Iterator[tuple[str, dict[str, str]]]:
    for name, labels in samples:
        if name.startswith(("llm_d_epp_kv_cache_", "poolkeeper_kv_")):
            yield name, dict(labels)


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_what_the_subscriber_and_its_index_counted_is_on_the_scraped_page(
    thread: bool,
) -> None:
    (port,) = free_ports(1)
    store, clock, scheduler = _wired(
        preset_document("default"),
        port,
        kvEventsStaleAfterS=5,
        kvIndexMaxBlocksPerEndpoint=4,
        kvEventsReceiveThread=thread,
    )
    (prefix,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    subscriber, exact = prefix.subscriber, prefix.exact
    assert subscriber is not None
    assert exact is not None
    metrics = GatewayMetrics(scheduling=scheduler.stats)  # as the runtime builds it
    one = {"plugin_name": prefix.typed_name.name}
    at = {**one, "pod_identifier": ENDPOINT}

    def s(samples: Samples, name: str, **labels: str) -> float:
        return samples[(name, frozenset({**at, **labels}.items()))]

    def p(samples: Samples, name: str, **labels: str) -> float:
        return samples[(name, frozenset({**one, **labels}.items()))]

    prompt = "".join(f"{i:04d}" for i in range(48))  # 192 characters: 3 blocks of 16 tokens
    blocks = engine_block_hashes("m", prompt, 16)
    pub = Publisher(port)
    try:
        before = await _scrape(metrics)
        assert p(before, "llm_d_epp_kv_cache_events_active_subscribers") == 0
        store.update_metrics(ENDPOINT, EndpointMetrics(updated_at=FAR))  # on the loop: follow
        hello = encode(KVEventBatch(0.0, [BlockStored([1, 2], None)]))
        seq = await pub.until_applied(subscriber, hello)  # each 2 blocks
        # An undecodable payload, a message of two frames, then a batch after a skipped number.
        await pub.send(seq + 1, b"\xc1 not msgpack")
        await pub.pub.send_multipart([b"kv", b"short"])
        batch = KVEventBatch(
            0.0,
            [
                BlockStored([10, 11, 12, 13, 14, 15], None),  # the bound (4) drops 14 and 15
                BlockStored([20], 999),  # continues a block not held: refused
                BlockRemoved([10, 11, 12]),  # the engine's own removals: 3, the bound's 2
                BlockStored(blocks[:2], None),  # 2 of the prompt's 3 blocks
            ],
        )
        await pub.send(seq + 3, encode(batch))
        await until(lambda: exact.match(blocks), "the last batch applied")
        # Counted now: a batch sent during the join may have arrived after `until_applied`
        # returned (it went before the others on the socket: no gap).
        joined = subscriber.received - 1
        prefix.matched(CycleState(clock.now), LLMRequest("r", "m", "m", prompt=prompt))

        page = await _scrape(metrics)
        assert s(page, "llm_d_epp_kv_cache_events_messages_received_total") == joined + 3
        assert s(page, "poolkeeper_kv_events_batches_applied_total") == joined + 1
        assert s(page, "poolkeeper_kv_events_decode_errors_total", reason="payload") == 1
        assert s(page, "poolkeeper_kv_events_decode_errors_total", reason="frames") == 1
        assert s(page, "poolkeeper_kv_events_decode_errors_total", reason="bounds") == 0
        assert s(page, "poolkeeper_kv_events_sequence_gaps_total") == 1
        assert s(page, "llm_d_epp_kv_cache_events_zmq_errors_total", operation="connect") == 0
        assert s(page, "poolkeeper_kv_index_blocks") == 3  # 13 and the prompt's 2
        assert p(page, "llm_d_epp_kv_cache_index_admissions_total") == 2 * joined + 6 + 2
        assert p(page, "llm_d_epp_kv_cache_index_evictions_total") == 3
        assert p(page, "poolkeeper_kv_index_bound_evictions_total") == 2
        assert p(page, "poolkeeper_kv_index_unanchored_blocks_total") == 1
        assert p(page, "poolkeeper_kv_index_max_blocks_per_endpoint") == 4
        assert p(page, "llm_d_epp_kv_cache_index_lookup_requests_total") == 1
        assert p(page, "poolkeeper_kv_index_lookup_blocks_total") == 3
        assert p(page, "llm_d_epp_kv_cache_index_lookup_hits_total") == 2
        assert p(page, "llm_d_epp_kv_cache_index_max_pod_hit_count_total") == 2
        assert p(page, "llm_d_epp_kv_cache_events_active_subscribers") == 1
        assert p(page, "llm_d_epp_kv_cache_events_pool_queue_depth") == 0
        # The gap and the bad payload put the endpoint on the fallback for 5 s of the
        # decisions' clock; then its exact view is used again.
        assert s(page, "poolkeeper_kv_events_exact_view") == 0
        assert p(page, "poolkeeper_kv_events_fallback_endpoints", reason="lost") == 1
        assert p(page, "poolkeeper_kv_events_fallback_endpoints", reason="no_events") == 0
        clock.now = FAR + 5.0
        later = await _scrape(metrics)
        assert s(later, "poolkeeper_kv_events_exact_view") == 1
        assert p(later, "poolkeeper_kv_events_fallback_endpoints", reason="lost") == 0
    finally:
        await subscriber.close()
        pub.close()


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_a_refused_address_is_counted_as_a_connect_error(thread: bool) -> None:
    subscriber = KVEventSubscriber(
        ExactPrefixIndex(), lambda hp: "tcp://no such host:x", thread=thread
    )
    stats = SchedulingStats()
    stats.add_kv_events("kv", subscriber.reading)
    metrics = GatewayMetrics(scheduling=stats)
    subscriber.follow(["bad:1"])
    try:
        await until(lambda: subscriber.reading().endpoints[0].feed.connect_errors, "refused")
        page = await _scrape(metrics)
        labels = {"plugin_name": "kv", "pod_identifier": "bad:1", "operation": "connect"}
        key = ("llm_d_epp_kv_cache_events_zmq_errors_total", frozenset(labels.items()))
        assert page[key] == 1
        no_events = {"plugin_name": "kv", "reason": "no_events"}
        key = ("poolkeeper_kv_events_fallback_endpoints", frozenset(no_events.items()))
        assert page[key] == 1
    finally:
        await asyncio.wait_for(subscriber.close(), timeout=10)


async def test_the_labels_are_the_configured_plugins_and_followed_endpoints_only() -> None:
    """Topics, sequence numbers and payloads come from whoever publishes: none of it becomes a
    label; endpoints that leave the pool leave the page."""
    port, silent = free_ports(2)
    followed = ["127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002"]
    subscriber = KVEventSubscriber(
        ExactPrefixIndex(),
        lambda hp: f"tcp://127.0.0.1:{port if hp == followed[0] else silent}",
    )
    stats = SchedulingStats()
    stats.add_kv_events("kv", subscriber.reading)
    metrics = GatewayMetrics(scheduling=stats)
    subscriber.follow(followed)
    pub = Publisher(port)
    try:
        await pub.until_applied(subscriber, encode(KVEventBatch(0.0, [BlockStored([1], None)])))
        delivered = subscriber.delivered
        for n in range(20):  # numbers with gaps, undecodable payloads, topics of their own
            await pub.send(1_000 + 7 * n, b"\x92\xc1", topic=f"topic-{n}".encode())
        await until(lambda: subscriber.delivered == delivered + 20, "every message delivered")
        page = await _scrape(metrics)
        assert len({name for name, _ in _kv(page)}) == 20  # the families, whatever was sent
        values = {k: {labels[k] for _, labels in _kv(page) if k in labels} for k in _LABELS}
        assert values == {
            "plugin_name": {"kv"},
            "pod_identifier": set(followed),
            "reason": {"frames", "payload", "bounds", "no_events", "lost", "silent"},
            "operation": {"connect"},
        }
        assert all(set(labels) <= set(_LABELS) for _, labels in _kv(page))
        subscriber.forget({followed[0]})
        page = await _scrape(metrics)
        assert {labels.get("pod_identifier") for _, labels in _kv(page)} == {None, followed[0]}
    finally:
        await subscriber.close()
        pub.close()


_LABELS = ("plugin_name", "pod_identifier", "reason", "operation")


async def test_the_queue_depth_counts_what_the_thread_handed_over_and_the_loop_has_not_taken() -> (
    None
):
    """The receive thread's `handed` less the loop's deliveries, also across an endpoint that
    left the pool (its messages, and one still on its way after it left, stay delivered)."""
    silent = free_ports(2)
    followed = [f"127.0.0.1:{p}" for p in silent]  # nothing publishes there
    subscriber = KVEventSubscriber(ExactPrefixIndex(), lambda hp: f"tcp://{hp}", thread=True)
    subscriber.follow(followed)
    receiver = subscriber._receiver
    assert receiver is not None

    def frames(seq: int) -> list[bytes]:
        batch = encode(KVEventBatch(0.0, [BlockStored([seq + 1], None)]))
        return [b"kv", seq.to_bytes(8, "big"), batch]

    try:
        receiver.handed += 3  # as the thread counts: before the loop takes them
        subscriber._on_frames(followed[0], frames(0), 0.0)
        subscriber._on_frames(followed[0], frames(1), 0.0)
        assert (subscriber.delivered, subscriber.reading().queued) == (2, 1)
        subscriber.forget({followed[1]})
        assert (subscriber.delivered, subscriber.reading().queued) == (2, 1)
        subscriber._on_frames(followed[0], frames(2), 0.0)  # on its way when it left
        assert (subscriber.delivered, subscriber.reading().queued) == (3, 0)
    finally:
        await asyncio.wait_for(subscriber.close(), timeout=10)
