"""Reopening a KV-event subscription that went quiet: real ZMQ on 127.0.0.1, on the loop and on
the receive thread. libzmq drops the connection after a message past MAXMSGSIZE and does not
reconnect; once the endpoint is routed to and stays unanswered for stale_after_s (the
decisions' clock, moved by the test), the subscriber closes and reopens its socket, with a
back-off, and valid batches apply again (docs/notes/2026-12-08-kv-event-bounds.md)."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest
import zmq

from poolkeeper.kvevents import MAX_MESSAGE_BYTES, BlockStored, KVEventBatch, encode
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling import kvsubscriber
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.kvsubscriber import REOPEN_MAX_S, KVEventSubscriber
from poolkeeper.telemetry.kv_collector import kv_event_families
from tests.support.kvpub import ENDPOINT, joined
from tests.support.waiting import until

pytestmark = pytest.mark.integration

STALE_S = 5.0
AFTER = encode(KVEventBatch(0.0, [BlockStored([77], None)]))
NEXT = encode(KVEventBatch(0.0, [BlockStored([78], 77)]))


class Clock:
    """The decisions' clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_after_an_oversize_message_the_silent_endpoint_is_reopened_and_applies_again(
    thread: bool,
) -> None:
    big = msgpack.packb([0.0, [["BlockRemoved", [], "x" * 4000]] * 4200, None])
    assert len(big) > MAX_MESSAGE_BYTES
    clock = Clock()
    async with joined(thread, clock=clock, stale_after_s=STALE_S) as feed:
        subscriber, index = feed.subscriber, feed.subscriber.index
        fds = _open_fds()  # the endpoint's socket and its connection, the publisher's
        monitor = feed.pub.pub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            await feed.pub.send(feed.seq + 1, big)
            await asyncio.wait_for(monitor.recv_multipart(), timeout=30)  # ZMQ dropped it
        finally:
            feed.pub.pub.disable_monitor()
            monitor.close(linger=0)
        index.routed(ENDPOINT, clock.now)
        clock.now += STALE_S - 0.001
        assert subscriber.reopen_unanswered() == []  # routed to, not yet unanswered
        assert feed.row().staleness is None
        clock.now += 0.001
        assert feed.row().staleness == "silent"
        await until(lambda: feed.row().feed.reconnections == 1, "the watcher reopened it")
        row = feed.row()
        assert row.staleness == "silent"  # kept, unused, until the sequence says what was lost
        assert index.match([1]) == {ENDPOINT: 1}
        # The publisher numbers on (the oversize message took a number): the reopened
        # subscription's first message is a gap, and only that drops what it held.
        seq = await feed.pub.until_applied(subscriber, AFTER, first_seq=feed.seq + 10)
        await feed.pub.send(seq + 1, NEXT)
        await until(lambda: index.match([77, 78]) == {ENDPOINT: 2}, "the next batch applied")
        row = feed.row()
        assert row.feed.gaps == 1
        assert row.staleness == "lost"
        assert not index.match([1])
        assert row.feed.reconnections == 1  # answered: not reopened again
        assert subscriber.reopen_unanswered() == []
        # One socket and one connection for the endpoint again, as before the drop (the old
        # socket closed; ZMQ releases its descriptor on its own thread, hence the wait).
        await until(lambda: _open_fds() == fds, "the old socket's descriptors released")


