"""`ReplicaSync`: one EPP replica's end of cross-replica sync, pure and synchronous.

Owns the bookkeeping between this replica's scheduler state and the transport (the edge:
codec, UDP, discovery, in this package's other modules), and nothing else:

- `publish(event)`: this replica's own `Sent` / `Answered` / `Ended` (events.py), in a bounded
  outbox (`max_outbox`; when full the oldest is dropped and counted in `dropped`: a stalled
  transport must not grow memory);
- `take()`: the events published since the last take as the next `Batch` (`seq` + 1), or
  None when there are none;
- `statement(room)`: this replica's open sends (`bind_open`: the fold's published and not yet
  closed sends, `ownopen.py`) as an `Open` of at most `room` digests (`openset.py`); the
  transport sends one every `reconcileIntervalMs`, which is also the heartbeat (`deliver`
  counts it as its origin heard, so a replica with only long requests in flight is not
  expired);
- `deliver(batch, now)`: a peer's batch. Refused (False) when its origin is this replica's, or
  its `seq` was seen from that origin already or is `SEQ_WINDOW` or more behind the newest seen
  (`seq_window`: a replay), or it is a new origin while `max_peers` origins are live. A gap is
  fine and a reordered datagram within the window is taken (UDP loses and reorders datagrams).
  Otherwise each event goes to every bound `PeerSink` (the fold into the scheduler's state,
  `fold.py`), in order; then, with the batch's `Open` statement, the origin's sends it no
  longer covers (their `Answered` or `Ended` was lost) go to the sinks as `Ended` and are
  counted in `reconciled` (`openset.OpenTracker` says which, never one sent after the
  statement);
- `expire(now)`: an origin heard from last `peer_ttl_s` ago or earlier is forgotten, and the
  sinks drop what it sent (`PeerSink.peer_gone`): a replica that died with requests in flight
  must not hold their backlog for ever. Forgetting its last `seq` also lets a restarted replica
  that reuses its name be heard again (after the TTL; an origin name with a boot nonce is heard
  at once). `deliver` expires first.

Memory: the outbox holds at most `max_outbox` events, the origin table `max_peers` entries,
the tracker of peers' open sends `openset.MAX_TRACKED`;
what a peer's events add to the scheduler's state is bounded by that state's own caps
(`fold.py`). Time is passed in; nothing here reads a clock or does I/O.

Wiring (the composition root; `fold.bind_scheduler` has the rest):

    sync = ReplicaSync(origin)                  # origin: unique per replica process
    fold = bind_scheduler(sync, scheduler, clock=clock)  # own -> publish, peers -> the state
                                                # (no clock: no open statement is made)
    ... every `interval` (or at once per decision): batch = sync.take(); if batch: send it
    ... on a datagram from a peer: if sync.deliver(batch, now) and clears(batch): wake flow
        control's pump (a peer's prefill ended: the hold reads a backlog that just shrank;
        measured in docs/notes/2026-12-07-replica-sync.md)
    ... on pool changes, beside scheduler.forget_endpoints(keep): fold.forget_endpoints(keep)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from poolkeeper.scheduling.replicasync.events import Batch, Ended, Open, Sent, SyncEvent
from poolkeeper.scheduling.replicasync.openset import OpenTracker, statement

SEQ_WINDOW = 64  # a reordered batch this many seqs behind the newest is still taken
MAX_OUTBOX = 4096  # own events waiting for `take` (a few seconds of a busy replica)
MAX_PEERS = 64  # origins heard at once
PEER_TTL_S = 30.0  # an origin silent this long is gone (its entries stop counting)


def clears(batch: Batch) -> bool:
    """Whether `batch` ends some request's prefill (an `Answered` or `Ended`): delivered, it
    shrinks the backlog flow control's hold reads, so the pump should run."""
    return any(not isinstance(event, Sent) for event in batch.events)


SeqState = tuple[int, int]  # (newest seq seen, bit i set: seq newest - i seen too)


def seq_window(state: SeqState | None, seq: int) -> SeqState | None:
    """The origin's state after taking `seq`, or None when `seq` is a replay: seen already,
    or `SEQ_WINDOW` or more behind the newest (too old to tell). The transport and the hub
    both use it, so they refuse the same batches."""
    if state is None:
        return (seq, 1)
    newest, seen = state
    if seq > newest:
        shift = seq - newest
        return (seq, ((seen << shift) | 1) & _FULL) if shift < SEQ_WINDOW else (seq, 1)
    behind = newest - seq
    if behind >= SEQ_WINDOW or (seen >> behind) & 1:
        return None
    return (newest, seen | (1 << behind))


_FULL = (1 << SEQ_WINDOW) - 1


class PeerSink(Protocol):
    """Where a peer's events go: the fold into one scheduler's state (`fold.py`)."""

    def fold(self, origin: str, event: SyncEvent, now: float) -> None: ...

    def peer_gone(self, origin: str) -> None: ...


