"""What a peer's KV-event stream can make the EPP hold is bounded: real ZMQ on 127.0.0.1, on
the loop and on the receive thread. Each message past a bound is dropped and counted, the
endpoint falls back to the approximate index (its exact view is no longer exact), and the next
valid batch still applies (docs/notes/2026-12-08-kv-event-bounds.md). A message of more than
three parts is read part by part and none of it is kept."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq

from poolkeeper.kvevents import (
    MAX_BLOCKS_PER_EVENT,
    MAX_EVENTS_PER_BATCH,
    MAX_MESSAGE_BYTES,
    MAX_TOKENS_PER_EVENT,
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    KVEventBoundsError,
    decode,
    encode,
)
from poolkeeper.scheduling import kvreceiver
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.kvreceiver import MAX_SOCKETS
from poolkeeper.scheduling.kvsubscriber import RCVHWM, KVEventSubscriber, _configure
from tests.support.kvpub import Feed, joined
from tests.support.waiting import until

pytestmark = pytest.mark.integration

AFTER = encode(KVEventBatch(0.0, [BlockStored([77], None)]))  # the valid batch after a drop
TS = b"\xcb" + b"\x00" * 8  # msgpack float64 0.0


def _array32(n: int) -> bytes:
    """A msgpack array header declaring `n` items."""
    return b"\xdd" + n.to_bytes(4, "big")


def _fixints(n: int) -> bytes:
    """A msgpack array of `n` zeros, built without a Python list of them."""
    return _array32(n) + b"\x00" * n


async def _after_drop(feed: Feed) -> None:
    """The dropped message left the endpoint on the fallback; a valid batch after it applies."""
    index = feed.subscriber.index
    await until(lambda: feed.row().feed.over_bounds == 1, "the drop counted")
    assert feed.row().staleness == "lost"
    assert not index.match([1])  # the exact view it had is dropped
    await feed.pub.until_applied(feed.subscriber, AFTER, first_seq=feed.seq + 2)
    await until(lambda: index.match([77]), "the batch after the drop applied")
    row = feed.row()
    assert row.staleness == "lost"  # distrusted for stale_after_s
    assert not index.match([1])
    assert row.feed.gaps == 0
    assert row.feed.over_bounds == 1
    assert row.feed.bad_payloads == 0


def test_every_socket_caps_a_message_and_its_receive_queue() -> None:
    """Read back from a socket configured as both modes configure theirs: ZMQ never
    allocates a frame past MAX_MESSAGE_BYTES (it drops the connection instead)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        _configure(sock)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
        assert sock.getsockopt(zmq.RCVHWM) == RCVHWM
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_both_modes_contexts_take_more_sockets_than_zmqs_default(thread: bool) -> None:
    subscriber = KVEventSubscriber(
        ExactPrefixIndex(), lambda hp: "tcp://127.0.0.1:1", thread=thread
    )
    subscriber.follow(["127.0.0.1:1"])
    try:
        receiver = subscriber._receiver
        ctx = subscriber._ctx if receiver is None else receiver._ctx
        assert ctx.get(zmq.MAX_SOCKETS) == MAX_SOCKETS > 1_023
    finally:
        await asyncio.wait_for(subscriber.close(), timeout=10)


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (
            b"\x93"
            + TS
            + _array32(MAX_EVENTS_PER_BATCH + 1)
            + b"\x91\xb0AllBlocksCleared" * (MAX_EVENTS_PER_BATCH + 1)
            + b"\xc0",
            "events in one batch",
        ),
        (
            b"\x93"
            + TS
            + b"\x91\x95\xabBlockStored"
            + _fixints(MAX_BLOCKS_PER_EVENT + 1)
            + b"\xc0\x90\x10\xc0",
            "block hashes in one event",
        ),
        (
            b"\x93"
            + TS
            + b"\x91\x95\xabBlockStored\x90\xc0"
            + _fixints(MAX_TOKENS_PER_EVENT + 1)
            + b"\x10\xc0",
            "max_array_len",
        ),
        (b"\x93" + TS + _array32(2**32 - 1), "max_array_len"),  # declared, never sent
        (b"\x93" + TS + b"\x91" * 100_000 + b"\xc0", "nested deeper"),
        (b"\x93" + TS + b"\x91\x93\xacBlockRemoved\x90\xda\x13\x88" + b"x" * 5000, "max_str_len"),
    ],
    ids=["events", "hashes", "tokens", "declared-length", "nesting", "str"],
)
@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_a_batch_past_a_bound_is_dropped_counted_and_falls_back(
    payload: bytes, error: str, thread: bool
) -> None:
    with pytest.raises(KVEventBoundsError, match=error):
        decode(payload)
    async with joined(thread) as feed:
        await feed.pub.send(feed.seq + 1, payload)
        await _after_drop(feed)
        assert feed.row().feed.messages >= 3  # hello, the dropped one, the one after


