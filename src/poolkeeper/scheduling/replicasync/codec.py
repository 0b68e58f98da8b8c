"""The wire form of a replica-sync `Batch`: versioned, compact, authenticated bytes.

Why its own format: one UDP datagram per batch (the transport, `transport.py`), read by peers
that trust nothing they cannot verify. Every datagram is

    magic "PKRS" | version u8 | sent_at_ms u64 | seq u64 | origin (u8 length, UTF-8)
    | event count u16 | events | HMAC-SHA256(key, everything before) (32 bytes)

big-endian, an event being `kind u8 | request id (u8 length, UTF-8)` and, for `Sent`,
`endpoint (u8 length) | tokens u32 | flags u8 | head (8 bytes, if flagged) | block count u16 |
blocks (8 bytes each)`; since version 2 the last event may be the origin's `Open` statement
(kind 4, counted among the events): `shift u8 | residue u32 | digest count u16 | digests (8
bytes each, unsigned)`, each digest in its slice (modulo `2**shift` equal to `residue`).
Hashes are 64-bit: unsigned unless flagged signed (engines' hashes may be negative), so a peer
gets back exactly the integers the origin holds. A request id longer than 255 bytes travels as a
digest of itself (the same for its `Sent`, `Answered` and `Ended`: peers only match them).
Nothing is parsed before the tag is verified (constant-time compare); every bound is checked;
any problem is a `Rejected` with one of `REASONS`, never another exception. A batch too big for
one datagram is split into several with consecutive sequence numbers (`encode`); its statement
rides the last.

Versions: this replica sends `VERSION` (2) and reads `VERSIONS` (1 and 2; version 1 had no
`Open`), so during a rolling upgrade from version 1 the upgraded replicas hear the old ones,
while the old ones reject the upgraded ones' datagrams as "version" (each side still routes;
the old ones only miss the new ones' sends until they are replaced too).

Keys: a `Codec` holds one or more keys (`MAX_KEYS`): the first signs, every one verifies, so a
key is rotated without a window in which replicas reject each other (docs/kubernetes.md);
`verified_old` counts datagrams verified by a key other than the first (0 for a while: every
replica signs with the new key, the old one can go).

Why datagrams are small (`max_bytes`, default `DEFAULT_DATAGRAM`): a datagram over the path's
MTU leaves as IP fragments, and losing any fragment loses it (some overlays drop fragmented
UDP outright); 1,232 bytes fits any IPv6 path (1,280-byte minimum MTU) and every common pod
overlay. A `Sent` whose blocks do not all fit one datagram keeps its first blocks (the prefix
a peer can match on) and loses the tail, like `MAX_BLOCKS` (counted in `Codec.trimmed`). The
receiver rejects anything over its `max_bytes` before computing the tag, so every replica of a
pool must use the same value.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from poolkeeper.scheduling.replicasync.events import (
    MAX_BLOCKS,
    Answered,
    Batch,
    Ended,
    Open,
    Sent,
    SyncEvent,
)

MAGIC: Final = b"PKRS"
VERSION: Final = 2
VERSIONS: Final = (1, 2)  # read (module docstring: rolling upgrades)
MAX_KEYS: Final = 4  # keys verified at once (a rotation needs 2)
MAX_SHIFT: Final = 32  # an `Open` slice's shift (the statement makes at most 16)
DEFAULT_DATAGRAM: Final = 1_232  # bytes: unfragmented on any IPv6 path (module docstring)
MIN_DATAGRAM: Final = 1_024  # a Sent with the longest names and a few blocks still fits
MAX_DATAGRAM: Final = 65_000  # under the 65,507-byte IPv4 UDP payload
MIN_KEY_BYTES: Final = 16
TAG_BYTES: Final = 32
MAX_ID_BYTES: Final = 255
_HEAD = struct.Struct(">4sBQQ")  # magic, version, sent_at_ms, seq
_U8, _U16, _U32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")
_KIND = {Sent: 1, Answered: 2, Ended: 3}
_OPEN = 4
_OPEN_HEAD = struct.Struct(">BBIH")  # kind, shift, residue, digest count
_SEEN, _HAS_HEAD, _HEAD_SIGNED, _BLOCKS_SIGNED = 1, 2, 4, 8
_FLAGS = _SEEN | _HAS_HEAD | _HEAD_SIGNED | _BLOCKS_SIGNED
# What encoding something the format cannot carry raises (a bad field or a non-event: our bug,
# never a peer's); the transport catches these, so it costs that event or batch only.
ENCODE_ERRORS: Final = (
    ValueError, TypeError, KeyError, AttributeError, OverflowError, struct.error
)  # fmt: skip
_MIN = _HEAD.size + 1 + 1 + _U16.size + TAG_BYTES  # an origin of one byte, no events

Reason = Literal["short", "oversized", "magic", "version", "auth", "malformed"]
REASONS: Final[tuple[Reason, ...]] = ("short", "oversized", "magic", "version", "auth", "malformed")


class Rejected(ValueError):
    """A datagram that is not a batch of ours: `reason` (one of `REASONS`, a metric label)."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: Reason = reason


