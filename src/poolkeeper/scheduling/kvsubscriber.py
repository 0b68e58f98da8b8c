"""The EPP side of KV events: one ZMQ SUB socket per endpoint, feeding the exact prefix index.

Each engine publishes on its own address (vLLM: `--kv-events-config` with a `tcp://*:PORT`
PUB endpoint); the subscriber connects to `tcp://<endpoint ip>:<port>` for every endpoint it is
asked to follow, reads three-frame messages (topic, 8-byte big-endian sequence number, msgpack
batch: `kvevents.py`) and applies each batch to the `ExactPrefixIndex` at `clock()`, the
runtime's one clock (the decisions' `now`, wired by the composition root through the plugin
build context): the index compares a batch's stamp with the decisions' `now`, so another base
would make an endpoint's distrust end at once or never. A sequence gap (ZMQ PUB drops messages
past its high-water mark, and a reconnect misses whatever was sent meanwhile) or an
undecodable batch tells the index its view of that endpoint was lost (`ExactPrefixIndex.lost`,
which distrusts it for a while; the scorer falls back meanwhile).

Endpoints are followed as soon as the EPP knows them: the runtime's wiring tells the prefix
scorer the pool's endpoints on every change (`server/wiring.py`), and the scorer also calls
`follow` with each decision's candidates; `forget` drops the ones that left the pool. Why
early: an engine reports a block once, and a SUB socket gets only what is published after it
connects, so a subscription made at the first decision loses the cold start's first prefixes. Needs
`pyzmq` (the `kv-events` extra); without it `follow` raises ConfigError once at startup.

`on_batch` (None by default: one attribute test a batch) is told of every batch applied:
`on_batch(endpoint, ts, received_at)`, the batch's engine stamp (vLLM: `time.time()` at the end
of the step that stored or evicted blocks) and the wall clock when this loop took it off the
socket. Who listens: the bench-only signal tap (`extproc/signal_tap.py`, its arrival times) and
a step-phase scorer (the batches are the engines' step clock). With `thread` (the prefix
scorer's `kvEventsReceiveThread`) the sockets are read on a thread of their own that stamps
`received_at` as each message comes off (`kvreceiver.py`); batches are still applied on the loop.

What a peer can make it hold is bounded (docs/notes/2026-12-08-kv-event-bounds.md): ZMQ's
`MAXMSGSIZE` (`kvevents.MAX_MESSAGE_BYTES`: a larger frame is never allocated; ZMQ drops the
connection and, libzmq 4.3.5, does not reconnect: reopened below), the frames kept of one
message (`kvreceiver.rest_of_message`: at most three; a longer message is read part by part and
dropped, counted as bad frames; ZMQ itself holds a message's parts until its last has come,
which no option bounds: the note), its receive queue (`RCVHWM`, messages: a full queue stops
ZMQ reading the socket, so the backlog waits in the publisher's own queue, vLLM's `hwm`
100,000, which drops past it: a gap at the next message; measured, the lead's check in the
bounds note), what one batch may decode to
(`kvevents.py`'s bounds: a batch past one is dropped, counted as `over_bounds`, and the endpoint
falls back as after a gap) and the receive thread's hand-off (`kvreceiver.MAX_PENDING_BYTES`).
Warnings name the endpoint, at most one per `WARN_EVERY_S` each.

Reopening (`reopen_unanswered`, every `WATCH_S` on the loop, both modes): ZMQ reconnects by
itself after a lost TCP connection, but not after a protocol error (a frame past `MAXMSGSIZE`),
and says so only to a socket monitor (two more sockets per endpoint, against ZMQ's 1,023 per
context). So the evidence is the index's: an endpoint routed to `stale_after_s` ago or earlier
with no batch since (`ExactPrefixIndex.unanswered`: `silent`, or `no_events` routed to) gets
its socket closed and a new one connected, at most once per back-off (from `stale_after_s`,
doubling to `REOPEN_MAX_S`; an answer resets it), counted (`reconnections`). The sequence
carries over: vLLM numbers its batches per publisher, across subscriptions, so anything
published while the connection was down (the oversize message too) is a gap at the new
subscription's first message, and the view is dropped then (`lost`); a restarted engine numbers
from 0, a gap too. A healthy engine routed only requests that fill no new block for
`stale_after_s` is reopened as well (a false alarm): it keeps its blocks, unused while `silent`
and trusted again at its next batch, which continues its sequence (an engine never announces a
block it holds again, so dropping them would lose them for good). One socket per endpoint
before and after (the old one is closed first).

What it counted (per endpoint: messages, batches applied, gaps, undecodable messages, refused
addresses; `kvstats.py`) and its index's counters are read at scrape time through `reading`,
the prefix scorer's contribution to /metrics (`telemetry/kv_collector.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from poolkeeper.errors import ConfigError
from poolkeeper.kvevents import MAX_MESSAGE_BYTES, KVEventBoundsError, KVEventError, decode
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.kvreceiver import (
    MAX_SOCKETS,
    ThreadReceiver,
    rest_of_message,
    warn_every,
)
from poolkeeper.scheduling.kvstats import EndpointFeed, EndpointReading, KVEventsReading

log = logging.getLogger(__name__)

# Longest wait between connection attempts to a silent endpoint (doubling from ZMQ's 100 ms).
RECONNECT_IVL_MAX_MS = 5_000
# Messages ZMQ queues per endpoint before dropping (its default: 1,000). One batch per engine
# step: 64 are 0.6 s or more of an engine's steps not read, and at most 64 x MAX_MESSAGE_BYTES.
RCVHWM = 64
WATCH_S = 1.0  # how often (wall time) the loop looks for endpoints to reopen
# Longest back-off between two reopenings of one endpoint (the decisions' clock, seconds).
REOPEN_MAX_S = 60.0


def events_address(hostport: str, *, port: int, port_offset: int | None) -> str:
    """The ZMQ address of an endpoint's KV events: its IP and `port`, or its HTTP port plus
    `port_offset` (several servers on one host, as the simulator runs them)."""
    host, _, http_port = hostport.rpartition(":")
    if port_offset is not None:
        port = int(http_port) + port_offset
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return f"tcp://{host}:{port}"


class KVEventSubscriber:
    """Per-endpoint SUB tasks on the running loop; not thread-safe (one loop owns it)."""

    __slots__ = (
        "_address",
        "_clock",
        "_closed",
        "_ctx",
        "_feeds",
        "_left",
        "_receiver",
        "_tasks",
        "_thread",
        "_watcher",
        "index",
        "on_batch",
        "received",
    )

    def __init__(
        self,
        index: ExactPrefixIndex,
        address: Callable[[str], str],
        *,
        clock: Callable[[], float] = time.monotonic,
        thread: bool = False,
    ) -> None:
        try:
            import zmq.asyncio
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(
                "kvEvents needs the pyzmq package: pip install 'poolkeeper[kv-events]'"
            ) from exc
        self.index = index
        self._address = address
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._feeds: dict[str, EndpointFeed] = {}  # per endpoint followed: sequence, counts
        self._thread = thread
        self._receiver: ThreadReceiver | None = None  # started at the first `follow`
        self.received = 0  # batches applied (for tests and stats)
        self._left = 0  # messages of endpoints no longer followed (for `delivered`)
        # (endpoint, batch ts, wall-clock receipt) per batch applied; the module's docstring.
        self.on_batch: Callable[[str, float, float], None] | None = None
        self._watcher: asyncio.Task[None] | None = None  # `_watch`, started with the first follow
        self._closed = False

    def follow(self, endpoints: Iterable[str]) -> None:
        """Subscribe to every endpoint (ip:port) not yet followed (nothing without a running
        loop: a scheduler driven synchronously, as in virtual time, is fed in-process)."""
        if self._closed:  # a pool change late in a shutdown: the context is gone
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._watcher is None:
            self._watcher = loop.create_task(self._watch(), name="kv-events-watch")
        if self._thread:
            receiver = self._receiver
            if receiver is None:
                receiver = self._receiver = ThreadReceiver(
                    loop, self._on_frames, _configure, self._connect_failed
                )
            for endpoint in endpoints:
                if endpoint not in self._feeds:
                    self._feeds[endpoint] = EndpointFeed()  # followed, nothing heard yet
                    receiver.add(endpoint, self._address(endpoint))
            return
        for endpoint in endpoints:
            if endpoint not in self._tasks:
                self._feeds[endpoint] = EndpointFeed()
                self._tasks[endpoint] = loop.create_task(
                    self._run(endpoint), name=f"kv-events:{endpoint}"
                )

    def forget(self, keep: set[str]) -> None:
        for endpoint in [e for e in self._tasks if e not in keep]:
            self._tasks.pop(endpoint).cancel()
        for endpoint in [e for e in self._feeds if e not in keep]:
            self._left += self._feeds.pop(endpoint).messages
            if self._receiver is not None:
                self._receiver.remove(endpoint)

    async def close(self) -> None:
        """End every subscription and the ZMQ context (idempotent; `follow` is a no-op after)."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks.values())
        if self._watcher is not None:
            tasks.append(self._watcher)
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._receiver is not None:
            await asyncio.to_thread(self._receiver.stop)
        self._ctx.term()

    async def _run(self, endpoint: str) -> None:
        import zmq

        try:
            sock = self._ctx.socket(zmq.SUB)
        except zmq.ZMQError as exc:  # out of ZMQ sockets (MAX_SOCKETS) or descriptors
            log.warning("kv events from %s: %s; tried again when reopened", endpoint, exc)
            return
        try:
            # Inside the `try`: a socket left open by a failed connect would block `close`'s
            # context termination for good.
            try:
                _configure(sock)
                sock.connect(self._address(endpoint))
            except zmq.ZMQError as exc:
                # One bad address loses that endpoint only (counted, as on the thread).
                log.warning("kv events from %s: %s", endpoint, exc)
                self._connect_failed(endpoint)
                return
            sync: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # read without a future
            while True:
                first = await sock.recv()
                frames = rest_of_message(sync, first)
                self._on_frames(endpoint, frames, time.time() if self.on_batch else 0.0)
        finally:
            sock.close(linger=0)  # (`forget` drops the sequence: a new task may follow it)

    def _on_frames(self, endpoint: str, frames: list[bytes], received_at: float) -> None:
        """One message from `endpoint` (on the loop): check its sequence, apply its batch."""
        feed = self._feeds.get(endpoint)
        if feed is None:
            self._left += 1
            return  # forgotten while the message was on its way from the thread
        feed.messages += 1
        now = self._clock()  # the decisions' clock
        index = self.index
        if len(frames) != 3 or len(frames[1]) != 8:
            feed.bad_frames += 1
            if warn_every(feed):
                log.warning("kv events from %s: not (topic, seq, payload); ignored", endpoint)
            return
        seq = int.from_bytes(frames[1], "big")
        expected = feed.expected
        if expected >= 0 and seq != expected:
            feed.gaps += 1
            index.lost(endpoint, now)
        feed.expected = seq + 1
        try:
            batch = decode(frames[2])
        except KVEventError as exc:
            # Dropped: what the engine reported in it is missing, as after a gap.
            if isinstance(exc, KVEventBoundsError):
                feed.over_bounds += 1
            else:
                feed.bad_payloads += 1
            if warn_every(feed):
                log.warning("kv events from %s: %s; batch dropped", endpoint, exc)
            index.lost(endpoint, now)
            return
        index.apply(endpoint, batch, now)
        if feed.backoff_s:  # answered: the back-off starts over (not only at the next scan)
            feed.backoff_s, feed.reopen_at = 0.0, float("-inf")
        self.received += 1
        observer = self.on_batch
        if observer is not None:
            observer(endpoint, batch.ts, received_at)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                self.reopen_unanswered()
            except Exception:  # one bad endpoint must not end reopening for every other
                log.exception("kv events: reopening unanswered subscriptions failed")

    def reopen_unanswered(self) -> list[str]:
        """Reopen the subscription of each endpoint the index finds unanswered (the module's
        docstring), once per back-off; the endpoints reopened."""
        now, index = self._clock(), self.index
        reopened = []
        for endpoint, feed in self._feeds.items():
            if not index.unanswered(endpoint, now):
                # Answered (or not routed to): the back-off starts over.
                feed.backoff_s, feed.reopen_at = 0.0, float("-inf")
                continue
            if now < feed.reopen_at or feed.connect_errors:  # (a refused address stays so)
                continue
            feed.backoff_s = min(2 * feed.backoff_s or index.stale_after_s, REOPEN_MAX_S)
            feed.reopen_at = now + feed.backoff_s
            feed.reconnections += 1
            # The sequence is kept: the publisher numbers on across subscriptions, so whatever
            # was published while the connection was down (the oversize message included)
            # shows as a gap at the new subscription's first message, and only then is the
            # view dropped. A quiet healthy engine keeps its blocks: it never announces a
            # block it already holds again.
            reopened.append(endpoint)
            if self._receiver is not None:
                self._receiver.add(endpoint, self._address(endpoint))  # the thread closes the old
                continue
            old = self._tasks.pop(endpoint, None)
            if old is not None:
                old.cancel()  # its socket closes before the new task opens one (FIFO steps)
            self._tasks[endpoint] = asyncio.get_running_loop().create_task(
                self._run(endpoint), name=f"kv-events:{endpoint}"
            )
        return reopened

    def _connect_failed(self, endpoint: str) -> None:
        """ZMQ refused `endpoint`'s address (on the loop; the thread calls it through it)."""
        feed = self._feeds.get(endpoint)
        if feed is not None:
            feed.connect_errors += 1

    @property
    def delivered(self) -> int:
        """Messages that reached `_on_frames` (summed here, not counted per message)."""
        return self._left + sum(f.messages for f in self._feeds.values())

    def reading(self) -> KVEventsReading:
        """Its counters and its index's, now (at scrape time, on the loop; `kvstats.py`)."""
        index, now = self.index, self._clock()
        delivered = self.delivered  # before the thread's count: `kvstats.py` says why
        receiver = self._receiver
        rows = tuple(
            EndpointReading(e, replace(f), index.blocks(e), index.staleness(e, now))
            for e, f in self._feeds.items()
        )
        return KVEventsReading(
            endpoints=rows,
            queued=0 if receiver is None else receiver.handed - delivered,
            admissions=index.admissions,
            removals=index.removals,
            evictions=index.evictions,
            unanchored=index.unanchored,
            lookups=index.lookups,
            lookup_blocks=index.lookup_blocks,
            lookup_hits=index.lookup_hits,
            max_blocks_per_endpoint=index.max_blocks_per_endpoint,
        )


def _configure(sock: Any) -> None:
    import zmq

    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    # Back off reconnecting to an endpoint that publishes nothing (ZMQ retries every
    # RECONNECT_IVL, 100 ms, forever by default: 1,000 silent endpoints cost about a
    # third of a core); a publisher that comes up later is joined within the cap.
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    # What one peer can make this process allocate (the module's docstring).
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