async def test_a_token_list_at_its_bound_is_decoded() -> None:
    """The bounds refuse only what no engine sends: one past, not at."""
    at = b"\x93" + TS + b"\x91\x95\xabBlockStored\x91\x05\xc0" + _fixints(MAX_TOKENS_PER_EVENT)
    (event,) = decode(at + b"\x10\xc0").events
    assert event == BlockStored([5], None, [], 16, None, None)
    many = KVEventBatch(0.0, [AllBlocksCleared()] * MAX_EVENTS_PER_BATCH)
    assert len(decode(encode(many)).events) == MAX_EVENTS_PER_BATCH


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_a_message_past_maxmsgsize_is_never_allocated_and_drops_the_connection(
    thread: bool,
) -> None:
    """A valid batch larger than MAX_MESSAGE_BYTES (4,200 events of a 4,000-character
    medium): ZMQ reads its size, refuses it before allocating and drops the connection (the
    publisher sees the disconnect); it is never delivered. libzmq (4.3) does not reconnect
    after that protocol error: the subscriber reopens it once the endpoint is routed to and
    stays silent (`test_sched_kv_reopen.py`)."""
    events = [["BlockStored", [99], None, [], 16], *[["BlockRemoved", [], "x" * 4000]] * 4200]
    big = msgpack.packb([0.0, events, None])
    assert len(big) > MAX_MESSAGE_BYTES
    assert len(decode(big).events) == 4201  # within every decoding bound
    async with joined(thread) as feed:
        monitor = feed.pub.pub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            await feed.pub.send(feed.seq + 1, big)
            event = await asyncio.wait_for(monitor.recv_multipart(), timeout=30)
            assert int.from_bytes(event[0][:2], "little") == zmq.EVENT_DISCONNECTED
            await asyncio.sleep(0)  # (a message taken already would be on the loop now)
            assert not feed.subscriber.index.match([99])  # its BlockStored never applied
            row = feed.row()
            assert row.feed.bad_payloads == row.feed.over_bounds == row.feed.bad_frames == 0
        finally:
            feed.pub.pub.disable_monitor()
            monitor.close(linger=0)


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
async def test_a_message_of_many_parts_is_read_part_by_part_dropped_and_counted(
    thread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid message with 100,000 empty parts more (each far under MAXMSGSIZE): none of
    its parts reaches the loop (no message of more than three frames is ever kept), it counts
    as malformed frames, and the next batch applies with no gap."""
    delivered: list[int] = []  # frames per message the loop was handed
    on_frames = KVEventSubscriber._on_frames

    def recording(sub: KVEventSubscriber, endpoint: str, frames: list[bytes], at: float) -> None:
        delivered.append(len(frames))
        on_frames(sub, endpoint, frames, at)

    monkeypatch.setattr(KVEventSubscriber, "_on_frames", recording)
    async with joined(thread) as feed:
        seq = (feed.seq + 1).to_bytes(8, "big")
        await feed.pub.pub.send_multipart([b"kv", seq, AFTER, *[b""] * 100_000])
        await until(lambda: feed.row().feed.bad_frames == 1, "the many-part message counted")
        assert max(delivered) == 3
        assert delivered.count(0) == 1  # the many-part message: none of it kept
        await feed.pub.until_applied(feed.subscriber, AFTER, first_seq=feed.seq + 1)
        await until(lambda: feed.subscriber.index.match([77]), "the batch after it applied")
        row = feed.row()
        assert row.feed.gaps == row.feed.bad_payloads == row.feed.over_bounds == 0
        assert row.staleness is None  # a malformed message is ignored, not a lost view


async def test_the_receive_thread_drops_past_its_pending_bytes_and_the_loop_sees_a_gap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop stalls while the thread receives: past MAX_PENDING_BYTES handed and not
    taken, the thread drops instead of queueing without limit."""
    payload = encode(KVEventBatch(0.0, [BlockStored([2], None)]))
    async with joined(True) as feed:
        receiver = feed.subscriber._receiver
        assert receiver is not None
        assert receiver.handed_bytes == receiver.taken_bytes  # nothing pending now
        # Room for one message (three frames) only.
        monkeypatch.setattr(kvreceiver, "MAX_PENDING_BYTES", len(payload) + 20)
        handed = receiver.handed  # before the sends: the thread may take the first at once
        for n in range(1, 4):
            await feed.pub.send(feed.seq + n, payload)
        deadline = time.monotonic() + 30  # the loop blocked on purpose: the thread runs
        while receiver.dropped < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # noqa: ASYNC251 - the stall is the point: the loop takes nothing
        assert receiver.dropped == 2
        assert receiver.handed == handed + 1
        feed.seq += 2  # the last one sent was seq + 3: the next is seq + 4 (= seq' + 2)
        # The one handed over is applied first (else it would count as the batch after, and
        # with room for one message only, the thread could drop that one).
        await until(lambda: receiver.handed_bytes == receiver.taken_bytes, "the handed taken")
        await feed.pub.until_applied(feed.subscriber, AFTER, first_seq=feed.seq + 2)
        await until(lambda: feed.subscriber.index.match([77]), "applied after the drops")
        row = feed.row()
        assert row.feed.gaps == 1
        assert row.staleness == "lost"
        assert receiver.handed_bytes == receiver.taken_bytes
