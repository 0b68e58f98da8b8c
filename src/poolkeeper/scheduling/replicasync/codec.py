"""The wire form of a replica-sync `Batch`: versioned, compact, authenticated bytes.

Why its own format: one UDP datagram per batch (the transport, `transport.py`), read by peers
that trust nothing they cannot verify. The layout, its versions and the reading of a verified
body are `wire.py`'s; here a batch becomes signed datagrams and back. Nothing is parsed before
the tag is verified (constant-time compare); any problem is a `Rejected` with one of
`wire.REASONS`. A batch too big for one datagram is split into several with consecutive
sequence numbers (`encode`); its statement rides the last.

Keys: a `Codec` holds one or more keys (`MAX_KEYS`): the first signs, every one verifies, so a
key is rotated without a window in which replicas reject each other (docs/kubernetes.md);
`verified_old` counts datagrams verified by a key other than the first (0 for a while: every
replica signs with the new key, the old one can go). `set_keys` swaps them between datagrams
(a key file changed while running).

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
from typing import Final

from poolkeeper.scheduling.replicasync.events import MAX_BLOCKS, Batch, Open, Sent, SyncEvent
from poolkeeper.scheduling.replicasync.wire import (
    BLOCKS_SIGNED,
    DEFAULT_DATAGRAM,
    HAS_HEAD,
    HEAD,
    HEAD_SIGNED,
    KIND,
    MAGIC,
    MAX_DATAGRAM,
    MAX_ID_BYTES,
    MAX_SHIFT,
    MIN_BYTES,
    MIN_DATAGRAM,
    OPEN,
    OPEN_HEAD,
    SEEN,
    TAG_BYTES,
    U8,
    U16,
    U32,
    VERSION,
    VERSIONS,
    Reader,
    Rejected,
    wire_id,
)

MAX_KEYS: Final = 4  # keys verified at once (a rotation needs 2)
MIN_KEY_BYTES: Final = 16
# What encoding something the format cannot carry raises (a bad field or a non-event: our bug,
# never a peer's); the transport catches these, so it costs that event or batch only.
ENCODE_ERRORS: Final = (
    ValueError, TypeError, KeyError, AttributeError, OverflowError, struct.error
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Decoded:
    batch: Batch
    sent_at_ms: int  # the origin's wall clock when it encoded the batch (freshness)


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
    head = U8.pack(KIND[type(event)]) + U8.pack(len(rid)) + rid
    if not isinstance(event, Sent):
        return head, False
    if len(event.blocks) > MAX_BLOCKS:
        raise ValueError(f"{len(event.blocks)} blocks, at most {MAX_BLOCKS}")
    if not 0 <= event.tokens < 1 << 32:
        raise ValueError(f"tokens {event.tokens} out of range")
    endpoint = _text(event.endpoint, "endpoint")
    blocks, signed = _hashes(event.blocks)
    flags = (SEEN if event.seen else 0) | (BLOCKS_SIGNED if signed else 0)
    first = b""
    if event.head is not None:
        first, head_signed = _hashes((event.head,))
        flags |= HAS_HEAD | (HEAD_SIGNED if head_signed else 0)
    parts = (U8.pack(len(endpoint)), endpoint, U32.pack(event.tokens), U8.pack(flags), first)
    raw = head + b"".join(parts)
    fits = (room - len(raw) - U16.size) // 8
    if fits < 0:
        raise ValueError(f"a Sent of {len(raw)} bytes without blocks exceeds {room}")
    count = min(len(event.blocks), fits)
    return raw + U16.pack(count) + blocks[: 8 * count], count < len(event.blocks)


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
    head = OPEN_HEAD.pack(OPEN, statement.shift, statement.residue, len(values))
    return head + raw


def _macs(keys: bytes | Sequence[bytes]) -> list[hmac.HMAC]:
    """One keyed HMAC-SHA256 per key, copied per datagram; ValueError for a bad key set."""
    keys = [keys] if isinstance(keys, bytes) else list(keys)
    if not 1 <= len(keys) <= MAX_KEYS:
        raise ValueError(f"1-{MAX_KEYS} sync keys, not {len(keys)}")
    if any(len(key) < MIN_KEY_BYTES for key in keys):
        raise ValueError(f"the sync key must be at least {MIN_KEY_BYTES} bytes")
    return [hmac.new(key, digestmod=hashlib.sha256) for key in keys]


class Codec:
    """Batches to datagrams and back under shared keys (each at least `MIN_KEY_BYTES`, at
    most `MAX_KEYS`): the first signs, all verify (the module docstring)."""

    def __init__(self, keys: bytes | Sequence[bytes], *, max_bytes: int = DEFAULT_DATAGRAM) -> None:
        if not MIN_DATAGRAM <= max_bytes <= MAX_DATAGRAM:
            raise ValueError(f"max_bytes must be {MIN_DATAGRAM}-{MAX_DATAGRAM}, not {max_bytes}")
        self._macs = _macs(keys)
        self.max_bytes = max_bytes
        self.trimmed = 0  # Sents sent without their blocks' tail (monotonic)
        self.verified_old = 0  # datagrams verified by a key other than the first (rotation)

    def set_keys(self, keys: bytes | Sequence[bytes]) -> None:
        """Sign and verify under `keys` from the next datagram on (a key file changed while
        running, `server/sync_keys.py`); ValueError, the keys in use kept, for bad ones."""
        self._macs = _macs(keys)

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
        fixed = HEAD.size + 1 + len(_text(origin, "origin")) + U16.size + TAG_BYTES
        return (self.max_bytes - fixed - OPEN_HEAD.size) // 8

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
        fixed = HEAD.size + 1 + len(name) + U16.size + TAG_BYTES
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
                (HEAD.pack(MAGIC, VERSION, sent_at_ms, seq + i), U8.pack(len(name)), name,
                 U16.pack(len(chunk)), *chunk)
            )  # fmt: skip
            out.append(body + self._tag(body))
        return out

    def decode(self, data: bytes) -> Decoded:
        """The batch in one datagram, verified; `Rejected` with its reason otherwise."""
        if len(data) > self.max_bytes:
            raise Rejected("oversized", f"{len(data)} bytes, at most {self.max_bytes}")
        if len(data) < MIN_BYTES:
            raise Rejected("short", f"{len(data)} bytes, at least {MIN_BYTES}")
        magic, version, sent_at_ms, seq = HEAD.unpack_from(data)
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
            return Decoded(Reader(body, HEAD.size, version).batch(seq), sent_at_ms)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise Rejected("malformed", f"truncated or invalid field ({exc})") from None
