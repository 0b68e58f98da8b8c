"""The wire form of a replica-sync `Batch`: versioned, compact, authenticated bytes.

Why its own format: one UDP datagram per batch (the transport, `transport.py`), read by peers
that trust nothing they cannot verify. Every datagram is

    magic "PKRS" | version u8 | sent_at_ms u64 | seq u64 | origin (u8 length, UTF-8)
    | event count u16 | events | HMAC-SHA256(key, everything before) (32 bytes)

big-endian, an event being `kind u8 | request id (u8 length, UTF-8)` and, for `Sent`,
`endpoint (u8 length) | tokens u32 | flags u8 | head (8 bytes, if flagged) | block count u16 |
blocks (8 bytes each)`. Hashes are 64-bit: unsigned unless flagged signed (engines' hashes may
be negative), so a peer gets back exactly the integers the origin holds. A request id longer
than 255 bytes travels as a digest of itself (the same for its `Sent`, `Answered` and `Ended`:
peers only match them). Nothing is parsed before the tag is verified (constant-time compare);
every bound is checked; any problem is a `Rejected` with one of `REASONS`, never another
exception. A batch too big for one datagram is split into several with consecutive sequence
numbers (`encode`).

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
    Sent,
    SyncEvent,
)

MAGIC: Final = b"PKRS"
VERSION: Final = 1
DEFAULT_DATAGRAM: Final = 1_232  # bytes: unfragmented on any IPv6 path (module docstring)
MIN_DATAGRAM: Final = 1_024  # a Sent with the longest names and a few blocks still fits
MAX_DATAGRAM: Final = 65_000  # under the 65,507-byte IPv4 UDP payload
MIN_KEY_BYTES: Final = 16
TAG_BYTES: Final = 32
MAX_ID_BYTES: Final = 255
_HEAD = struct.Struct(">4sBQQ")  # magic, version, sent_at_ms, seq
_U8, _U16, _U32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")
_KIND = {Sent: 1, Answered: 2, Ended: 3}
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


class Codec:
    """Batches to datagrams and back under one shared key (at least `MIN_KEY_BYTES`)."""

    def __init__(self, key: bytes, *, max_bytes: int = DEFAULT_DATAGRAM) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the sync key must be at least {MIN_KEY_BYTES} bytes")
        if not MIN_DATAGRAM <= max_bytes <= MAX_DATAGRAM:
            raise ValueError(f"max_bytes must be {MIN_DATAGRAM}-{MAX_DATAGRAM}, not {max_bytes}")
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self.max_bytes = max_bytes
        self.trimmed = 0  # Sents sent without their blocks' tail (monotonic)

    def _tag(self, body: bytes) -> bytes:
        mac = self._mac.copy()
        mac.update(body)
        return mac.digest()

    def encode(
        self,
        origin: str,
        seq: int,
        events: Sequence[SyncEvent],
        sent_at_ms: int,
        *,
        skipped: list[str] | None = None,
    ) -> list[bytes]:
        """`events` from `origin` as datagrams numbered `seq`, `seq + 1`, ... (one unless they
        do not fit `max_bytes`). What the format cannot carry (an empty or over-long origin or
        endpoint, too many blocks, an out-of-range number or a wrong type: our bug, not a
        peer's) raises ValueError; given `skipped`, such an event is left out instead and its
        problem appended there (one bad event costs only itself)."""
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
            return []  # every event was skipped
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
        if version != VERSION:
            raise Rejected("version", f"version {version}, this replica reads {VERSION}")
        body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if not hmac.compare_digest(self._tag(body), tag):
            raise Rejected("auth", "the tag does not match the shared key")
        try:
            return Decoded(_Reader(body, _HEAD.size).batch(seq), sent_at_ms)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise Rejected("malformed", f"truncated or invalid field ({exc})") from None


class _Reader:
    """Bounds-checked reads from an authenticated body (any overrun raises struct.error)."""

    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at

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
        events = tuple(self._event() for _ in range(self._num(_U16)))
        if self.at != len(self.data):
            raise Rejected("malformed", f"{len(self.data) - self.at} bytes after the events")
        return Batch(origin, seq, events)

    def _event(self) -> SyncEvent:
        kind = self._num(_U8)
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
