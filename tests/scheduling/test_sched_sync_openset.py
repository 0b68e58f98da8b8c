"""Open statements: a lost `Answered` or `Ended` stops counting at the next statement, not after
the backlog's 60 s age; nothing a peer still has open is dropped, reordered or not."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from poolkeeper.scheduling.backlog import PrefillBacklog
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.replicasync.events import Answered, Batch, Ended, Open, Sent
from poolkeeper.scheduling.replicasync.fold import bind_scheduler
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.replicasync.openset import (
    OpenTracker,
    covers,
    digest,
    statement as stated,
)
from poolkeeper.scheduling.replicasync.ownopen import OwnOpen
from poolkeeper.scheduling.scheduler import Scheduler
from tests.scheduling.sched_factories import NOW, key, request, scheduler, state

A, B = key(1), key(2)
ROOM = 140  # about what a default datagram holds


def _backlog(s: Scheduler) -> PrefillBacklog:
    scorer = s.plugins["prefill-backlog-scorer"]
    assert isinstance(scorer, PrefillBacklogScorer)
    return scorer.backlog


def _pair(
    clock: Callable[[], float] = lambda: NOW,
) -> tuple[Scheduler, ReplicaSync, Scheduler, ReplicaSync]:
    """A sender (its own scheduler bound to hub "b", stating on `clock`, the scheduler's) and
    a receiver (hub "a")."""
    peer, mine = scheduler("default"), scheduler("default")
    out, hub = ReplicaSync("b"), ReplicaSync("a")
    bind_scheduler(out, peer, clock=clock)
    bind_scheduler(hub, mine, clock=clock)
    return peer, out, mine, hub


def statement(ids: Iterable[str], room: int, turn: int) -> Open | None:
    """The statement of these ids (the fold hands the hub their digests)."""
    return stated([digest(i) for i in ids], room, turn)


def _heartbeat(out: ReplicaSync, seq: int) -> Batch:
    """What the transport's heartbeat sends: what the hub holds, then its statement."""
    taken = out.take()
    return Batch(out.origin, seq, taken.events if taken else (), out.statement(ROOM))


def test_a_lost_end_stops_counting_at_the_next_statement_not_after_60_s() -> None:
    peer, out, mine, hub = _pair()
    pool = [state(i) for i in range(1, 5)]
    for rid in ("q1", "q2"):
        req = replace(request(prompt=f"{rid} " * 400, request_id=rid), stream=True)
        peer.schedule(req, pool, now=NOW)
    sends = out.take()
    assert sends is not None
    assert hub.deliver(replace(sends, seq=1), NOW)
    backlog = _backlog(mine)
    assert len(backlog) == 2
    peer.request_ended("q1")
    lost = out.take()  # its Ended never arrives
    assert lost is not None
    assert lost.events == (Ended("q1"),)
    assert hub.deliver(_heartbeat(out, 3), NOW + 1.0)  # seq 2 was the lost one
    assert hub.reconciled == 1
    assert len(backlog) == 1  # q1's phantom is gone; q2, still open, stays
    assert backlog.endpoint_of(("b", "q2")) is not None
    assert backlog.endpoint_of(("b", "q1")) is None
    assert hub.deliver(_heartbeat(out, 4), NOW + 2.0)
    assert (hub.reconciled, len(backlog)) == (1, 1)  # a statement repeated drops nothing more


def test_a_send_that_overtakes_the_statement_before_it_is_kept() -> None:
    hub = ReplicaSync("a")
    sink = _Recorder()
    hub.bind(sink)
    hub.deliver(Batch("b", 1, (Sent("r1", A, 100, True),)), NOW)
    # Batch 3 (r2 sent after the statement) arrives before batch 2 (the statement, made when
    # only r1 was open): r2 is newer than what the statement speaks for.
    hub.deliver(Batch("b", 3, (Sent("r2", A, 100, True),)), NOW)
    hub.deliver(Batch("b", 2, (), Open(0, 0, frozenset({digest("r1")}))), NOW)
    assert hub.reconciled == 0
    assert sink.ended == []
    # The next statement, made after r1 ended (its Ended lost), lists r2 only.
    hub.deliver(Batch("b", 5, (), Open(0, 0, frozenset({digest("r2")}))), NOW + 1)
    assert sink.ended == ["r1"]


def test_an_end_that_arrives_after_the_statement_is_not_dropped_twice() -> None:
    hub = ReplicaSync("a")
    sink = _Recorder()
    hub.bind(sink)
    hub.deliver(Batch("b", 1, (Sent("r1", A, 100, True),)), NOW)
    hub.deliver(Batch("b", 3, (), Open(0, 0, frozenset())), NOW)  # r1 ended in batch 2
    hub.deliver(Batch("b", 2, (Ended("r1"),)), NOW)  # which arrives late, as it should
    assert sink.ended == ["r1", "r1"]  # the statement's, then the real one (a no-op there)
    assert hub.reconciled == 1
    assert hub.tracked == 0


def test_statements_cover_a_large_open_set_in_rotating_slices() -> None:
    ids = [f"req-{i}" for i in range(1000)]
    made = [statement(ids, 50, turn) for turn in range(64)]
    shifts = {s.shift for s in made if s is not None}
    assert len(shifts) == 1
    shift = shifts.pop()
    assert shift >= 5  # 1,000 / 50: 32 slices or more
    stated: set[int] = set()
    for s in made[: 1 << shift]:
        assert s is not None
        assert len(s.digests) <= 50
        assert all(covers(s, v) for v in s.digests)
        stated |= s.digests
    assert stated == {digest(i) for i in ids}  # every open id stated within 2**shift turns


def test_one_lost_end_among_many_open_is_dropped_within_one_rotation_and_nothing_else() -> None:
    hub = ReplicaSync("a")
    sink = _Recorder()
    hub.bind(sink)
    ids = [f"req-{i}" for i in range(1000)]
    hub.deliver(Batch("b", 1, tuple(Sent(i, A, 10, True) for i in ids)), NOW)
    still = ids[1:]  # req-0 ended; its Ended was lost
    seq, slices = 1, 0
    for turn in range(1, 65):
        seq += 1
        s = statement(still, 50, turn)
        assert s is not None
        slices = 1 << s.shift
        hub.deliver(Batch("b", seq, (), s), NOW + turn)
        if sink.ended:
            break
    assert sink.ended == ["req-0"]
    assert 1 < seq - 1 <= slices  # within one rotation of the slices (not the first one)


def test_the_sender_states_what_its_own_backlog_counts() -> None:
    peer, out, _mine, _hub = _pair()
    assert ReplicaSync("x").statement(ROOM) is None  # no source bound: no statement
    pool = [state(i) for i in range(1, 5)]
    picked = peer.schedule(request(request_id="q1"), pool, now=NOW).primary.key
    peer.schedule(request(request_id="q2"), pool, now=NOW)
    s = out.statement(ROOM)
    assert s == Open(0, 0, frozenset({digest("q1"), digest("q2")}))
    peer.observe_first_token("q1", picked, NOW + 0.1)
    assert out.statement(ROOM) == Open(0, 0, frozenset({digest("q2")}))


def test_the_tracker_is_bounded_and_a_quiet_peer_is_forgotten() -> None:
    tracker = OpenTracker(max_tracked=3)
    for i in range(4):
        tracker.sent("b", f"r{i}", 1)  # full at 3: "b" gives up its own oldest
    assert (len(tracker), tracker.untracked) == (3, 1)
    assert set(tracker.stale("b", 2, Open(0, 0, frozenset()))) == {"r1", "r2", "r3"}
    tracker.sent("b", "r4", 3)
    tracker.forget("b")
    assert len(tracker) == 0
    with pytest.raises(ValueError, match="max_tracked"):
        OpenTracker(0)


def test_a_busy_origin_cannot_keep_a_new_one_untracked() -> None:
    # "b" filled the cap before "c" was heard: "c"'s sends are tracked all the same (the
    # largest origin gives up its oldest), and the two converge to equal shares.
    tracker = OpenTracker(max_tracked=8)
    for i in range(8):
        tracker.sent("b", f"b{i}", 1)
    for i in range(6):
        tracker.sent("c", f"c{i}", 1)
    assert (tracker.tracked("b"), tracker.tracked("c"), len(tracker)) == (4, 4, 8)
    # "b"'s oldest went; its newest, and every one of "c"'s newest four, are still judged.
    assert set(tracker.stale("b", 1, Open(0, 0, frozenset()))) == {"b4", "b5", "b6", "b7"}
    assert set(tracker.stale("c", 1, Open(0, 0, frozenset()))) == {"c2", "c3", "c4", "c5"}
    assert tracker.untracked == 6


@pytest.mark.parametrize("room", [50, 1])
def test_a_slice_judges_exactly_the_sends_it_covers(room: int) -> None:
    # Small and large shifts (one above the tracker's bucket bits): a statement's slice drops
    # exactly the covered ids it does not list, whichever buckets they are filed in.
    tracker = OpenTracker()
    ids = [f"req-{i}" for i in range(3000)]
    for rid in ids:
        tracker.sent("b", rid, 1)
    still = set(ids[::2])  # every other one ended, the Ended lost
    dropped: set[str] = set()
    for turn in [*range(1, 33), 513]:  # (513: the first one's slice again, shift under 9)
        s = statement(still, room, turn)
        assert s is not None
        assert s.shift >= (9 if room == 1 else 5)
        judged = still | dropped
        expected = {r for r in ids if r not in judged and covers(s, digest(r))}
        assert set(tracker.stale("b", 1, s)) == expected
        dropped |= expected
        assert not tracker.stale("b", 1, s)  # judged once
    assert len(dropped) > 16
    assert len(tracker) == len(ids) - len(dropped)


def test_a_quiet_peers_tracked_sends_go_with_it() -> None:
    hub = ReplicaSync("a", peer_ttl_s=5.0)
    hub.deliver(Batch("b", 1, (Sent("r1", A, 1, True), Sent("r2", B, 1, True))), NOW)
    hub.deliver(Batch("b", 2, (Answered("r2"),)), NOW)
    assert hub.tracked == 1
    hub.expire(NOW + 5)
    assert hub.tracked == 0


def test_digests_match_across_the_wire_form_of_long_ids() -> None:
    from poolkeeper.scheduling.replicasync.wire import wire_id

    long = "x" * 300
    assert digest(long) == digest(wire_id(long).decode())  # what the receiver holds
    with pytest.raises(ValueError, match="room"):
        statement(["a"], 0, 1)


class _Recorder:
    def __init__(self) -> None:
        self.ended: list[str] = []

    def fold(self, origin: str, event: object, now: float) -> None:
        if isinstance(event, Ended):
            self.ended.append(event.request_id)

    def peer_gone(self, origin: str) -> None:
        pass


class _Mirror:
    """A receiver's view of one origin's open sends, from the events the hub folds in."""

    def __init__(self) -> None:
        self.open: set[str] = set()
        self.ended: list[str] = []

    def fold(self, origin: str, event: object, now: float) -> None:
        if isinstance(event, Sent):
            self.open.add(event.request_id)
        elif isinstance(event, (Answered, Ended)):
            self.open.discard(event.request_id)
            self.ended.append(event.request_id)

    def peer_gone(self, origin: str) -> None:
        self.open.clear()


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 11)), min_size=1, max_size=80),
    fate=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=80, max_size=80),
    room=st.sampled_from([2, 140]),
)
def test_statements_never_drop_an_open_send_and_converge_whatever_is_lost_or_reordered(
    steps: list[tuple[int, int]], fate: list[tuple[bool, int]], room: int
) -> None:
    """Sends and closes of 12 ids, a datagram after each step with a statement every other,
    each datagram lost or delayed up to 5 places (well within the seq window): an entry a
    statement drops was closed before that statement was made; after one more lossless
    statement per slice, the receiver holds nothing the sender has closed."""
    open_now: set[str] = set()
    made: list[tuple[Batch, frozenset[str]]] = []  # each datagram, the ids closed by then
    closed: set[str] = set()
    turn = 0
    for seq, (op, n) in enumerate(steps, start=1):
        rid = f"r{n}"
        events: tuple[Sent | Ended, ...] = ()
        if op < 2 and rid not in open_now:
            open_now.add(rid)
            closed.discard(rid)
            events = (Sent(rid, A, 1, True),)
        elif op == 2 and rid in open_now:
            open_now.discard(rid)
            closed.add(rid)
            events = (Ended(rid),)
        state = None
        if seq % 2 == 0:
            turn += 1
            state = statement(open_now, room, turn)
        made.append((Batch("b", seq, events, state), frozenset(closed)))
    order = sorted(
        (i + fate[i][1], i) for i in range(len(made)) if not fate[i][0] or i == len(made) - 1
    )
    hub, mirror = ReplicaSync("a"), _Mirror()
    hub.bind(mirror)
    for _, i in order:
        batch, closed_then = made[i]
        before = len(mirror.ended)
        reconciled = hub.reconciled
        hub.deliver(batch, NOW)
        told = {e.request_id for e in batch.events if isinstance(e, Ended)}
        dropped = [r for r in mirror.ended[before:] if r not in told]
        assert hub.reconciled - reconciled == len(dropped)
        assert set(dropped) <= closed_then  # never one still open when the statement was made
    seq = len(made)
    for _ in range(64):  # lossless statements until every slice was stated once more
        seq += 1
        turn += 1
        last = statement(open_now, room, turn)
        assert last is not None
        hub.deliver(Batch("b", seq, (), last), NOW)
    assert mirror.open <= open_now  # converged: no phantom left