@dataclass(frozen=True, slots=True)
class Decoded:
    batch: Batch
    sent_at_ms: int  # the origin's wall clock when it encoded the batch (freshness)


def wire_id(request_id: str) -> bytes:
    """`request_id` as it travels: its UTF-8, or a digest of it when longer than a length byte
    allows (deterministic, so a peer still pairs the request's events)."""
    raw = request_id.encode()
    if len(raw) <= MAX_ID_BYTES:
        return raw
    return b"#" + hashlib.blake2b(raw, digest_size=24).hexdigest().encode()


def _text(value: str, what: str) -> bytes:
    raw = value.encode()
    if not 0 < len(raw) <= MAX_ID_BYTES:
        raise ValueError(f"{what} must be 1-{MAX_ID_BYTES} bytes of UTF-8, not {len(raw)}")
    return raw


def _hashes(values: Sequence[int]) -> tuple[bytes, bool]:
    """8 bytes per hash, and whether they are signed (all must fit one of the two ranges)."""
    if all(0 <= v < 1 << 64 for v in values):
        return struct.pack(f">{len(values)}Q", *values), False
    if all(-(1 << 63) <= v < 1 << 63 for v in values):
        return struct.pack(f">{len(values)}q", *values), True
    raise ValueError("block hashes must all be unsigned or all signed 64-bit integers")


def _event(event: SyncEvent, room: int) -> tuple[bytes, bool]:
    """`event` as bytes, and whether its blocks were cut to fit `room` bytes."""
    rid = wire_id(event.request_id)
    if not rid:
        raise ValueError("empty request id")
    head = _U8.pack(_KIND[type(event)]) + _U8.pack(len(rid)) + rid
    if not isinstance(event, Sent):
        return head, False
    if len(event.blocks) > MAX_BLOCKS:
        raise ValueError(f"{len(event.blocks)} blocks, at most {MAX_BLOCKS}")
    if not 0 <= event.tokens < 1 << 32:
        raise ValueError(f"tokens {event.tokens} out of range")
    endpoint = _text(event.endpoint, "endpoint")
    blocks, signed = _hashes(event.blocks)
    flags = (_SEEN if event.seen else 0) | (_BLOCKS_SIGNED if signed else 0)
    first = b""
    if event.head is not None:
        first, head_signed = _hashes((event.head,))
        flags |= _HAS_HEAD | (_HEAD_SIGNED if head_signed else 0)
    parts = (_U8.pack(len(endpoint)), endpoint, _U32.pack(event.tokens), _U8.pack(flags), first)
    raw = head + b"".join(parts)
    fits = (room - len(raw) - _U16.size) // 8
    if fits < 0:
        raise ValueError(f"a Sent of {len(raw)} bytes without blocks exceeds {room}")
    count = min(len(event.blocks), fits)
    return raw + _U16.pack(count) + blocks[: 8 * count], count < len(event.blocks)


def _open(statement: Open) -> bytes:
    if not 0 <= statement.shift <= MAX_SHIFT:
        raise ValueError(f"Open shift {statement.shift} out of 0-{MAX_SHIFT}")
    mask = (1 << statement.shift) - 1
    if not 0 <= statement.residue <= mask:
        raise ValueError(f"Open residue {statement.residue} out of its {mask + 1} slices")
    if any(v & mask != statement.residue for v in statement.digests):
        raise ValueError("an Open digest outside its slice")
    values = sorted(statement.digests)
    raw, signed = _hashes(values)
    if signed:
        raise ValueError("Open digests must be unsigned 64-bit integers")
    head = _OPEN_HEAD.pack(_OPEN, statement.shift, statement.residue, len(values))
    return head + raw


