"""Open statements: a sender states its open sends, a receiver drops what they no longer cover.

Why: sync rides UDP, so an `Answered` or `Ended` can be lost; its entry would then stay in every
peer's prefill backlog (a phantom: a server looks busier than it is) until the backlog's age
limit, 60 s. So every `reconcileIntervalMs` each replica sends an `Open` statement (events.py)
with the digests of the request ids it published and has not closed, and a receiver drops that
origin's entries that the statement no longer lists: a phantom lives one statement interval,
not 60 s.

Exact, not a guess from gaps or ages, and never a false drop under reordering:

- the sender builds the statement at the moment it sends (`statement`) from what it published
  and has not closed (`ownopen.py`: not from its backlog, which may drop an own entry silently):
  an id missing from it was closed (its `Answered` or `Ended` published, or the open set's age
  or size limits, the backlog's) before that datagram left;
- the receiver records the `seq` of the batch each peer `Sent` came in (`OpenTracker`) and judges
  only entries whose `Sent` came in the statement's batch or before: a `Sent` in a later batch
  that arrives first (reordered) is newer than the statement and is kept;
- what the receiver never heard (a lost `Sent`) is simply not there; a statement listing more
  than the receiver holds drops nothing.

Bounded to one datagram: the digests are 64-bit (`digest`: xxhash64 of the id as it travels);
when they do not all fit (`room`), the statement covers one slice of them, those whose digest
modulo `2**shift` is `residue`, and the slices rotate from statement to statement, so an open
set of n ids is covered in about `n / room` statements (rounded up to a power of two; `room` is
about 140 at the default 1,232-byte datagram). A receiver files each origin's sends by their
digest's low bits (`BUCKET_BITS`), so a statement costs the slice it covers, not every send
tracked. It tracks at most `max_tracked` peer sends (the backlog's own default cap), shared
fairly: when full, the origin holding the most gives up its oldest; one given up still ages
out in the backlog.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from poolkeeper.scheduling.replicasync.events import Open
from poolkeeper.scheduling.replicasync.wire import wire_id

MAX_SHIFT = 16  # at most 65,536 slices: far more open sends than any backlog holds
MAX_TRACKED = 65_536  # peers' open sends a receiver tracks (the backlog's default cap)
BUCKET_BITS = 8  # a receiver files each origin's sends by this many low bits of their digest
_BUCKET_MASK = (1 << BUCKET_BITS) - 1


def digest(request_id: str) -> int:
    """The id's 64-bit digest, the same on both ends: of its wire form (codec.wire_id), which
    is what a receiver gets, and which a receiver's id already is."""
    return int(xxhash.xxh64_intdigest(wire_id(request_id)))


def covers(statement: Open, value: int) -> bool:
    """Whether `value` (a digest) is in the slice `statement` speaks for."""
    return value & ((1 << statement.shift) - 1) == statement.residue


def statement(open_digests: Iterable[int], room: int, turn: int) -> Open | None:
    """The statement of the open sends' digests (`digest`, computed once per send at publish:
    `ownopen.py`) for the `turn`-th time: all of them if they fit `room`, else the slice
    `turn` picks among the fewest slices that make it fit. None only when even `MAX_SHIFT`
    slices leave one too big (never at a backlog's sizes)."""
    if room < 1:
        raise ValueError(f"room must be >= 1 digests, not {room}")
    values = set(open_digests)
    shift = 0
    while (len(values) >> shift) > room:  # the fewest slices that fit on average
        shift += 1
    while shift <= MAX_SHIFT:
        mask = (1 << shift) - 1
        residue = turn & mask
        part = frozenset(v for v in values if v & mask == residue)
        if len(part) <= room:
            return Open(shift, residue, part)
        shift += 1
    return None


