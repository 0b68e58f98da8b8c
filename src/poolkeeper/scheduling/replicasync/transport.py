"""Replica sync over UDP: this replica's batches to every peer, the peers' verified ones in.

Why UDP: the events are small, frequent and only useful for a few seconds; a lost one costs a
little placement quality for a moment, while a stream's retransmissions and head-of-line
blocking would deliver them late. So: one datagram per (split) batch, sent to every peer, no
acknowledgement, nothing retried.

What it owns: the socket, the wire sequence numbers of this origin (a batch split by the
codec takes several, so they are the transport's, not the hub's), the coalescing of what the
hub has into as few datagrams as possible (`notify` arms one flush `flush_interval_s` later:
everything published meanwhile leaves together; `notify(at_once=True)`, a decision, flushes on
the loop's next turn instead: the races between replicas are within the last millisecond, so a
peer must learn a `Sent` well under one, docs/notes/2026-12-07-replicas-sub-ms.md;
`flush(heartbeat=True)` adds the hub's open statement, `state`, sized to fit a datagram), and
the checks before the core sees a batch: from a current peer's address (before the codec
computes anything; addresses can be spoofed, so this only saves CPU, the tag is the check),
authenticated (`codec.py`, which drops anything over its `max_bytes` before the tag), not our
own, fresh (its origin's wall clock within `max_age_s` of ours), and not a replay
(`hub.seq_window`; a datagram reordered within the window is taken). An origin not heard
before has no last sequence number (this replica just started, or forgot it among
`max_origins`), so its batches must also be sent after this replica started (or forgot one)
less `new_origin_skew_s`: a datagram captured before that cannot be replayed into a restarted
replica; one captured within that allowance still can, once.
Bounded: no queue of its own (the hub's is bounded), at most `max_origins` origins remembered,
datagrams dropped once the socket's send buffer holds `max_buffered` bytes; every drop and
rejection is counted by reason (`SyncStats`) and exported by the server.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

from poolkeeper.scheduling.replicasync.codec import ENCODE_ERRORS, Codec
from poolkeeper.scheduling.replicasync.discovery import Address, reachable
from poolkeeper.scheduling.replicasync.events import Batch, Open, SyncEvent
from poolkeeper.scheduling.replicasync.hub import SeqState, seq_window
from poolkeeper.scheduling.replicasync.wire import Rejected

log = logging.getLogger("poolkeeper.replicasync")

Take = Callable[[], Batch | None]
Deliver = Callable[[Batch, float], bool]
State = Callable[[int], Open | None]  # room in digests -> the open statement (hub.statement)
MAX_TAKES = 64  # hub batches per flush; more are flushed on the next loop iteration
RECEIVE_BUFFER = 4 << 20  # SO_RCVBUF asked for: peers' bursts queue here (the kernel caps it)


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
        new_origin_skew_s: float = 1.0,
        state: State | None = None,
    ) -> None:
        self.codec, self.origin, self._take, self._deliver = codec, origin, take, deliver
        self._state = state
        self._clock, self._wall = clock, wall
        self.flush_interval_s, self.max_age_ms = flush_interval_s, max_age_s * 1000.0
        self.max_origins, self.max_buffered = max_origins, max_buffered
        self.new_origin_skew_ms = new_origin_skew_s * 1000.0
        self._floor_ms = float("-inf")  # a new origin's batches sent before this are refused
        self.receive_buffer = 0  # SO_RCVBUF the kernel granted (0: unknown)
        self.stats = SyncStats()
        self.peers: tuple[Address, ...] = ()
        self._peer_set: frozenset[Address] = frozenset()
        self._seq = 0
        self._last: OrderedDict[str, SeqState] = OrderedDict()  # origin -> seqs delivered
        self._socket: asyncio.DatagramTransport | None = None
        self._armed: asyncio.TimerHandle | asyncio.Handle | None = None
        self._soon = False  # the armed flush is the loop's next turn (not a timer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> Address:
        """Bind `host:port` (port 0: any free one); the bound address."""
        self._loop = loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: self, local_addr=(host, port))
        self._floor_ms = self._wall() - self.new_origin_skew_ms
        self.receive_buffer = self._raise_receive_buffer()
        return self.address

    def _raise_receive_buffer(self) -> int:
        """Ask for `RECEIVE_BUFFER` bytes of receive buffer (several peers' split batches may
        arrive in one burst; the default ~208 KiB holds ~100 datagrams); what was granted (Linux
        caps it at net.core.rmem_max)."""
        sock = self._socket.get_extra_info("socket") if self._socket is not None else None
        if sock is None:
            return 0
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        except OSError as exc:
            log.info("replica sync: receive buffer left as it is: %s", exc)
        try:
            return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        except OSError:
            return 0

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
        try:
            self.flush()
        finally:  # (flush catches what encoding raises; the socket is closed regardless)
            if self._armed is not None:
                self._armed.cancel()
                self._armed = None
            self._socket.close()
            self._socket = None

    # -- outgoing --------------------------------------------------------------------------
    def set_peers(self, peers: Iterable[Address]) -> None:
        """The addresses to send to from now on (`discovery.reachable`)."""
        kept = reachable(peers, self.address if self._socket is not None else None)
        self.peers, self._peer_set = tuple(sorted(kept)), frozenset(kept)

    def notify(self, *, at_once: bool = False) -> None:
        """The hub has something to send: one flush `flush_interval_s` from now collects it
        and whatever follows meanwhile (a no-op while one is armed); `at_once`: on the loop's
        next turn (an armed timer brought forward). Called on the loop."""
        loop = self._loop
        if self._socket is None or loop is None:
            return
        if self._armed is not None:
            if self._soon or not at_once:
                return
            self._armed.cancel()
        self._soon = at_once or self.flush_interval_s <= 0
        if self._soon:
            self._armed = loop.call_soon(self._armed_flush)
        else:
            self._armed = loop.call_later(self.flush_interval_s, self._armed_flush)

    def _armed_flush(self) -> None:
        self._armed, self._soon = None, False
        if self.flush():
            self.notify()  # more than MAX_TAKES were waiting: the rest on the next iteration

    def flush(self, *, heartbeat: bool = False) -> bool:
        """Send what the hub holds now (at most MAX_TAKES of its batches, as few datagrams as
        the codec allows); True when it may hold more. `heartbeat`: send a batch even when the
        hub holds nothing (peers count this origin heard: one with only long requests in
        flight is not expired), ending with the hub's open statement (`state`) when one is
        bound (the peers drop what it no longer covers: a lost `Answered` or `Ended`)."""
        events: list[SyncEvent] = []
        origin = self.origin
        takes = 0
        while takes < MAX_TAKES and (batch := self._take()) is not None:
            takes += 1
            origin = batch.origin
            events.extend(batch.events)
        if (not events and not heartbeat) or self._socket is None:
            return False
        self.stats.batches_sent += takes
        skipped: list[str] = []
        open_sends = None
        if heartbeat and self._state is not None:
            try:
                open_sends = self._state(self.codec.room(origin))
            except Exception as exc:  # our bug, in the statement: the events still go
                self.stats.count(self.stats.dropped, "statement")
                self._warn_once("statement", "replica sync: a statement was not sent: %r", exc)
        try:
            datagrams = self.codec.encode(
                origin, self._seq, events, self._wall(), skipped=skipped, open_sends=open_sends
            )
        except ENCODE_ERRORS as exc:  # our bug, in the batch itself (its origin, a number)
            self.stats.count(self.stats.dropped, "unencodable")
            self._warn_once("unencodable", "replica sync: a batch was not sent: %s", exc)
            return takes == MAX_TAKES
        for problem in skipped:  # our bug, in one event: the others still go
            self.stats.count(self.stats.dropped, "unencodable_event")
            self._warn_once("unencodable_event", "replica sync: an event was not sent: %s", problem)
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
        if (addr[0], addr[1]) not in self._peer_set:
            self._reject("stranger", "replica sync: datagram from %s, not a peer", addr)
            return
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
        seqs = seq_window(last, batch.seq)
        if seqs is None:
            self._reject("replayed", "replica sync: batch %d of %s again or too old",
                         batch.seq, batch.origin)  # fmt: skip
            return
        if last is None and decoded.sent_at_ms < self._floor_ms:
            self._reject("before_start", "replica sync: batch %d of new origin %s predates "
                         "this replica's start (a replay, or its clock is behind)",
                         batch.seq, batch.origin)  # fmt: skip
            return
        self._last[batch.origin] = seqs
        self._last.move_to_end(batch.origin)
        while len(self._last) > self.max_origins:
            self._last.popitem(last=False)
            # (the forgotten origin's old datagrams must not pass as a new origin's)
            self._floor_ms = max(self._floor_ms, self._wall() - self.new_origin_skew_ms)
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
