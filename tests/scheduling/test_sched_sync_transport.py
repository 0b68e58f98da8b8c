"""Replica sync over real UDP sockets on 127.0.0.1: batches reach every peer; forged, tampered,
replayed, stale and echoed datagrams are rejected by reason; a vanished peer costs nothing."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from poolkeeper.scheduling.replicasync.codec import Codec, Decoded
from poolkeeper.scheduling.replicasync.events import Answered, Batch, Ended, Open, Sent, SyncEvent
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.replicasync.openset import digest
from poolkeeper.scheduling.replicasync.transport import SyncTransport, wall_ms
from tests.support.waiting import until

pytestmark = pytest.mark.integration
KEY = b"shared-key-for-tests-0123456789"


@dataclass
class FakeHub:
    """What the transport needs of the hub: an outgoing queue and a delivery log."""

    origin: str
    outgoing: list[Batch] = field(default_factory=list)
    delivered: list[tuple[Batch, float]] = field(default_factory=list)
    accept: bool = True
    seq: int = 0

    def publish(self, *events: SyncEvent) -> None:
        self.outgoing.append(Batch(self.origin, self.seq, events))
        self.seq += 1

    def take(self) -> Batch | None:
        return self.outgoing.pop(0) if self.outgoing else None

    def deliver(self, batch: Batch, now: float) -> bool:
        self.delivered.append((batch, now))
        return self.accept

    def events(self) -> list[SyncEvent]:
        return [e for b, _ in self.delivered for e in b.events]


@dataclass
class Node:
    hub: FakeHub
    transport: SyncTransport


async def node(name: str, key: bytes = KEY, **kw: object) -> Node:
    hub = FakeHub(name)
    transport = SyncTransport(Codec(key), name, hub.take, hub.deliver, **kw)  # type: ignore[arg-type]
    await transport.start("127.0.0.1", 0)
    return Node(hub, transport)


@pytest.fixture
async def trio() -> AsyncIterator[list[Node]]:
    nodes = [await node(name) for name in ("a", "b", "c")]
    addresses = [n.transport.address for n in nodes]
    for n in nodes:
        n.transport.set_peers(addresses)  # each one's own address is left out
    yield nodes
    for n in nodes:
        n.transport.close()


def link(*nodes: Node) -> None:
    """Every node a peer of every other (a datagram from a non-peer address is dropped)."""
    addresses = [n.transport.address for n in nodes]
    for n in nodes:
        n.transport.set_peers(addresses)


def forger(to: Node, *, peer: bool = True) -> socket.socket:
    """A raw socket on 127.0.0.1 that `to` counts as a peer (or not)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    if peer:
        to.transport.set_peers([*to.transport.peers, sock.getsockname()])
    return sock


async def test_published_events_reach_every_peer_coalesced_into_one_datagram(
    trio: list[Node],
) -> None:
    a, b, c = trio
    assert a.transport.address not in a.transport.peers
    assert len(a.transport.peers) == 2
    a.hub.publish(Sent("r1", "10.0.0.1:8000", 120, True, (1, 2, 3), 9))
    a.hub.publish(Answered("r1"), Ended("r1"))
    a.transport.notify()
    a.transport.notify()  # armed once: one flush takes both batches
    await until(lambda: b.hub.delivered and c.hub.delivered, "both peers got the batch")
    for peer in (b, c):
        (batch, _now), = peer.hub.delivered  # fmt: skip
        assert batch.origin == "a"
        assert batch.seq == 0
        assert batch.events == (
            Sent("r1", "10.0.0.1:8000", 120, True, (1, 2, 3), 9), Answered("r1"), Ended("r1")
        )  # fmt: skip
    assert a.transport.stats.batches_sent == 2
    assert a.transport.stats.datagrams_sent == 2
    a.hub.publish(Ended("r2"))
    a.transport.notify()
    await until(lambda: len(b.hub.delivered) == 2, "the second batch")
    assert b.hub.delivered[1][0].seq == 1
    assert not a.hub.delivered  # nothing of its own came back


