"""The replica-sync wire format: its layout, constants and reasons, and the reading of a verified
body (`Reader`). `codec.py` writes it, signs it and verifies a datagram's tag before handing the
body here.

Every datagram is

    magic "PKRS" | version u8 | sent_at_ms u64 | seq u64 | origin (u8 length, UTF-8)
    | event count u16 | events | HMAC-SHA256(key, everything before) (32 bytes)

big-endian, an event being `kind u8 | request id (u8 length, UTF-8)` and, for `Sent`,
`endpoint (u8 length) | tokens u32 | flags u8 | head (8 bytes, if flagged) | block count u16 |
blocks (8 bytes each)`; since version 2 the last event may be the origin's `Open` statement
(kind 4, counted among the events): `shift u8 | residue u32 | digest count u16 | digests (8
bytes each, unsigned)`, each digest in its slice (modulo `2**shift` equal to `residue`).
Hashes are 64-bit: unsigned unless flagged signed (engines' hashes may be negative), so a peer
gets back exactly the integers the origin holds. A request id longer than 255 bytes travels as a
digest of itself (`wire_id`: the same for its `Sent`, `Answered` and `Ended`: peers only match
them). Every bound is checked; any problem is a `Rejected` with one of `REASONS`, never another
exception.

Versions: this replica sends `VERSION` (2) and reads `VERSIONS` (1 and 2; version 1 had no
`Open`), so during a rolling upgrade from version 1 the upgraded replicas hear the old ones,
while the old ones reject the upgraded ones' datagrams as "version" (each side still routes;
the old ones only miss the new ones' sends until they are replaced too).
"""

from __future__ import annotations

import hashlib
import struct
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
MAX_SHIFT: Final = 32  # an `Open` slice's shift (the statement makes at most 16)
DEFAULT_DATAGRAM: Final = 1_232  # bytes: unfragmented on any IPv6 path (codec.py)
MIN_DATAGRAM: Final = 1_024  # a Sent with the longest names and a few blocks still fits
MAX_DATAGRAM: Final = 65_000  # under the 65,507-byte IPv4 UDP payload
TAG_BYTES: Final = 32
MAX_ID_BYTES: Final = 255
HEAD: Final = struct.Struct(">4sBQQ")  # magic, version, sent_at_ms, seq
U8: Final = struct.Struct(">B")
U16: Final = struct.Struct(">H")
U32: Final = struct.Struct(">I")
KIND: Final = {Sent: 1, Answered: 2, Ended: 3}
OPEN: Final = 4
OPEN_HEAD: Final = struct.Struct(">BBIH")  # kind, shift, residue, digest count
SEEN, HAS_HEAD, HEAD_SIGNED, BLOCKS_SIGNED = 1, 2, 4, 8
FLAGS: Final = SEEN | HAS_HEAD | HEAD_SIGNED | BLOCKS_SIGNED
MIN_BYTES: Final = HEAD.size + 1 + 1 + U16.size + TAG_BYTES  # an origin of one byte, no events

Reason = Literal["short", "oversized", "magic", "version", "auth", "malformed"]
REASONS: Final[tuple[Reason, ...]] = ("short", "oversized", "magic", "version", "auth", "malformed")


class Rejected(ValueError):
    """A datagram that is not a batch of ours: `reason` (one of `REASONS`, a metric label)."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: Reason = reason


def wire_id(request_id: str) -> bytes:
    """`request_id` as it travels: its UTF-8, or a digest of it when longer than a length byte
    allows (deterministic, so a peer still pairs the request's events)."""
    raw = request_id.encode()
    if len(raw) <= MAX_ID_BYTES:
        return raw
    return b"#" + hashlib.blake2b(raw, digest_size=24).hexdigest().encode()


class Reader:
    """Bounds-checked reads from an authenticated body of format `version` (any overrun raises
    struct.error; `batch` reads it all)."""

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
        n = self._num(U8)
        if n == 0:
            raise Rejected("malformed", f"empty {what}")
        return self._take(n).decode()

    def _hashes(self, n: int, signed: bool) -> tuple[int, ...]:
        return struct.unpack(f">{n}{'q' if signed else 'Q'}", self._take(8 * n))

    def batch(self, seq: int) -> Batch:
        origin = self._text("origin")
        count = self._num(U16)
        events: list[SyncEvent] = []
        statement: Open | None = None
        for i in range(count):
            kind = self._num(U8)
            if kind != OPEN:
                events.append(self._event(kind))
            elif self.version < 2:
                raise Rejected("malformed", f"event kind {OPEN} (Open) in version {self.version}")
            elif i != count - 1:
                raise Rejected("malformed", "an Open statement before the last event")
            else:
                statement = self._open()
        if self.at != len(self.data):
            raise Rejected("malformed", f"{len(self.data) - self.at} bytes after the events")
        return Batch(origin, seq, tuple(events), statement)

    def _open(self) -> Open:
        shift = self._num(U8)
        residue = self._num(U32)
        if shift > MAX_SHIFT or residue >> shift:
            raise Rejected("malformed", f"Open slice {residue} of 2**{shift}")
        digests = self._hashes(self._num(U16), False)
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
        tokens, flags = self._num(U32), self._num(U8)
        if flags & ~FLAGS:
            raise Rejected("malformed", f"unknown flags {flags:#x}")
        head = self._hashes(1, bool(flags & HEAD_SIGNED))[0] if flags & HAS_HEAD else None
        count = self._num(U16)
        if count > MAX_BLOCKS:
            raise Rejected("malformed", f"{count} blocks, at most {MAX_BLOCKS}")
        blocks = self._hashes(count, bool(flags & BLOCKS_SIGNED))
        return Sent(rid, endpoint, tokens, bool(flags & SEEN), blocks, head)