class ReplicaSync:
    """One replica's outbox, sequence numbers and peer table (the module docstring)."""

    __slots__ = (
        "_heard", "_last_seq", "_open_source", "_outbox", "_seq", "_sinks", "_tracker",
        "_turn", "dropped", "max_outbox", "max_peers", "origin", "peer_ttl_s", "reconciled",
        "refused",
    )  # fmt: skip

    def __init__(
        self,
        origin: str,
        *,
        max_outbox: int = MAX_OUTBOX,
        max_peers: int = MAX_PEERS,
        peer_ttl_s: float = PEER_TTL_S,
    ) -> None:
        if not origin:
            raise ValueError("origin must be a non-empty name")
        if max_outbox < 1 or max_peers < 1 or not peer_ttl_s > 0.0:
            raise ValueError("max_outbox, max_peers and peer_ttl_s must be positive")
        self.origin = origin
        self.max_outbox = max_outbox
        self.max_peers = max_peers
        self.peer_ttl_s = peer_ttl_s
        self._outbox: deque[SyncEvent] = deque(maxlen=max_outbox)
        self._seq = 0
        self._last_seq: dict[str, SeqState] = {}  # origin -> the seqs delivered (`seq_window`)
        self._heard: dict[str, float] = {}  # origin -> when, in time order (oldest first)
        self._sinks: list[PeerSink] = []
        self._open_source: Callable[[], Iterable[int]] | None = None
        self._turn = 0  # statements made (picks the slice when one datagram cannot hold all)
        self._tracker = OpenTracker()
        self.dropped = 0  # own events dropped from a full outbox
        self.refused = 0  # peer batches refused (replayed, stale, own, or too many origins)
        self.reconciled = 0  # peers' sends dropped because their statement no longer had them

    def bind(self, sink: PeerSink) -> None:
        """Fold peers' events into `sink` from now on (`fold.bind_scheduler` calls it)."""
        self._sinks.append(sink)

    def bind_open(self, source: Callable[[], Iterable[int]]) -> None:
        """`source()`: the digests of this replica's open sends (`openset.digest` of each id
        published and not yet closed) for `statement` (`fold.bind_scheduler` binds it;
        unbound, no statement is made)."""
        self._open_source = source

    def statement(self, room: int) -> Open | None:
        """This replica's open sends now, at most `room` digests (a rotating slice when they do
        not fit); None without a bound source (openset.py)."""
        if self._open_source is None:
            return None
        self._turn += 1
        return statement(self._open_source(), room, self._turn)

    @property
    def tracked(self) -> int:
        """Peers' open sends tracked for their statements."""
        return len(self._tracker)

    def publish(self, event: SyncEvent) -> None:
        """One of this replica's own events, to go out with the next `take`."""
        if len(self._outbox) == self.max_outbox:
            self.dropped += 1  # the deque drops the oldest
        self._outbox.append(event)

    def take(self) -> Batch | None:
        """The events published since the last take, as the next batch; None if none."""
        if not self._outbox:
            return None
        self._seq += 1
        events = tuple(self._outbox)
        self._outbox.clear()
        return Batch(self.origin, self._seq, events)

    @property
    def pending(self) -> int:
        """Own events waiting for `take`."""
        return len(self._outbox)

    def peers(self) -> list[str]:
        """Origins heard within `peer_ttl_s` (as of the last `deliver` or `expire`)."""
        return list(self._heard)

    def deliver(self, batch: Batch, now: float) -> bool:
        """Fold a peer's batch into the bound sinks; False if it was refused (docstring)."""
        self.expire(now)
        origin = batch.origin
        last = self._last_seq.get(origin)
        seqs = seq_window(last, batch.seq)
        if (
            origin == self.origin
            or seqs is None
            or (last is None and len(self._last_seq) >= self.max_peers)
        ):
            self.refused += 1
            return False
        self._last_seq[origin] = seqs
        self._heard.pop(origin, None)
        self._heard[origin] = now  # last: the table stays in time order
        tracker = self._tracker
        for event in batch.events:
            if isinstance(event, Sent):
                tracker.sent(origin, event.request_id, batch.seq)
            else:
                tracker.closed(origin, event.request_id)
            for sink in self._sinks:
                sink.fold(origin, event, now)
        if batch.open is not None:
            for request_id in tracker.stale(origin, batch.seq, batch.open):
                self.reconciled += 1
                for sink in self._sinks:
                    sink.fold(origin, Ended(request_id), now)
        return True

    def expire(self, now: float) -> list[str]:
        """Forget the origins silent for `peer_ttl_s` or longer; returns them."""
        gone: list[str] = []
        horizon = now - self.peer_ttl_s
        heard = self._heard
        while heard and (oldest := next(iter(heard.items())))[1] <= horizon:
            origin = oldest[0]
            del heard[origin]
            del self._last_seq[origin]
            self._tracker.forget(origin)
            gone.append(origin)
            for sink in self._sinks:
                sink.peer_gone(origin)
        return gone
