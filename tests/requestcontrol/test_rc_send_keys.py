"""Client-chosen request ids can repeat: each send is keyed by the Director's `id#seq` ticket key
end to end (the scheduler's `LLMRequest.key`, the backlog, the first byte and end the Director
reports, cross-replica sync's events and open statements), so one send's first byte never ends
another's entry, here or at a peer. The real Director, default scheduler and sync codec."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolkeeper.requestcontrol.director import Director
from poolkeeper.requestcontrol.sends import Ticket
from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.scheduling.backlog import PrefillBacklog
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.replicasync.codec import Codec
from poolkeeper.scheduling.replicasync.fold import bind_scheduler
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.scheduler import Scheduler
from tests.requestcontrol.test_rc_director import NOW, _bare, _chat
from tests.scheduling.sched_factories import scheduler

LONG = "a prompt nobody sent before " * 100  # 2,800 characters: 700 uncached tokens
KEY = b"0123456789abcdef0123456789abcdef"


def _director(s: Scheduler) -> Director:
    return _bare(s)


def _backlog(s: Scheduler) -> PrefillBacklog:
    scorer = s.plugins["prefill-backlog-scorer"]
    assert isinstance(scorer, PrefillBacklogScorer)
    return scorer.backlog


def _total(backlog: PrefillBacklog) -> int:
    return sum(backlog.snapshot().values())


async def _two_sends(director: Director, rid: str) -> tuple[RoutingDecision, RoutingDecision]:
    """Two live streamed sends carrying one client id, different prompts."""
    first = await director.route(_chat(rid=rid, stream=True, text=LONG + "one"))
    second = await director.route(_chat(rid=rid, stream=True, text=LONG + "two"))
    assert first.request_id == second.request_id == rid  # the client's id, unchanged
    return first, second


async def test_one_sends_first_byte_leaves_the_other_send_with_its_id_counted() -> None:
    s = scheduler("default")
    director = _director(s)
    backlog = _backlog(s)
    first, second = await _two_sends(director, "same")
    assert len(backlog) == 2  # both counted, not the newest replacing the first
    both = _total(backlog)
    director.first_byte(first)
    assert len(backlog) == 1
    assert 0 < _total(backlog) < both  # the second's tokens still ahead of new requests
    director.complete(first, status=200, usage=Usage(prompt_tokens=700, completion_tokens=3))
    assert len(backlog) == 1  # the first's end ends nothing of the second
    director.first_byte(second)
    assert _total(backlog) == 0


async def test_a_bodyless_request_named_like_a_send_key_ends_nothing() -> None:
    s = scheduler("default")
    director = _director(s)
    backlog = _backlog(s)
    sent = await director.route(_chat(rid="r", stream=True, text=LONG))
    assert isinstance(sent.ticket, Ticket)
    get = replace(_chat(rid=sent.ticket.key), method="GET", body=b"")
    forged = await director.route(get)
    assert isinstance(forged.ticket, Ticket)
    assert forged.ticket.key != sent.ticket.key
    director.complete(forged, status=200, usage=None)
    assert len(backlog) == 1


# 255 bytes: with its `#seq` past a length byte, it travels as a digest (wire.wire_id).
@pytest.mark.parametrize("rid", ["same", "x" * 255])
async def test_a_peer_counts_the_other_send_with_its_id_until_its_own_first_byte(
    rid: str,
) -> None:
    mine, peer = scheduler("default"), scheduler("default")
    hub_a, hub_b = ReplicaSync("a"), ReplicaSync("b")
    bind_scheduler(hub_a, mine, clock=lambda: NOW)
    bind_scheduler(hub_b, peer)
    codec, seq = Codec(KEY), [1]
    director = _director(mine)
    at_peer = _backlog(peer)

    def carry() -> None:
        """a's events since the last carry and its open statement, through the wire to b."""
        batch = hub_a.take()
        events = batch.events if batch is not None else ()
        statement = hub_a.statement(codec.room("a"))
        datagrams = codec.encode("a", seq[0], events, 0, open_sends=statement)
        seq[0] += len(datagrams)
        for datagram in datagrams:
            assert hub_b.deliver(codec.decode(datagram).batch, NOW)

    first, second = await _two_sends(director, rid)
    carry()
    assert len(at_peer) == 2
    both = _total(at_peer)
    director.first_byte(first)
    carry()
    assert len(at_peer) == 1
    assert 0 < _total(at_peer) < both
    carry()  # a statement alone: the second is still open on both sides
    assert len(at_peer) == 1
    assert hub_b.reconciled == 0
    director.first_byte(second)
    carry()
    assert _total(at_peer) == 0
    assert hub_b.reconciled == 0  # ended by its Answered, not by a statement
