"""`DatastoreSnapshot.states`: one `EndpointState` per endpoint and scrape.

The values kept between decisions (`InflightTracker.apply`'s answers, `columns.py`) compare
states by identity, so a reused state must mean "nothing changed there": a new scrape makes a
new state, an endpoint not scraped since keeps its object, across the snapshots the metrics
writes make; an older snapshot still reads its own metrics; new endpoints are new states.
"""

from __future__ import annotations

import random

from poolkeeper.datastore import Datastore
from poolkeeper.datastore.columns import MIN_CACHED, Column, LocalScratch
from poolkeeper.datastore.endpoint import EndpointMetrics, EndpointState
from poolkeeper.datastore.inflight import InflightTracker
from tests.datastore.test_datastore_store import pool, spec

POOL = "default/p"


def _store(n: int) -> Datastore:
    store = Datastore()
    store.set_resources([pool("p", {"app": "x"})], [])
    store.set_endpoints([spec(f"e{i}", f"10.0.0.{i}", app="x") for i in range(n)])
    return store


def test_a_state_is_made_anew_only_where_the_endpoint_was_scraped() -> None:
    store = _store(3)
    keys = [s.key for s in store.snapshot().states(POOL)]
    for i, key in enumerate(keys):
        store.update_metrics(key, EndpointMetrics(waiting=i, updated_at=1.0))
    first = store.snapshot()
    before = first.states(POOL)
    assert first.states(POOL) is before  # (the same snapshot: the same answer)
    scraped = EndpointMetrics(waiting=9, updated_at=2.0)
    store.update_metrics(keys[1], scraped)
    after = store.snapshot().states(POOL)
    assert after[0] is before[0]
    assert after[2] is before[2]
    assert after[1] is not before[1]
    assert after[1].metrics is scraped
    assert [s.metrics.waiting for s in after] == [0, 9, 2]
    # the older snapshot reads its own metrics, whichever snapshot wrote the memo last
    assert [s.metrics.waiting for s in first.states(POOL)] == [0, 1, 2]
    assert store.snapshot().states(POOL)[1] is after[1]


def test_new_endpoints_are_new_states() -> None:
    store = _store(2)
    before = store.snapshot().states(POOL)
    store.set_endpoints([spec("e0", "10.0.0.0", app="x"), spec("f1", "10.0.0.1", app="x")])
    after = store.snapshot().states(POOL)
    assert [s.endpoint.name for s in after] == ["e0", "f1"]
    assert all(a is not b for a, b in zip(after, before, strict=True))


def test_kept_columns_follow_scrapes_through_reused_states() -> None:
    """Decisions over the datastore's states (through the tracker, as the Director reads
    them) at a pool above `MIN_CACHED`: a kept column equals the plain comprehension after
    every round of scrapes, and only the scraped positions changed object."""
    n = MIN_CACHED + 6
    store = _store(n)
    rng = random.Random(5)
    keys = [s.key for s in store.snapshot().states(POOL)]
    tracker = InflightTracker()
    tracker.start("w", keys[0], 10, 0.5)
    tracker.finish("w", now=1.0, output_tokens=5)  # a speed somewhere: not the empty fast path

    def waiting(s: EndpointState) -> int:
        return s.metrics.waiting + s.inflight_requests

    column = Column(lambda c: [waiting(s) for s in c], waiting)
    previous: list[EndpointState] | None = None
    for step in range(40):
        scraped = set(rng.sample(range(n), rng.randint(0, 5)))
        for i in scraped:
            store.update_metrics(
                keys[i], EndpointMetrics(waiting=rng.randint(0, 9), updated_at=step)
            )
        if step % 7 == 3:
            tracker.start(f"r{step}", keys[step % n], 10, step)  # a send: that position changes
            scraped.add(step % n)
        states = tracker.apply(store.snapshot().states(POOL))
        got = column.values(LocalScratch(), states)
        assert got == [waiting(s) for s in states], step
        if previous is not None:
            changed = {i for i in range(n) if states[i] is not previous[i]}
            assert changed == scraped, step
        previous = states