async def test_forged_tampered_and_replayed_datagrams_are_rejected(trio: list[Node]) -> None:
    _a, b, _c = trio
    to = b.transport.address
    sock = forger(b)
    raw_send = sock.sendto
    good = Codec(KEY).encode("x", 5, (Ended("r"),), wall_ms())[0]
    raw_send(good, to)
    await until(lambda: len(b.hub.delivered) == 1, "the genuine datagram")
    raw_send(good, to)  # the same again: a replay
    raw_send(Codec(b"not the shared key at all").encode("x", 6, (Ended("r"),), wall_ms())[0], to)
    tampered = bytearray(Codec(KEY).encode("x", 7, (Ended("r"),), wall_ms())[0])
    tampered[-40] ^= 0xFF
    raw_send(bytes(tampered), to)
    raw_send(b"hello", to)
    stale = Codec(KEY).encode("x", 8, (Ended("r"),), wall_ms() - 60_000)[0]
    raw_send(stale, to)
    raw_send(Codec(KEY).encode("b", 0, (Ended("r"),), wall_ms())[0], to)  # "b" is b's origin
    expected = {"replayed": 1, "auth": 2, "short": 1, "stale": 1, "own": 1}
    await until(lambda: b.transport.stats.rejected == expected, "every bad datagram counted")
    assert len(b.hub.delivered) == 1
    sock.close()


async def test_a_reordered_datagram_is_taken_once_as_the_hub_takes_it(trio: list[Node]) -> None:
    _a, b, _c = trio
    to, sock = b.transport.address, forger(b)
    for seq in (100, 98, 98, 30):  # 98 late (taken), again (a replay), 30 far behind (refused)
        sock.sendto(Codec(KEY).encode("x", seq, (Ended(f"r{seq}"),), wall_ms())[0], to)
    await until(lambda: b.transport.stats.rejected == {"replayed": 2}, "both replays counted")
    assert [batch.seq for batch, _ in b.hub.delivered] == [100, 98]
    sock.close()


async def test_a_stranger_costs_no_tag_and_is_dropped(trio: list[Node]) -> None:
    _a, b, _c = trio
    decoded: list[bytes] = []
    real = b.transport.codec.decode

    def spy(data: bytes) -> Decoded:
        decoded.append(data)
        return real(data)

    b.transport.codec.decode = spy  # type: ignore[method-assign]
    with forger(b, peer=False) as stranger:
        stranger.sendto(Codec(KEY).encode("x", 5, (Ended("r"),), wall_ms())[0], b.transport.address)
        await until(lambda: b.transport.stats.rejected == {"stranger": 1}, "the stranger dropped")
    assert not decoded
    assert not b.hub.delivered


async def test_a_restarted_replica_takes_no_replay_from_before_its_start() -> None:
    b = await node("b", max_origins=1, new_origin_skew_s=1.0)
    try:
        with forger(b) as sock:
            to, codec, now = b.transport.address, Codec(KEY), wall_ms()
            sock.sendto(codec.encode("x", 5, (Ended("old"),), now - 3_000)[0], to)  # fresh, but
            early = {"before_start": 1}  # sent before b started, to an empty seq table
            await until(lambda: b.transport.stats.rejected == early, "the replay refused")
            old_x = codec.encode("x", 6, (Ended("x6"),), wall_ms())[0]
            sock.sendto(old_x, to)
            await until(lambda: len(b.hub.delivered) == 1, "x's batch after the start")
            await asyncio.sleep(0.01)  # (the wall clock moves on before y pushes x out)
            b.transport.new_origin_skew_ms = 0.0
            sock.sendto(codec.encode("y", 1, (Ended("y1"),), wall_ms())[0], to)
            await until(lambda: len(b.hub.delivered) == 2, "y's batch, x forgotten")
            sock.sendto(old_x, to)  # x is a new origin again: its old datagram must not pass
            await until(lambda: b.transport.stats.rejected == {"before_start": 2}, "x replayed")
    finally:
        b.transport.close()
    assert b.transport.receive_buffer > 0