class _Sends:
    """One origin's tracked sends: request id -> (seq of its `Sent`'s batch, digest), oldest
    first, and the same ids by their digest's low `BUCKET_BITS` (a statement's slice is a
    set of these buckets, so `stale` reads only the covered ones)."""

    __slots__ = ("buckets", "order")

    def __init__(self) -> None:
        self.order: dict[str, tuple[int, int]] = {}
        self.buckets: dict[int, dict[str, None]] = {}  # (dicts: a stable order, unlike sets)

    def __len__(self) -> int:
        return len(self.order)

    def add(self, request_id: str, seq: int, value: int) -> None:
        self.order[request_id] = (seq, value)
        self.buckets.setdefault(value & _BUCKET_MASK, {})[request_id] = None

    def pop(self, request_id: str) -> bool:
        found = self.order.pop(request_id, None)
        if found is None:
            return False
        bucket = found[1] & _BUCKET_MASK
        ids = self.buckets[bucket]
        del ids[request_id]
        if not ids:
            del self.buckets[bucket]
        return True

    def covered(self, statement: Open) -> list[dict[str, None]]:
        """The buckets that hold every tracked id `statement`'s slice may cover."""
        shift, residue = statement.shift, statement.residue
        if shift >= BUCKET_BITS:
            found = self.buckets.get(residue & _BUCKET_MASK)
            return [] if found is None else [found]
        buckets = self.buckets
        return [buckets[b] for b in range(residue, 1 << BUCKET_BITS, 1 << shift) if b in buckets]


class OpenTracker:
    """A receiver's record of each origin's open sends (`_Sends`), at most `max_tracked` in
    all. When full, the origin that holds the most gives up its oldest (the sender's own when
    it is among the largest): a busy origin cannot keep a new one from being tracked, and
    each converges to an equal share."""

    __slots__ = ("_by_origin", "_count", "max_tracked", "untracked")

    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        if max_tracked < 1:
            raise ValueError("max_tracked must be >= 1")
        self.max_tracked = max_tracked
        self._by_origin: dict[str, _Sends] = {}
        self._count = 0
        self.untracked = 0  # peers' sends given up (the cap); they age out in the backlog

    def __len__(self) -> int:
        return self._count

    def tracked(self, origin: str) -> int:
        """How many of `origin`'s sends are tracked."""
        sends = self._by_origin.get(origin)
        return 0 if sends is None else len(sends)

    def sent(self, origin: str, request_id: str, seq: int) -> None:
        sends = self._by_origin.get(origin)
        if sends is None:
            sends = self._by_origin[origin] = _Sends()
        if sends.pop(request_id):
            self._count -= 1  # a reused id: the newest send counts
        if self._count >= self.max_tracked:
            largest = max(self._by_origin.values(), key=len)
            victim = sends if len(sends) >= len(largest) else largest
            victim.pop(next(iter(victim.order)))  # (full: the largest holds at least one)
            self._count -= 1
            self.untracked += 1
        sends.add(request_id, seq, digest(request_id))
        self._count += 1

    def closed(self, origin: str, request_id: str) -> None:
        sends = self._by_origin.get(origin)
        if sends is not None and sends.pop(request_id):
            self._count -= 1

    def stale(self, origin: str, seq: int, open_sends: Open) -> list[str]:
        """The ids `origin` sent in batch `seq` or before that its statement in batch `seq`
        no longer lists (now forgotten here): the caller drops their entries. Reads only the
        buckets the statement's slice covers."""
        sends = self._by_origin.get(origin)
        if not sends:
            return []
        listed, order = open_sends.digests, sends.order
        gone = []
        for bucket in sends.covered(open_sends):
            for rid in bucket:
                at, value = order[rid]
                if at <= seq and value not in listed and covers(open_sends, value):
                    gone.append(rid)
        for rid in gone:
            sends.pop(rid)
        self._count -= len(gone)
        return gone

    def forget(self, origin: str) -> None:
        """The origin went quiet: its sends are dropped with it."""
        sends = self._by_origin.pop(origin, None)
        if sends is not None:
            self._count -= len(sends)
