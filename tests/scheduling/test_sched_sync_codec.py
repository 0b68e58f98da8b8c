"""The replica-sync codec: batches come back exactly; anything else is rejected with its reason."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, strategies as st

from poolkeeper.scheduling.replicasync.codec import Codec
from poolkeeper.scheduling.replicasync.events import (
    MAX_BLOCKS,
    Answered,
    Batch,
    Ended,
    Open,
    Sent,
)
from poolkeeper.scheduling.replicasync.wire import (
    DEFAULT_DATAGRAM,
    MAX_DATAGRAM,
    MAX_ID_BYTES,
    REASONS,
    TAG_BYTES,
    Rejected,
    wire_id,
)

KEY = b"k" * 32
IDS = st.text(min_size=1, max_size=40).filter(lambda s: 0 < len(s.encode()) <= MAX_ID_BYTES)
UNSIGNED = st.lists(st.integers(0, 2**64 - 1), max_size=MAX_BLOCKS)
SIGNED = st.lists(st.integers(-(2**63), -1), min_size=1, max_size=MAX_BLOCKS)
HEADS = st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(-(2**63), -1))
SENT = st.builds(
    Sent,
    request_id=IDS,
    endpoint=st.from_regex(r"10\.\d{1,3}\.\d{1,3}\.\d{1,3}:\d{2,5}", fullmatch=True),
    tokens=st.integers(0, 2**32 - 1),
    seen=st.booleans(),
    blocks=st.one_of(UNSIGNED, SIGNED).map(tuple),
    head=HEADS,
)
EVENTS = st.lists(
    st.one_of(SENT, st.builds(Answered, IDS), st.builds(Ended, IDS)), max_size=30
).map(tuple)


@given(events=EVENTS, seq=st.integers(0, 2**40), origin=IDS, at=st.integers(0, 2**63))
def test_a_batch_comes_back_exactly(
    events: tuple[Sent | Answered | Ended, ...], seq: int, origin: str, at: int
) -> None:
    codec = Codec(KEY, max_bytes=MAX_DATAGRAM)
    (datagram,) = codec.encode(origin, seq, events, at)
    decoded = codec.decode(datagram)
    assert decoded.batch == Batch(origin, seq, events)
    assert decoded.sent_at_ms == at


def test_a_big_batch_splits_into_datagrams_with_consecutive_seqs() -> None:
    codec = Codec(KEY, max_bytes=MAX_DATAGRAM)
    blocks = tuple(range(MAX_BLOCKS))
    events = tuple(Sent(f"r{i}", "10.0.0.1:8000", 100, True, blocks, 7) for i in range(100))
    datagrams = codec.encode("pod-a", 41, events, 5)
    assert len(datagrams) >= 4  # ~2 KiB per event, 65,000 bytes per datagram
    assert all(len(d) <= MAX_DATAGRAM for d in datagrams)
    batches = [codec.decode(d).batch for d in datagrams]
    assert [b.seq for b in batches] == list(range(41, 41 + len(datagrams)))
    assert tuple(e for b in batches for e in b.events) == events
    assert codec.trimmed == 0


def test_by_default_datagrams_stay_unfragmented_and_long_prefixes_keep_their_first_blocks() -> None:
    codec = Codec(KEY)
    blocks = tuple(range(MAX_BLOCKS))
    sends = [Sent(f"r{i}", "10.0.0.1:8000", 9, True, blocks) for i in range(3)]
    events: tuple[Sent | Ended, ...] = (Ended("e0"), *sends)
    datagrams = codec.encode("pod-a", 1, events, 5)
    assert all(len(d) <= DEFAULT_DATAGRAM for d in datagrams)
    got = [e for d in datagrams for e in codec.decode(d).batch.events]
    assert got[0] == Ended("e0")
    assert [e.request_id for e in got] == ["e0", "r0", "r1", "r2"]
    for sent in got[1:]:
        assert isinstance(sent, Sent)
        assert 100 < len(sent.blocks) < MAX_BLOCKS  # ~130 fit in 1,232 bytes
        assert sent.blocks == blocks[: len(sent.blocks)]  # the prefix, the tail cut
    assert codec.trimmed == 3
    short = Sent("s", "10.0.0.1:8000", 9, True, blocks[:10])
    assert codec.decode(codec.encode("pod-a", 9, (short,), 5)[0]).batch.events == (short,)
    assert codec.trimmed == 3
    assert _reason(b"PKRS" + b"x" * DEFAULT_DATAGRAM) == "oversized"  # before the tag


@pytest.mark.parametrize("size", [1023, 65_001])
def test_the_datagram_size_is_bounded(size: int) -> None:
    with pytest.raises(ValueError, match="max_bytes must be 1024-65000"):
        Codec(KEY, max_bytes=size)


def test_one_bad_event_costs_only_itself_when_asked() -> None:
    codec = Codec(KEY)
    bad_type = Sent("t", "h:1", 1, False, ("not a hash",))  # type: ignore[arg-type]
    events = (Ended("ok1"), Sent("n", "h:1", -1, False), bad_type, "junk", Ended("ok2"))
    skipped: list[str] = []
    (datagram,) = codec.encode("a", 1, events, 0, skipped=skipped)  # type: ignore[arg-type]
    assert codec.decode(datagram).batch.events == (Ended("ok1"), Ended("ok2"))
    assert len(skipped) == 3
    with pytest.raises(ValueError, match="TypeError"):
        codec.encode("a", 1, (bad_type,), 0)
    assert codec.encode("a", 1, (bad_type,), 0, skipped=[]) == []  # nothing left to send


def test_a_long_request_id_travels_as_the_same_digest_for_each_of_its_events() -> None:
    codec = Codec(KEY)
    rid = "x" * 1000
    (datagram,) = codec.encode("a", 1, (Sent(rid, "h:1", 1, False), Ended(rid)), 0)
    sent, ended = codec.decode(datagram).batch.events
    assert sent.request_id == ended.request_id == wire_id(rid).decode()
    assert len(sent.request_id.encode()) <= MAX_ID_BYTES
    assert wire_id("short") == b"short"


@pytest.mark.parametrize(
    "events",
    [
        (Sent("r", "h:1", 1, False, tuple(range(MAX_BLOCKS + 1))),),
        (Sent("r", "h:1", -1, False),),
        (Sent("r", "h:1", 2**32, False),),
        (Sent("r", "", 1, False),),
        (Sent("r", "h:1", 1, False, (-1, 2**63)),),  # neither all signed nor all unsigned
        (Ended(""),),
    ],
)
def test_what_the_format_cannot_carry_is_refused_at_encode(
    events: tuple[Sent | Ended, ...],
) -> None:
    with pytest.raises(ValueError, match=r"blocks|tokens|bytes of UTF-8|signed|empty"):
        Codec(KEY).encode("a", 1, events, 0)


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Codec(b"short")


def _datagram(events: tuple[Sent | Answered | Ended, ...] = (Ended("r1"),)) -> bytes:
    return Codec(KEY).encode("pod-a", 3, events, 99)[0]


def _reason(data: bytes, codec: Codec | None = None) -> str:
    with pytest.raises(Rejected) as info:
        (codec or Codec(KEY)).decode(data)
    assert info.value.reason in REASONS
    return info.value.reason


def test_each_kind_of_bad_datagram_has_its_reason() -> None:
    good = _datagram()
    assert _reason(good, Codec(b"another key, 16+ bytes")) == "auth"
    assert _reason(good[:10]) == "short"
    assert _reason(b"x" * (MAX_DATAGRAM + 1)) == "oversized"
    assert _reason(b"XXXX" + good[4:]) == "magic"
    assert _reason(good[:4] + bytes([3]) + good[5:]) == "version"
    flipped = bytearray(good)
    flipped[-TAG_BYTES - 1] ^= 1  # the last event byte: the tag no longer matches
    assert _reason(bytes(flipped)) == "auth"
    assert _reason(good[:-1]) == "auth"  # a cut tag


def _signed(body: bytes) -> bytes:
    """`body` with a valid tag: what a sender holding the key (or a bug of ours) could send."""
    return body + Codec(KEY)._tag(body)


def test_authenticated_but_malformed_bodies_are_rejected_as_malformed() -> None:
    body = _datagram((Sent("r", "h:1", 5, True, (1, 2), 3),))[:-TAG_BYTES]
    assert _reason(_signed(body + b"\0")) == "malformed"  # trailing bytes
    assert _reason(_signed(body[:-3])) == "malformed"  # truncated block
    head = struct.calcsize(">4sBQQ")
    no_origin = body[:head] + b"\0" + body[head + 1 + len("pod-a") :]
    assert _reason(_signed(no_origin)) == "malformed"
    kind_at = head + 1 + len("pod-a") + 2
    unknown = body[:kind_at] + b"\x09" + body[kind_at + 1 :]
    assert _reason(_signed(unknown)) == "malformed"


def test_more_blocks_than_the_cap_are_rejected_even_when_authenticated() -> None:
    small = Codec(KEY, max_bytes=MAX_DATAGRAM)
    body = small.encode("a", 1, (Sent("r", "h:1", 5, True, (1,)),), 0)[0][:-TAG_BYTES]
    count_at = len(body) - 8 - 2
    forged = body[:count_at] + struct.pack(">H", MAX_BLOCKS + 1) + b"\0" * 8 * (MAX_BLOCKS + 1)
    assert _reason(_signed(forged), small) == "malformed"


@given(st.binary(max_size=400))
def test_garbage_is_rejected_never_raised_otherwise(data: bytes) -> None:
    _reason(data)


@given(st.binary(min_size=1, max_size=200), st.integers(0, 10_000))
def test_authenticated_garbage_is_rejected_never_raised_otherwise(tail: bytes, at: int) -> None:
    body = _datagram()[:-TAG_BYTES]
    cut = body[: min(at, len(body))] + tail
    reasons = []
    try:
        Codec(KEY).decode(_signed(cut))
    except Rejected as exc:
        reasons.append(exc.reason)
    assert set(reasons) <= {"malformed", "short", "magic", "version"}


# -- version 2: the open statement, several keys -----------------------------------------------


def _version_1(codec: Codec, events: tuple[Sent | Answered | Ended, ...]) -> bytes:
    """A datagram as a version-1 replica sends it (the same body, version byte 1)."""
    body = codec.encode("old", 9, events, 0)[0][:-TAG_BYTES]
    body = body[:4] + bytes([1]) + body[5:]
    return body + codec._tag(body)


def test_an_open_statement_rides_the_last_datagram_and_comes_back_exactly() -> None:
    codec = Codec(KEY)
    room = codec.room("pod-a")
    assert 130 <= room <= 150  # about 140 digests in a default datagram
    values = frozenset(v << 3 | 5 for v in range(room))  # all in slice 5 of 8
    statement = Open(3, 5, values)
    (alone,) = codec.encode("pod-a", 7, (), 0, open_sends=statement)
    assert codec.decode(alone).batch == Batch("pod-a", 7, (), statement)
    events = tuple(Ended(f"r{i}") for i in range(5))
    two = codec.encode("pod-a", 7, events, 0, open_sends=statement)
    assert [codec.decode(d).batch for d in two] == [
        Batch("pod-a", 7, events),
        Batch("pod-a", 8, (), statement),  # no room beside the events: its own, last
    ]
    with pytest.raises(ValueError, match="exceeds"):
        codec.encode("pod-a", 7, (), 0, open_sends=Open(0, 0, frozenset(range(room + 1))))
    with pytest.raises(ValueError, match="outside its slice"):
        codec.encode("pod-a", 7, (), 0, open_sends=Open(1, 0, frozenset({1})))


def test_a_version_1_datagram_is_still_read_and_the_statement_needs_version_2() -> None:
    codec = Codec(KEY)
    events = (Sent("r", "h:1", 5, True, (1, 2), 3), Ended("q"))
    assert codec.decode(_version_1(codec, events)).batch == Batch("old", 9, events)
    body = codec.encode("b", 1, (), 0, open_sends=Open(0, 0, frozenset({4})))[0][:-TAG_BYTES]
    assert _reason(_signed(body[:4] + bytes([1]) + body[5:])) == "malformed"


def test_a_statement_out_of_its_place_or_slice_is_malformed() -> None:
    codec = Codec(KEY)
    ok = codec.encode("b", 1, (), 0, open_sends=Open(1, 1, frozenset({3})))[0][:-TAG_BYTES]
    head = struct.calcsize(">4sBQQ") + 1 + 1  # to the event count
    # the digest 3 relabelled as slice 0 of 2
    at = head + 2 + 2  # kind, shift, then the residue u32
    assert _reason(_signed(ok[:at] + struct.pack(">I", 0) + ok[at + 4 :])) == "malformed"
    # a residue that is not a slice of 2**shift
    assert _reason(_signed(ok[:at] + struct.pack(">I", 2) + ok[at + 4 :])) == "malformed"
    # a statement followed by another event
    end = codec.encode("b", 1, (Ended("r"),), 0)[0][:-TAG_BYTES]
    tail = end[head + 2 :]
    two = ok[:head] + struct.pack(">H", 2) + ok[head + 2 :] + tail
    assert _reason(_signed(two)) == "malformed"


def test_every_key_verifies_the_first_signs_and_old_key_use_is_counted() -> None:
    old, new = b"o" * 32, b"n" * 32
    on_old = Codec(old).encode("a", 1, (Ended("r"),), 0)[0]
    rotating = Codec([new, old])
    assert rotating.decode(on_old).batch == Batch("a", 1, (Ended("r"),))
    assert rotating.verified_old == 1
    signed = rotating.encode("b", 1, (Ended("r"),), 0)[0]
    assert Codec(new).decode(signed).batch.origin == "b"  # signed with the first key
    assert _reason(signed, Codec(old)) == "auth"
    assert Codec([old, new]).decode(signed).batch.origin == "b"
    with pytest.raises(ValueError, match="1-4 sync keys"):
        Codec([])
    with pytest.raises(ValueError, match="1-4 sync keys"):
        Codec([KEY] * 5)
    with pytest.raises(ValueError, match="at least 16"):
        Codec([KEY, b"short"])


@st.composite
def _statements(draw: st.DrawFn) -> Open:
    shift = draw(st.integers(0, 8))
    residue = draw(st.integers(0, (1 << shift) - 1))
    highs = draw(st.lists(st.integers(0, (1 << (64 - shift)) - 1), max_size=100))
    return Open(shift, residue, frozenset(h << shift | residue for h in highs))


@given(events=EVENTS, statement=_statements(), seq=st.integers(0, 2**40))
def test_a_batch_with_its_statement_comes_back_exactly(
    events: tuple[Sent | Answered | Ended, ...], statement: Open, seq: int
) -> None:
    codec = Codec(KEY, max_bytes=MAX_DATAGRAM)
    datagrams = codec.encode("pod-a", seq, events, 0, open_sends=statement)
    batches = [codec.decode(d).batch for d in datagrams]
    assert [b.seq for b in batches] == list(range(seq, seq + len(datagrams)))
    assert tuple(e for b in batches for e in b.events) == events
    assert [b.open for b in batches] == [None] * (len(batches) - 1) + [statement]