async def test_a_peer_that_disappears_costs_the_others_nothing(trio: list[Node]) -> None:
    a, b, c = trio
    c.transport.close()
    for i in range(3):
        a.hub.publish(Ended(f"r{i}"))
        a.transport.notify()
        await until(lambda: len(b.hub.delivered) == i + 1, f"batch {i} at b")  # noqa: B023
    assert [e.request_id for e in b.hub.events()] == ["r0", "r1", "r2"]
    assert not c.hub.delivered


async def test_a_batch_the_hub_refuses_or_fails_on_is_counted() -> None:
    a, b = await node("a"), await node("b")
    try:
        link(a, b)
        b.hub.accept = False
        a.hub.publish(Ended("r"))
        a.transport.flush()
        await until(lambda: b.transport.stats.refused == 1, "a refused batch counted")

        def broken(batch: Batch, now: float) -> bool:
            raise RuntimeError("fold bug")

        b.transport._deliver = broken
        a.hub.publish(Ended("s"))
        a.transport.flush()
        await until(lambda: b.transport.stats.rejected == {"error": 1}, "a failed delivery")
    finally:
        a.transport.close()
        b.transport.close()


async def test_sends_stop_at_the_buffer_bound_and_a_big_batch_goes_as_several() -> None:
    a, b = await node("a", max_buffered=0), await node("b")
    try:
        link(a, b)
        a.hub.publish(Ended("r"))
        a.transport.flush()
        assert a.transport.stats.dropped == {"buffer": 1}
        a.transport.max_buffered = 1 << 20
        blocks = tuple(range(256))
        a.hub.publish(*(Sent(f"r{i}", "10.0.0.1:8000", 1, True, blocks) for i in range(60)))
        a.transport.flush()
        await until(lambda: len(b.hub.events()) == 60, "every event of the big batch")
        seqs = [batch.seq for batch, _ in b.hub.delivered]
        assert len(seqs) == 60  # one Sent of ~130 blocks fills a 1,232-byte datagram
        assert a.transport.codec.trimmed == 60
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    finally:
        a.transport.close()
        b.transport.close()


async def test_a_decision_at_once_brings_an_armed_flush_forward() -> None:
    a, b = await node("a", flush_interval_s=3600.0), await node("b")
    try:
        link(a, b)
        a.hub.publish(Answered("r0"))
        a.transport.notify()  # armed an hour from now
        a.hub.publish(Sent("r1", "10.0.0.1:8000", 120, True))
        a.transport.notify(at_once=True)  # the decision: on the loop's next turn
        a.transport.notify(at_once=True)  # (armed already: one flush)
        await until(lambda: len(b.hub.events()) == 2, "both events, well before the hour")
        assert b.hub.events() == [Answered("r0"), Sent("r1", "10.0.0.1:8000", 120, True)]
        assert a.transport.stats.datagrams_sent == 1  # the first byte went with it
        a.hub.publish(Ended("r1"))
        a.transport.notify()  # the next flush is a timer again
        a.hub.publish(Sent("r2", "10.0.0.2:8000", 80, False))
        a.transport.notify(at_once=True)
        await until(lambda: len(b.hub.events()) == 4, "the second decision at once")
        assert a.transport.stats.datagrams_sent == 2
    finally:
        a.transport.close()
        b.transport.close()


async def test_close_sends_what_the_hub_still_holds() -> None:
    a, b = await node("a", flush_interval_s=60.0), await node("b")
    try:
        link(a, b)
        a.hub.publish(Ended("last"))
        a.transport.notify()  # armed for a minute from now
        a.transport.close()
        await until(lambda: b.hub.events() == [Ended("last")], "the last batch")
    finally:
        b.transport.close()
    await asyncio.sleep(0)