def test_a_send_the_senders_backlog_dropped_unanswered_still_counts_at_the_peer() -> None:
    # The sender's backlog drops its own entries without a first byte or an end (a forget of
    # the endpoint; its cap filled by another replica's entries): the requests still prefill
    # there, so the statement must keep listing them until their first byte or end is told.
    peer, out, mine, hub = _pair()
    pool = [state(i) for i in range(1, 5)]
    req = replace(request(prompt="q1 " * 400, request_id="q1"), stream=True)
    picked = peer.schedule(req, pool, now=NOW).primary.key
    req2 = replace(request(prompt="q2 " * 400, request_id="q2"), stream=True)
    peer.schedule(req2, pool, now=NOW)
    assert hub.deliver(_heartbeat(out, 1), NOW)
    received = _backlog(mine)
    assert received.endpoint_of(("b", "q1")) == picked
    sender = _backlog(peer)
    sender.forget_endpoints({e.key for e in pool} - {picked})  # q1's endpoint, forgotten
    sender.max_entries = 2  # and a third replica's entries fill the cap: q2 is evicted
    sender.sent(("c", "x1"), key(3), 10, NOW + 0.1)
    sender.sent(("c", "x2"), key(3), 10, NOW + 0.2)
    assert sender.own_ids() == []
    assert hub.deliver(_heartbeat(out, 2), NOW + 1.0)
    assert hub.reconciled == 0  # both still prefilling: both still count at the peer
    assert received.endpoint_of(("b", "q1")) == picked
    assert received.endpoint_of(("b", "q2")) is not None
    peer.observe_first_token("q1", picked, NOW + 2.0)  # told, though the backlog forgot it
    peer.request_ended("q2")
    assert hub.deliver(_heartbeat(out, 3), NOW + 2.0)
    assert len(received) == 0
    assert hub.reconciled == 0  # by their own events, not by the statement


