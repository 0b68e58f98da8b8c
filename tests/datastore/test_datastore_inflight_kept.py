"""`InflightTracker.apply` from its previous answer (`_patched`) answers as its full pass.

Two trackers told the same sends, first bytes, finishes (some with a speed), forgets and
sweeps between decisions; one applies an evolving pool of 90 endpoints through its kept
answer, the other with the kept answer off (the reference: every position worked out). Their
answers must be equal state for state, in-flight models included. A kept answer that missed
a change (a write the tracker did not mark, another pod at an ip:port) fails here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from itertools import count

import pytest

from poolkeeper.datastore import inflight
from poolkeeper.datastore.columns import MIN_CACHED
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.datastore.inflight import InflightTracker
from tests.scheduling.evolving_pool import endpoint_state, evolve


class _Counting(InflightTracker):
    """Counts the answers `_patched` gave (the kept path taken)."""

    __slots__ = ("patched",)

    def __init__(self) -> None:
        super().__init__()
        self.patched = 0

    def _patched(self, states: Sequence[EndpointState]) -> list[EndpointState] | None:
        out = super()._patched(states)
        self.patched += out is not None
        return out


def _plain_apply(tracker: InflightTracker, pool: list[EndpointState]) -> list[EndpointState]:
    name = "MIN_CACHED"
    saved = getattr(inflight, name)
    setattr(inflight, name, 10**9)
    try:
        return tracker.apply(pool)
    finally:
        setattr(inflight, name, saved)


@pytest.mark.parametrize("new_objects", [False, True])
def test_the_kept_answer_is_the_full_pass_on_an_evolving_pool(new_objects: bool) -> None:
    """`new_objects`: every decision's states are new objects (as a caller may make them
    per call), the same endpoints and scrapes: the answers are compared by what they
    are made of, and the bare positions (answered by the state itself) worked out again."""
    rng = random.Random(21)
    now = 1000.0
    ips = count(1)
    pool = [endpoint_state(rng, next(ips), now) for _ in range(90)]
    kept, plain = _Counting(), InflightTracker()
    for t in (kept, plain):  # a speed observed everywhere (a pool in service): few bare
        for s in pool:
            t.start("warm", s.key, 100, now - 1.0)
            t.finish("warm", now=now - 0.5, output_tokens=50)
    sent: list[str] = []
    for k in range(700):
        now += 0.001
        pool = evolve(rng, pool, now, ips)
        if rng.random() < 0.02:  # another pod at an ip:port (IP reuse): its counts go
            i = rng.randrange(len(pool))
            ep = pool[i].endpoint
            pool[i] = replace(pool[i], endpoint=Endpoint(f"new{k}", ep.address, ep.port))
        for _ in range(rng.randint(0, 3)):
            op = rng.random()
            target = rng.choice(pool).key
            tokens = rng.randint(0, 900)
            for t in (kept, plain):
                if op < 0.4:
                    t.start(f"r{k}", target, tokens, now, "m")
                elif op < 0.6 and sent:
                    t.first_token(sent[k % len(sent)])
                elif op < 0.85 and sent:
                    t.finish(sent[0], now=now, output_tokens=k % 3)  # (0 tokens: no speed)
                elif op < 0.87:
                    t.forget(target)
                elif op < 0.88:
                    t.sweep(now, 0.2)
            if op < 0.4:
                sent.append(f"r{k}")
            elif 0.6 <= op < 0.85 and sent:
                sent.pop(0)
        for key in [s.key for s in pool if kept.seconds_per_token(s.key) is None][:2]:
            for t in (kept, plain):  # a request there finishes (a new endpoint gets a speed)
                t.start(f"w{k}", key, 100, now - 0.2)
                t.finish(f"w{k}", now=now, output_tokens=50)
        given = [replace(s) for s in pool] if new_objects else pool
        got = kept.apply(given)
        want = _plain_apply(plain, given)
        assert [repr(s) for s in got] == [repr(s) for s in want], k
    assert kept.patched > 300  # (the kept answer was used, not only the full pass)


def test_pools_crossing_min_cached_answer_as_the_full_pass() -> None:
    """One below, at and one above `MIN_CACHED` in turn: below, one plain pass and nothing
    kept. A kept answer from before a small call must not be patched after it: the writes
    that call saw (at an endpoint it did not hold) are no longer marked."""
    rng = random.Random(9)
    now = 1000.0
    pool = [endpoint_state(rng, i, now) for i in range(1, MIN_CACHED + 2)]
    kept, plain = _Counting(), InflightTracker()
    for t in (kept, plain):
        for s in pool:
            t.start("warm", s.key, 100, now - 1.0)
            t.finish("warm", now=now - 0.5, output_tokens=50)
    last = pool[MIN_CACHED - 1].key  # held at 64 and 65 only
    # (64, 64, 63, 64, ...: a kept answer patched, then one from before a small call offered)
    for k in range(300):
        now += 0.001
        if rng.random() < 0.3:  # a scrape
            i = rng.randrange(len(pool))
            pool[i] = replace(pool[i], metrics=replace(pool[i].metrics, updated_at=now))
        target = last if k % 3 else rng.choice(pool).key
        for t in (kept, plain):
            if k % 2:
                t.start(f"r{k}", target, 10, now)
            else:
                t.finish(f"r{k - 1}", now=now, output_tokens=1 + k % 5)
        given = pool[: MIN_CACHED + (0, 0, -1, 0, 1, 1)[k % 6]]
        got = kept.apply(given)
        want = _plain_apply(plain, given)
        assert [repr(s) for s in got] == [repr(s) for s in want], k
    assert kept.patched > 50  # (the kept answer was used at 64 and 65)


def test_a_bare_endpoint_is_answered_by_its_new_state() -> None:
    """An endpoint with neither requests in flight nor a speed is answered by its input
    state itself: with new objects per call, one that says something else (a caller's own
    speed) at the same endpoint and scrape is answered anew, also after it became bare."""
    rng = random.Random(3)
    # plain states (as the datastore makes them)
    pool = [
        EndpointState(s.endpoint, s.metrics)
        for s in (endpoint_state(rng, i, 1000.0) for i in range(80))
    ]
    tracker = _Counting()
    for s in pool[1:]:  # every endpoint but the first has a speed
        tracker.start("warm", s.key, 100, 999.0)
        tracker.finish("warm", now=999.5, output_tokens=50)
    tracker.apply([replace(s) for s in pool])
    tracker.forget(pool[7].key)  # bare from now on
    tracker.apply([replace(s) for s in pool])
    for i in (0, 7):
        given = [replace(s) for s in pool]
        given[i] = replace(pool[i], seconds_per_output_token=0.5)
        assert tracker.apply(given)[i] is given[i]
    assert tracker.patched == 3  # (each from the kept answer)
    # the same in a full pass (another length)
    given = [replace(s) for s in pool[:-1]]
    given[0] = replace(pool[0], seconds_per_output_token=0.25)
    assert tracker.apply(given)[0] is given[0]


def test_endpoints_that_left_the_pool_are_forgotten_unless_requests_are_counted() -> None:
    # Pod IPs churn: what is kept per ip:port (the kept answer, the owner, the speed) must go
    # with the endpoint, or it grows with every address the pool ever had.
    tracker = InflightTracker()
    tracker.start("w", "10.9.9.9:8000", 1, 0.0)
    tracker.finish("w", now=1.0, output_tokens=5)  # a speed seen somewhere: idle ones are bare

    def pool(generation: int) -> list[EndpointState]:
        return [
            EndpointState(
                Endpoint(f"p{generation}-{i}", f"10.{generation}.0.{i}", 8000),
                EndpointMetrics(updated_at=1.0),
            )
            for i in range(100)
        ]

    old, new = pool(1), pool(2)
    tracker.apply(old)
    busy = old[0].endpoint.hostport
    tracker.start("r1", busy, 100, 2.0)
    tracker.start("r2", old[1].endpoint.hostport, 100, 2.0)
    tracker.finish("r2", now=3.0, output_tokens=50)  # a speed observed there, then idle
    tracker.apply(old)  # (answers kept for the two endpoints with a load or a speed)
    tracker.apply(new)
    gone = {s.endpoint.hostport for s in old}
    assert gone & set(tracker._applied) == {busy, old[1].endpoint.hostport}
    assert len(gone & set(tracker._owners)) == 100
    assert tracker.seconds_per_token(old[1].endpoint.hostport) is not None
    keep = {s.endpoint.hostport for s in new}
    tracker.forget_endpoints(keep)
    assert set(tracker._applied) <= keep | {busy}
    assert set(tracker._owners) <= keep | {busy}
    assert busy in tracker._owners  # r1 still runs there: its owner stays until it ends
    assert tracker.seconds_per_token(old[1].endpoint.hostport) is None
    assert [s.inflight_requests for s in tracker.apply([old[0]])] == [1]