async def test_a_bad_event_costs_only_itself_and_close_always_closes() -> None:
    a, b = await node("a"), await node("b")
    try:
        link(a, b)
        a.hub.publish(Ended("ok1"), Sent("bad", "h:1", -1, False), Ended("ok2"))
        a.transport.flush()
        await until(lambda: len(b.hub.events()) == 2, "the good events")
        assert b.hub.events() == [Ended("ok1"), Ended("ok2")]
        assert a.transport.stats.dropped == {"unencodable_event": 1}
    finally:
        a.transport.close()
        b.transport.close()
    broken = await node("c", wall=lambda: -1)  # a time the header cannot carry (struct.error)
    broken.hub.publish(Ended("r"))
    broken.transport.notify()
    broken.transport.close()  # flushes: the batch is dropped, the socket closed regardless
    assert broken.transport._socket is None
    assert broken.transport.stats.dropped == {"unencodable": 1}


async def test_peers_of_the_other_address_family_are_mapped_or_left_out() -> None:
    a = await node("a")
    try:
        a.transport.set_peers([("::1", 9), ("127.0.0.1", 9), a.transport.address])
        assert a.transport.peers == (("127.0.0.1", 9),)  # an IPv4 socket cannot reach IPv6
    finally:
        a.transport.close()
    hub = FakeHub("v6")
    six = SyncTransport(Codec(KEY), "v6", hub.take, hub.deliver)
    try:
        await six.start("::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        six.set_peers([("127.0.0.1", 9), ("::1", 9)])
        assert six.peers == (("::1", 9), ("::ffff:127.0.0.1", 9))
    finally:
        six.close()


async def test_a_heartbeat_is_an_empty_batch_sent_when_there_is_nothing_to_tell(
    trio: list[Node],
) -> None:
    a, b, _c = trio
    assert not a.transport.flush()  # nothing published: nothing sent
    a.transport.flush(heartbeat=True)
    await until(lambda: len(b.hub.delivered) == 1, "the heartbeat")
    assert b.hub.delivered[0][0] == Batch("a", 0, ())


async def test_a_heartbeat_ends_with_the_hubs_open_statement_sized_to_a_datagram() -> None:
    rooms: list[int] = []

    def state(room: int) -> Open:
        rooms.append(room)
        return Open(0, 0, frozenset({11, 12}))

    a, b = await node("a", state=state), await node("b")
    link(a, b)
    try:
        a.hub.publish(Ended("r1"))
        assert not a.transport.flush()  # an ordinary flush states nothing
        a.hub.publish(Ended("r2"))
        a.transport.flush(heartbeat=True)
        await until(lambda: len(b.hub.delivered) == 2, "both batches")
        assert [batch for batch, _ in b.hub.delivered] == [
            Batch("a", 0, (Ended("r1"),)),
            Batch("a", 1, (Ended("r2"),), Open(0, 0, frozenset({11, 12}))),
        ]
        assert rooms == [a.transport.codec.room("a")]
    finally:
        a.transport.close()
        b.transport.close()


async def test_a_statement_that_fails_costs_only_itself() -> None:
    # An open id whose digest cannot be made (not encodable): the heartbeat's events still go,
    # without the statement, and the failure is counted.
    out = ReplicaSync("a")
    out.bind_open(lambda: (digest(i) for i in ["\ud800"]))
    a, b = await node("a", state=out.statement), await node("b")
    link(a, b)
    try:
        a.hub.publish(Ended("r1"))
        a.transport.flush(heartbeat=True)
        await until(lambda: len(b.hub.delivered) == 1, "the events")
        assert b.hub.delivered[0][0] == Batch("a", 0, (Ended("r1"),))
        assert a.transport.stats.dropped == {"statement": 1}
    finally:
        a.transport.close()
        b.transport.close()
