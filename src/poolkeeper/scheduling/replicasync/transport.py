"""Replica sync over UDP: this replica's batches to every peer, the peers' verified ones in.

Why UDP: the events are small, frequent and only useful for a few seconds; a lost one costs a
little placement quality for a moment, while a stream's retransmissions and head-of-line
blocking would deliver them late. So: one datagram per (split) batch, sent to every peer, no
acknowledgement, nothing retried.

What it owns: the socket, the wire sequence numbers of this origin (a batch split by the
codec takes several, so they are the transport's, not the hub's), the coalescing of what the
hub has into as few datagrams as possible (`notify` arms one flush `flush_interval_s` later:
everything published meanwhile leaves together), and the checks before the core sees a batch:
authenticated (`codec.py`), not our own, fresh (its origin's wall clock within `max_age_s` of
ours), and newer than the last one from that origin (replays and reordered datagrams dropped).
Bounded: no queue of its own (the hub's is bounded), at most `max_origins` origins remembered,
datagrams dropped once the socket's send buffer holds `max_buffered` bytes; every drop and
rejection is counted by reason (`SyncStats`) and exported by the server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

from poolkeeper.scheduling.replicasync.codec import Codec, Rejected
from poolkeeper.scheduling.replicasync.events import Batch, SyncEvent

log = logging.getLogger("poolkeeper.replicasync")

Address = tuple[str, int]
Take = Callable[[], Batch | None]
Deliver = Callable[[Batch, float], bool]
MAX_TAKES = 64  # hub batches per flush; more are flushed on the next loop iteration


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class SyncStats:
    """Counters of one transport (monotonic; the server exports them)."""

    batches_sent: int = 0  # hub batches taken and sent
    datagrams_sent: int = 0  # datagrams handed to the socket, all peers counted
    received: int = 0  # batches delivered to the hub and taken by it
    refused: int = 0  # verified batches the hub declined (`deliver` returned False)
    rejected: dict[str, int] = field(default_factory=dict)  # by reason
    dropped: dict[str, int] = field(default_factory=dict)  # outgoing, by reason

    def count(self, table: dict[str, int], reason: str) -> None:
        table[reason] = table.get(reason, 0) + 1


class SyncTransport(asyncio.DatagramProtocol):
    """One replica's endpoint. `take` yields the hub's next outgoing batch (None when empty);
    `deliver(batch, now)` hands a peer's batch to the hub with the receive time on `clock`."""

    def __init__(
        self,
        codec: Codec,
        origin: str,
        take: Take,
        deliver: Deliver,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], int] = wall_ms,
        flush_interval_s: float = 0.001,
        max_age_s: float = 10.0,
        max_origins: int = 256,
        max_buffered: int = 1 << 20,
    ) -> None:
        self.codec, self.origin, self._take, self._deliver = codec, origin, take, deliver
        self._clock, self._wall = clock, wall
        self.flush_interval_s, self.max_age_ms = flush_interval_s, max_age_s * 1000.0
        self.max_origins, self.max_buffered = max_origins, max_buffered
        self.stats = SyncStats()
        self.peers: tuple[Address, ...] = ()
        self._seq = 0
        self._last: OrderedDict[str, int] = OrderedDict()  # origin -> last seq delivered
        self._socket: asyncio.DatagramTransport | None = None
        self._armed: asyncio.TimerHandle | asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> Address:
        """Bind `host:port` (port 0: any free one); the bound address."""
        self._loop = loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: self, local_addr=(host, port))
        return self.address

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's UDP transport is not a subclass of asyncio's, only alike)
        self._socket = cast(asyncio.DatagramTransport, transport)

    @property
    def address(self) -> Address:
        assert self._socket is not None, "not started"
        host, port = self._socket.get_extra_info("sockname")[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Send what the hub still holds, then close the socket."""
        if self._socket is None:
            return
        self.flush()
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None
        self._socket.close()
        self._socket = None

    # -- outgoing --------------------------------------------------------------------------
    def set_peers(self, peers: Iterable[Address]) -> None:
        """The addresses to send to from now on: our own left out, and those of the other
        address family (a name may resolve to both; an IPv6 socket reaches IPv4 peers through
        their mapped addresses, an IPv4 socket cannot reach IPv6 ones)."""
        own = self.address if self._socket is not None else None
        v6 = own is not None and ":" in own[0]
        kept = set()
        for host, port in peers:
            if ":" not in host and v6:
                host = f"::ffff:{host}"
            elif ":" in host and not v6:
                continue
            if (host, port) != own:
                kept.add((host, port))
        self.peers = tuple(sorted(kept))

    def notify(self) -> None:
        """The hub has something to send: one flush `flush_interval_s` from now collects it
        and whatever follows meanwhile (a no-op while one is armed). Called on the loop."""
        loop = self._loop
        if self._armed is not None or self._socket is None or loop is None:
            return
        if self.flush_interval_s <= 0:
            self._armed = loop.call_soon(self._armed_flush)
        else:
            self._armed = loop.call_later(self.flush_interval_s, self._armed_flush)

    def _armed_flush(self) -> None:
        self._armed = None
        if self.flush():
            self.notify()  # more than MAX_TAKES were waiting: the rest on the next iteration

    def flush(self) -> bool:
        """Send what the hub holds now (at most MAX_TAKES of its batches, as few datagrams as
        the codec allows); True when it may hold more."""
        events: list[SyncEvent] = []
        origin = self.origin
        takes = 0
        while takes < MAX_TAKES and (batch := self._take()) is not None:
            takes += 1
            origin = batch.origin
            events.extend(batch.events)
        if not events or self._socket is None:
            return False
        self.stats.batches_sent += takes
        try:
            datagrams = self.codec.encode(origin, self._seq, events, self._wall())
        except ValueError as exc:  # our bug: what the format cannot carry
            self.stats.count(self.stats.dropped, "unencodable")
            self._warn_once("unencodable", "replica sync: a batch was not sent: %s", exc)
            return takes == MAX_TAKES
        self._seq += len(datagrams)
        for datagram in datagrams:
            for peer in self.peers:
                # (typeshed lacks it on DatagramTransport; both loops' transports have it)
                buffered: int = self._socket.get_write_buffer_size()  # type: ignore[attr-defined]
                if buffered >= self.max_buffered:
                    self.stats.count(self.stats.dropped, "buffer")
                    continue
                try:
                    self._socket.sendto(datagram, peer)
                except OSError:  # (uvloop raises where asyncio reports to error_received)
                    self.stats.count(self.stats.dropped, "unreachable")
                    continue
                self.stats.datagrams_sent += 1
        return takes == MAX_TAKES

    # -- incoming --------------------------------------------------------------------------
    def datagram_received(self, data: bytes, addr: Address) -> None:
        stats = self.stats
        try:
            decoded = self.codec.decode(data)
        except Rejected as exc:
            self._reject(exc.reason, "replica sync: datagram from %s rejected: %s", addr, exc)
            return
        batch = decoded.batch
        if batch.origin == self.origin:
            self._reject("own", "replica sync: our own batch came back from %s", addr)
            return
        if abs(self._wall() - decoded.sent_at_ms) > self.max_age_ms:
            self._reject("stale", "replica sync: batch of %s off by over %.0f ms (clocks?)",
                         batch.origin, self.max_age_ms)  # fmt: skip
            return
        last = self._last.get(batch.origin)
        if last is not None and batch.seq <= last:
            self._reject("replayed", "replica sync: batch %d of %s again or out of order",
                         batch.seq, batch.origin)  # fmt: skip
            return
        self._last[batch.origin] = batch.seq
        self._last.move_to_end(batch.origin)
        while len(self._last) > self.max_origins:
            self._last.popitem(last=False)
        try:
            taken = self._deliver(batch, self._clock())
        except Exception:  # a fold bug must not end the endpoint
            log.exception("replica sync: delivering batch %d of %s", batch.seq, batch.origin)
            stats.count(stats.rejected, "error")
            return
        if taken:
            stats.received += 1
        else:
            stats.refused += 1

    def error_received(self, exc: Exception) -> None:
        # An ICMP error for an earlier send (a peer gone): the next sends go on regardless.
        self.stats.count(self.stats.dropped, "unreachable")

    def _reject(self, reason: str, message: str, *args: object) -> None:
        self.stats.count(self.stats.rejected, reason)
        self._warn_once(reason, message, *args)

    def _warn_once(self, reason: str, message: str, *args: object) -> None:
        """The first of each reason as a warning, the rest at debug (a flood stays quiet)."""
        level = logging.DEBUG if reason in self._warned else logging.WARNING
        self._warned.add(reason)
        log.log(level, message, *args)