def test_the_own_open_set_is_bounded_and_ages_like_the_backlog() -> None:
    own = OwnOpen(max_open=2, max_age_s=60.0)
    own.sent("a", NOW)
    own.sent("b", NOW + 1)
    own.sent("c", NOW + 2)  # full: the oldest goes
    assert ("a" in own, len(own)) == (False, 2)
    own.sent("d", NOW + 63)  # b and c are over 60 s old
    assert own.digests(NOW + 63) == [digest("d")]
    own.sent("\ud800", NOW + 62)  # not encodable: not tracked (its Sent is not sent either)
    assert len(own) == 1
    assert own.closed("d")
    assert not own.closed("d")  # closed once: an end after a first byte is not told
    with pytest.raises(ValueError, match="max_open"):
        OwnOpen(max_open=0)


def test_the_statement_ages_the_own_open_set_without_a_new_send() -> None:
    # A replica that stops sending must not state a send whose first byte and end were lost
    # for ever: its peers would track the id toward their cap.
    own = OwnOpen(max_age_s=60.0)
    own.sent("a", 0.0)
    own.sent("b", 30.0)
    assert own.digests(60.0) == [digest("a"), digest("b")]  # within the age: kept
    assert own.digests(61.0) == [digest("b")]
    assert own.digests(91.0) == []
    assert len(own) == 0  # dropped, not only left out