async def test_reopening_backs_off_and_leaves_answered_idle_and_refused_endpoints_alone() -> None:
    """No publisher at all: the endpoint is routed to and never answers."""
    (port,) = free_ports(1)
    clock = Clock()
    index = ExactPrefixIndex(stale_after_s=STALE_S)
    addresses = {ENDPOINT: f"tcp://127.0.0.1:{port}", "127.0.0.1:1": "tcp://nowhere"}
    subscriber = KVEventSubscriber(index, addresses.__getitem__, clock=clock)
    try:
        subscriber.follow([ENDPOINT, "127.0.0.1:1"])
        await until(lambda: subscriber.reading().endpoints[1].feed.connect_errors, "refused")
        clock.now = 1_000.0
        assert subscriber.reopen_unanswered() == []  # idle (never routed to): left alone
        index.routed(ENDPOINT, clock.now)
        index.routed("127.0.0.1:1", clock.now)  # refused: a new socket would be refused too
        reopened_at = []
        while clock.now < 1_400.0:
            clock.now += 0.5
            if subscriber.reopen_unanswered():
                reopened_at.append(clock.now - 1_000.0)
        # After STALE_S, then waits of STALE_S doubling to REOPEN_MAX_S.
        assert REOPEN_MAX_S == 60.0
        assert reopened_at == [5.0, 10.0, 20.0, 40.0, 80.0, 140.0, 200.0, 260.0, 320.0, 380.0]
        first = subscriber._tasks[ENDPOINT]
        index.heard(ENDPOINT, clock.now)  # a batch: answered, the back-off starts over
        assert subscriber.reopen_unanswered() == []
        index.routed(ENDPOINT, clock.now)
        clock.now += STALE_S
        assert subscriber.reopen_unanswered() == [ENDPOINT]
        (row, refused) = subscriber.reading().endpoints
        assert row.feed.reconnections == 11
        assert refused.feed.reconnections == 0
        page = {
            (sample.name, sample.labels["pod_identifier"]): sample.value
            for family in kv_event_families([("kv", subscriber.reading())])
            for sample in family.samples
            if family.name.endswith("reconnections")
        }
        assert page == {
            ("llm_d_epp_kv_cache_events_subscriber_reconnections_total", ENDPOINT): 11,
            ("llm_d_epp_kv_cache_events_subscriber_reconnections_total", "127.0.0.1:1"): 0,
        }
        await until(first.done, "the replaced task ended")
        assert first.cancelled()
        assert not subscriber._tasks[ENDPOINT].done()
    finally:
        await asyncio.wait_for(subscriber.close(), timeout=10)


async def test_a_failing_scan_does_not_end_the_watcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher logs a scan that raised and scans again (it used to end for good, silently:
    its exception was only collected by `close`)."""
    monkeypatch.setattr(kvsubscriber, "WATCH_S", 0.01)
    subscriber = KVEventSubscriber(ExactPrefixIndex(), lambda hp: "tcp://127.0.0.1:1")
    scans: list[int] = []

    def scan(self: KVEventSubscriber) -> list[str]:
        scans.append(len(scans))
        if len(scans) == 1:
            raise ValueError("a malformed endpoint")
        return []

    monkeypatch.setattr(KVEventSubscriber, "reopen_unanswered", scan)
    try:
        subscriber.follow(["127.0.0.1:2"])
        await until(lambda: len(scans) >= 3, "scanned again after the failure")
    finally:
        await asyncio.wait_for(subscriber.close(), timeout=10)


async def test_a_batch_applied_resets_the_back_off_at_once() -> None:
    """Not only at the next scan: with `kvEventsStaleAfterS` under the scan's second, an answer
    between two scans would otherwise leave the back-off doubling."""
    clock = Clock()
    index = ExactPrefixIndex(stale_after_s=STALE_S)
    subscriber = KVEventSubscriber(index, lambda hp: "tcp://127.0.0.1:1", clock=clock)
    try:
        subscriber.follow([ENDPOINT])
        index.routed(ENDPOINT, clock.now)
        clock.now += STALE_S
        assert subscriber.reopen_unanswered() == [ENDPOINT]
        feed = subscriber._feeds[ENDPOINT]
        assert (feed.backoff_s, feed.reopen_at) == (STALE_S, 2 * STALE_S)
        subscriber._on_frames(ENDPOINT, [b"kv", (0).to_bytes(8, "big"), AFTER], 0.0)
        assert (feed.backoff_s, feed.reopen_at) == (0.0, float("-inf"))
    finally:
        await asyncio.wait_for(subscriber.close(), timeout=10)