class Codec:
    """Batches to datagrams and back under shared keys (each at least `MIN_KEY_BYTES`, at
    most `MAX_KEYS`): the first signs, all verify (the module docstring)."""

    def __init__(self, keys: bytes | Sequence[bytes], *, max_bytes: int = DEFAULT_DATAGRAM) -> None:
        keys = [keys] if isinstance(keys, bytes) else list(keys)
        if not 1 <= len(keys) <= MAX_KEYS:
            raise ValueError(f"1-{MAX_KEYS} sync keys, not {len(keys)}")
        if any(len(key) < MIN_KEY_BYTES for key in keys):
            raise ValueError(f"the sync key must be at least {MIN_KEY_BYTES} bytes")
        if not MIN_DATAGRAM <= max_bytes <= MAX_DATAGRAM:
            raise ValueError(f"max_bytes must be {MIN_DATAGRAM}-{MAX_DATAGRAM}, not {max_bytes}")
        self._macs = [hmac.new(key, digestmod=hashlib.sha256) for key in keys]
        self.max_bytes = max_bytes
        self.trimmed = 0  # Sents sent without their blocks' tail (monotonic)
        self.verified_old = 0  # datagrams verified by a key other than the first (rotation)

    def _tag(self, body: bytes, key: int = 0) -> bytes:
        """`body`'s tag under key `key` (the first signs)."""
        mac = self._macs[key].copy()
        mac.update(body)
        return mac.digest()

    def _verify(self, body: bytes, tag: bytes) -> bool:
        # Every key is tried (no early exit): the time spent does not say which one matched.
        matched = [hmac.compare_digest(self._tag(body, i), tag) for i in range(len(self._macs))]
        if matched[0]:
            return True
        if any(matched):
            self.verified_old += 1
            return True
        return False

    def room(self, origin: str) -> int:
        """How many `Open` digests fit one datagram from `origin` beside nothing else."""
        fixed = _HEAD.size + 1 + len(_text(origin, "origin")) + _U16.size + TAG_BYTES
        return (self.max_bytes - fixed - _OPEN_HEAD.size) // 8

    def encode(
        self,
        origin: str,
        seq: int,
        events: Sequence[SyncEvent],
        sent_at_ms: int,
        *,
        skipped: list[str] | None = None,
        open_sends: Open | None = None,
    ) -> list[bytes]:
        """`events` from `origin` as datagrams numbered `seq`, `seq + 1`, ... (one unless they
        do not fit `max_bytes`), `open_sends` in the last (a datagram of its own when it does
        not fit beside the events; ValueError when it does not fit one at all: `room`). What
        the format cannot carry (an empty or over-long origin or endpoint, too many blocks, an
        out-of-range number or a wrong type: our bug, not a peer's) raises
        ValueError; given `skipped`, such an event is left out instead and its problem appended
        there (one bad event costs only itself)."""
        name = _text(origin, "origin")
        fixed = _HEAD.size + 1 + len(name) + _U16.size + TAG_BYTES
        chunks: list[list[bytes]] = [[]]
        size = fixed
        for event in events:
            try:
                raw, cut = _event(event, self.max_bytes - fixed)
            except ENCODE_ERRORS as exc:
                if skipped is None:
                    raise ValueError(f"{type(exc).__name__}: {exc}") from exc
                skipped.append(f"{type(event).__name__}: {type(exc).__name__}: {exc}")
                continue
            self.trimmed += cut
            if fixed + len(raw) > self.max_bytes:
                # (only a request id or origin near 255 bytes with no room left at all)
                if skipped is None:
                    raise ValueError(f"one event of {len(raw)} bytes exceeds {self.max_bytes}")
                skipped.append(f"one event of {len(raw)} bytes exceeds {self.max_bytes}")
                continue
            if size + len(raw) > self.max_bytes or len(chunks[-1]) == 0xFFFF:
                chunks.append([])
                size = fixed
            chunks[-1].append(raw)
            size += len(raw)
        if events and not chunks[0]:
            if open_sends is None:
                return []  # every event was skipped
            chunks, size = [[]], fixed
        if open_sends is not None:
            raw = _open(open_sends)
            if fixed + len(raw) > self.max_bytes:
                raise ValueError(f"an Open of {len(open_sends.digests)} digests exceeds "
                                 f"{self.max_bytes} bytes")  # fmt: skip
            if size + len(raw) > self.max_bytes or len(chunks[-1]) == 0xFFFF:
                chunks.append([])
            chunks[-1].append(raw)
        out = []
        for i, chunk in enumerate(chunks):
            body = b"".join(
                (_HEAD.pack(MAGIC, VERSION, sent_at_ms, seq + i), _U8.pack(len(name)), name,
                 _U16.pack(len(chunk)), *chunk)
            )  # fmt: skip
            out.append(body + self._tag(body))
        return out

    def decode(self, data: bytes) -> Decoded:
        """The batch in one datagram, verified; `Rejected` with its reason otherwise."""
        if len(data) > self.max_bytes:
            raise Rejected("oversized", f"{len(data)} bytes, at most {self.max_bytes}")
        if len(data) < _MIN:
            raise Rejected("short", f"{len(data)} bytes, at least {_MIN}")
        magic, version, sent_at_ms, seq = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise Rejected("magic", "not a replica-sync datagram")
        if version not in VERSIONS:
            raise Rejected(
                "version",
                f"version {version}, this replica reads versions {VERSIONS[0]}-{VERSIONS[-1]}",
            )
        body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if not self._verify(body, tag):
            raise Rejected("auth", "the tag does not match any shared key")
        try:
            return Decoded(_Reader(body, _HEAD.size, version).batch(seq), sent_at_ms)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise Rejected("malformed", f"truncated or invalid field ({exc})") from None