def test_a_silent_replica_stops_stating_its_lost_sends_on_the_schedulers_clock() -> None:
    now = [NOW]  # the scheduler's clock, which stamps the sends and ages the statement
    peer, out, mine, hub = _pair(lambda: now[0])
    pool = [state(i) for i in range(1, 5)]
    peer.schedule(request(prompt="q1 " * 400, request_id="q1"), pool, now=NOW)
    peer.schedule(request(prompt="q2 " * 400, request_id="q2"), pool, now=NOW + 30.0)
    assert hub.deliver(_heartbeat(out, 1), NOW + 30.0)  # both sent, neither answered
    assert hub.tracked == 2
    for seq, at in enumerate((NOW + 45.0, NOW + 60.0), start=2):  # heartbeats (the peer's TTL)
        now[0] = at
        assert hub.deliver(_heartbeat(out, seq), at)
    assert (hub.tracked, hub.reconciled) == (2, 0)  # within the age: both stated
    now[0] = NOW + 61.0  # nothing sent since: the statement alone ages q1 out
    assert out.statement(ROOM) == Open(0, 0, frozenset({digest("q2")}))
    assert hub.deliver(_heartbeat(out, 4), NOW + 61.0)
    assert (hub.tracked, hub.reconciled) == (1, 1)
    assert _backlog(mine).endpoint_of(("b", "q1")) is None
    assert _backlog(mine).endpoint_of(("b", "q2")) is not None
