"""Cross-replica sync: the peers' sends since each endpoint's scrape in the unseen counts."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from poolkeeper.scheduling.replicasync.events import Answered, Batch, Ended, Open, Sent
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.replicasync.openset import digest
from poolkeeper.scheduling.replicasync.peerunseen import PeerUnseen
from tests.scheduling.sched_factories import NOW, key, state

A, B = key(1), key(2)
SCRAPED = NOW - 0.01  # `state`'s default scrape time


def _sent(rid: str, endpoint: str = A, tokens: int = 100) -> Sent:
    return Sent(rid, endpoint, tokens, True)


def test_a_peers_send_after_the_scrape_adds_to_that_endpoints_unseen_counts_only() -> None:
    peers = PeerUnseen()
    peers.fold("b", _sent("r1", tokens=300), NOW)
    mine = replace(
        state(1, unseen=2, unseen_tokens=50, inflight=3, inflight_tokens=90),
        seconds_per_output_token=0.02, inflight_models=MappingProxyType({"m": 3}),
    )  # fmt: skip
    a, b = peers.apply([mine, state(2)])
    assert (a.unseen_requests, a.unseen_tokens, a.unseen_answered) == (3, 350, 0)
    # In flight: the replica's own; the rest as it was.
    assert a == replace(mine, unseen_requests=3, unseen_tokens=350)
    assert (a.inflight_models, a.metrics) == (mine.inflight_models, mine.metrics)
    assert b == state(2)


def test_a_pool_serving_adapters_keeps_its_own_counts_but_drops_what_a_scrape_covers() -> None:
    peers = PeerUnseen()
    peers.fold("b", _sent("r0"), SCRAPED - 0.001)  # covered by the scrape
    peers.fold("b", _sent("r1"), NOW)
    peers.fold("b", _sent("r2", endpoint=B), NOW)
    for with_adapters in (state(2, active=("sql-lora",)), state(2, queued_adapters=("x",))):
        pool = [state(1), with_adapters]
        assert peers.apply(pool) == pool  # not even the endpoint without adapters is folded
    assert len(peers) == 2  # the covered one dropped all the same
    a, b = peers.apply([state(1, max_adapters=4), state(2, max_adapters=4)])  # slots only
    assert (a.unseen_requests, b.unseen_requests) == (1, 1)


def test_an_answered_peer_send_is_running_and_an_ended_one_is_gone() -> None:
    peers = PeerUnseen()
    peers.fold("b", _sent("r1"), NOW)
    peers.fold("b", _sent("r2"), NOW)
    peers.fold("b", Answered("r1"), NOW)
    (a,) = peers.apply([state(1)])
    assert (a.unseen_requests, a.unseen_answered) == (2, 1)
    peers.fold("b", Ended("r2"), NOW)
    (a,) = peers.apply([state(1)])
    assert (a.unseen_requests, a.unseen_answered) == (1, 1)


def test_a_scrape_stamped_at_or_after_a_send_covers_it_and_drops_it() -> None:
    peers = PeerUnseen()
    peers.fold("b", _sent("r1"), SCRAPED - 0.001)  # before the scrape: in its queue already
    peers.fold("b", _sent("r2"), SCRAPED)  # at it: a scrape stamped T precedes changes at T
    (a,) = peers.apply([state(1)])
    assert a.unseen_requests == 1
    assert len(peers) == 1
    (a,) = peers.apply([state(1, updated_at=NOW)])
    assert a.unseen_requests == 0
    assert len(peers) == 0


def test_the_same_origin_and_id_counts_once_and_ids_of_two_origins_twice() -> None:
    peers = PeerUnseen()
    peers.fold("b", _sent("r1"), NOW)
    peers.fold("b", _sent("r1", B), NOW)  # a retry elsewhere: the newest send counts
    peers.fold("c", _sent("r1", B), NOW)
    a, b = peers.apply([state(1), state(2)])
    assert (a.unseen_requests, b.unseen_requests) == (0, 2)


def test_a_peer_gone_and_an_open_statement_without_its_send_drop_it() -> None:
    hub = ReplicaSync("a")
    peers = PeerUnseen()
    hub.bind(peers)
    hub.deliver(Batch("b", 1, (_sent("r1"), _sent("r2"))), NOW)
    hub.deliver(Batch("c", 1, (_sent("r3"),)), NOW)
    assert len(peers) == 3
    # b's statement lists r2 only: r1's first byte or end was lost on the way.
    hub.deliver(Batch("b", 2, (), Open(0, 0, frozenset({digest("r2")}))), NOW)
    assert len(peers) == 2
    hub.expire(NOW + hub.peer_ttl_s)
    assert len(peers) == 0


def test_sends_are_bounded_in_number_and_age() -> None:
    peers = PeerUnseen(max_entries=2, max_age_s=10.0)
    for i in range(3):
        peers.fold("b", _sent(f"r{i}"), NOW)
    assert len(peers) == 2  # the oldest went first
    (a,) = peers.apply([state(1)])
    assert a.unseen_requests == 2
    peers.fold("b", _sent("late", B), NOW + 10.5)  # the others are older than 10 s now
    assert len(peers) == 1


@pytest.mark.parametrize("kw", [{"max_entries": 0}, {"max_age_s": 0.0}])
def test_bad_bounds_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        PeerUnseen(**kw)  # type: ignore[arg-type]