class _Reader:
    """Bounds-checked reads from an authenticated body (any overrun raises struct.error)."""

    def __init__(self, data: bytes, at: int, version: int) -> None:
        self.data, self.at, self.version = data, at, version

    def _take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise struct.error(f"{n} bytes wanted at {self.at} of {len(self.data)}")
        raw = self.data[self.at : self.at + n]
        self.at += n
        return raw

    def _num(self, fmt: struct.Struct) -> int:
        (value,) = fmt.unpack(self._take(fmt.size))
        return int(value)

    def _text(self, what: str) -> str:
        n = self._num(_U8)
        if n == 0:
            raise Rejected("malformed", f"empty {what}")
        return self._take(n).decode()

    def _hashes(self, n: int, signed: bool) -> tuple[int, ...]:
        return struct.unpack(f">{n}{'q' if signed else 'Q'}", self._take(8 * n))

    def batch(self, seq: int) -> Batch:
        origin = self._text("origin")
        count = self._num(_U16)
        events: list[SyncEvent] = []
        statement: Open | None = None
        for i in range(count):
            kind = self._num(_U8)
            if kind != _OPEN:
                events.append(self._event(kind))
            elif self.version < 2:
                raise Rejected("malformed", f"event kind {_OPEN} (Open) in version {self.version}")
            elif i != count - 1:
                raise Rejected("malformed", "an Open statement before the last event")
            else:
                statement = self._open()
        if self.at != len(self.data):
            raise Rejected("malformed", f"{len(self.data) - self.at} bytes after the events")
        return Batch(origin, seq, tuple(events), statement)

    def _open(self) -> Open:
        shift = self._num(_U8)
        residue = self._num(_U32)
        if shift > MAX_SHIFT or residue >> shift:
            raise Rejected("malformed", f"Open slice {residue} of 2**{shift}")
        digests = self._hashes(self._num(_U16), False)
        mask = (1 << shift) - 1
        if any(v & mask != residue for v in digests):
            raise Rejected("malformed", "an Open digest outside its slice")
        return Open(shift, residue, frozenset(digests))

    def _event(self, kind: int) -> SyncEvent:
        rid = self._text("request id")
        if kind == 2:
            return Answered(rid)
        if kind == 3:
            return Ended(rid)
        if kind != 1:
            raise Rejected("malformed", f"unknown event kind {kind}")
        endpoint = self._text("endpoint")
        tokens, flags = self._num(_U32), self._num(_U8)
        if flags & ~_FLAGS:
            raise Rejected("malformed", f"unknown flags {flags:#x}")
        head = self._hashes(1, bool(flags & _HEAD_SIGNED))[0] if flags & _HAS_HEAD else None
        count = self._num(_U16)
        if count > MAX_BLOCKS:
            raise Rejected("malformed", f"{count} blocks, at most {MAX_BLOCKS}")
        blocks = self._hashes(count, bool(flags & _BLOCKS_SIGNED))
        return Sent(rid, endpoint, tokens, bool(flags & _SEEN), blocks, head)
