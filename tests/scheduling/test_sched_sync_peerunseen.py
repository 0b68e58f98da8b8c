"""Cross-replica sync: the peers' sends since each endpoint's scrape in the unseen counts."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from types import MappingProxyType
from typing import Any

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


def test_an_idle_lora_pool_stays_unfolded_once_it_listed_an_adapter() -> None:
    peers = PeerUnseen()
    peers.fold("b", _sent("r1"), NOW)
    # Never listed one: folded (the simulator's servers all report max_loras 1).
    a, b = peers.apply([state(1, max_adapters=4), state(2, max_adapters=4)])
    assert (a.unseen_requests, b.unseen_requests) == (1, 0)
    assert peers.apply([state(1, active=("x",)), state(2)])[0].unseen_requests == 0
    # Idle now (servers list only the adapters with requests): still the LoRA pool it was,
    # on the endpoint that listed one and on the other alike.
    peers.fold("b", _sent("r2", endpoint=B), NOW)
    idle = [state(1, max_adapters=4), state(2, max_adapters=4)]
    assert peers.apply(idle) == idle
    assert peers.apply(idle[1:]) == idle[1:]
    peers.forget_endpoints({B})  # A left the pool: B, marked with it, stays marked
    assert peers.apply(idle[1:]) == idle[1:]


def test_without_the_adapters_gate_a_lora_pool_is_folded_too() -> None:
    # The bench's A/B of the gate (`--sync-with unseen-lora`): the same sends, the gate off.
    peers = PeerUnseen(adapters_gate=False)
    peers.fold("b", _sent("r1", tokens=300), NOW)
    a, b = peers.apply([state(1, active=("sql-lora",)), state(2, queued_adapters=("x",))])
    assert (a.unseen_requests, a.unseen_tokens, b.unseen_requests) == (1, 300, 0)


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


def test_sends_to_an_endpoint_outside_the_pool_are_ignored_and_those_that_left_dropped() -> None:
    peers = PeerUnseen(pool={A, B})
    peers.fold("b", _sent("r1", endpoint="10.9.9.9:8000"), NOW)
    assert (len(peers), peers.ignored) == (0, 1)
    peers.fold("b", _sent("r2"), NOW)
    peers.fold("b", _sent("r3", endpoint=B), NOW)
    peers.forget_endpoints({B})
    assert len(peers) == 1
    a, b = peers.apply([state(1), state(2)])
    assert (a.unseen_requests, b.unseen_requests) == (0, 1)
    peers.fold("b", _sent("r4"), NOW)  # A is no longer in the pool
    assert (len(peers), peers.ignored) == (1, 2)


def test_old_sends_expire_at_a_read_too() -> None:
    peers = PeerUnseen(max_age_s=10.0)
    peers.fold("b", _sent("r1", endpoint=B), NOW)  # B: never read again
    peers.fold("b", _sent("r2"), NOW + 0.5)
    (a,) = peers.apply([state(1, updated_at=NOW + 10.2)])  # no new send since
    assert a.unseen_requests == 0  # r2: in that scrape
    assert len(peers) == 0  # r1: older than 10 s on the scrapes' clock


def test_an_endpoints_answer_is_the_same_object_until_its_state_or_sends_change() -> None:
    peers = PeerUnseen()
    peers.fold("b", _sent("r1"), NOW)
    pool = [state(1), state(2)]
    first, second = peers.apply(pool), peers.apply(pool)
    assert first[0] is second[0]  # (the decision cache compares states by identity)
    assert first[1] is second[1] is pool[1]
    for change in (_sent("r2"), Answered("r2"), Ended("r2")):
        peers.fold("b", change, NOW)
        again = peers.apply(pool)
        assert again[0] is not second[0]
        second = again
    assert second[0] == first[0]  # r2 came and went: the counts are r1's again
    assert peers.apply([state(1), state(2)])[0] is not second[0]  # another state object


def _non_default(f: dataclasses.Field[Any]) -> Any:
    """A value for field `f` of EndpointState unlike its default (a new field: add one)."""
    values: dict[str, Any] = {
        "endpoint": state(7).endpoint,
        "metrics": state(7, waiting=3).metrics,
        "seconds_per_output_token": 0.025,
        "inflight_models": MappingProxyType({"m": 2}),
    }
    if f.name in values:
        return values[f.name]
    assert f.type == "int", f"give EndpointState.{f.name} a non-default value here"
    return 11 + len(f.name)


def test_every_field_of_the_state_is_carried_into_the_answer() -> None:
    # `apply` builds the answer positionally (for speed): a field added to EndpointState and
    # not passed on would silently be reset to its default; this fails then.
    fields = dataclasses.fields(state(1))
    full = type(state(1))(**{f.name: _non_default(f) for f in fields})
    assert all(getattr(full, f.name) != f.default for f in fields)
    peers = PeerUnseen()
    peers.fold("b", _sent("r1", endpoint=full.key, tokens=40), NOW)
    (got,) = peers.apply([full])
    expected = replace(full, unseen_requests=full.unseen_requests + 1,
                       unseen_tokens=full.unseen_tokens + 40)  # fmt: skip
    for f in fields:
        assert getattr(got, f.name) == getattr(expected, f.name), f.name
