"""In-flight accounting, and the herding it prevents between two metric scrapes."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from poolkeeper.datastore import Datastore
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.datastore.load import effective_waiting, saturations
from tests.datastore.test_datastore_store import pool, spec
from tests.scheduling.sched_factories import key, request, scheduler, state


def test_start_finish_counts_and_idempotence() -> None:
    t = InflightTracker()
    t.start("a", key(1), 100, now=10.0)
    t.start("b", key(1), 50, now=10.1)
    t.start("c", key(2), 7, now=10.2)
    assert t.counts(key(1)) == (2, 150)
    assert len(t) == 3
    assert t.finish("a") is True
    assert t.finish("a") is False  # idempotent
    assert t.counts(key(1)) == (1, 50)
    assert "a" not in t
    assert t.finish("never-started") is False


def test_restart_moves_the_request() -> None:
    t = InflightTracker()
    t.start("a", key(1), 10, now=1.0)
    t.start("a", key(2), 10, now=2.0)  # retried on another endpoint
    assert t.counts(key(1)) == (0, 0)
    assert t.counts(key(2)) == (1, 10)


def test_in_flight_requests_are_counted_by_target_model() -> None:
    """Flow control tells a server's adapter-deferred requests by their model (slots.py)."""
    t = InflightTracker()
    t.start("a", key(1), 10, now=1.0, model="lora-a")
    t.start("b", key(1), 10, now=1.1, model="lora-a")
    t.start("c", key(1), 10, now=1.2, model="lora-b")
    t.start("d", key(1), 10, now=1.3)  # no model given: counted in the total only
    assert t.models(key(1)) == {"lora-a": 2, "lora-b": 1}
    (applied,) = t.apply([state(1, updated_at=5.0)])
    assert (applied.inflight_requests, dict(applied.inflight_models)) == (4, t.models(key(1)))
    t.start("c", key(2), 10, now=2.0, model="lora-b")  # re-routed: moves with its model
    t.finish("a")
    assert (t.models(key(1)), t.models(key(2))) == ({"lora-a": 1}, {"lora-b": 1})
    t.finish("b")
    t.finish("d")
    assert t.models(key(1)) == {}
    (cleared,) = t.apply([applied])
    assert dict(cleared.inflight_models) == {}


def test_apply_fills_inflight_and_unseen_after_the_scrape() -> None:
    t = InflightTracker()
    t.start("old", key(1), 100, now=9.0)  # before the scrape at 10.0: already in the gauges
    t.start("new1", key(1), 10, now=10.5)
    t.start("new2", key(1), 20, now=10.6)
    pool = [state(1, updated_at=10.0), state(2, updated_at=10.0)]
    out = t.apply(pool)
    assert (out[0].inflight_requests, out[0].inflight_tokens) == (3, 130)
    assert (out[0].unseen_requests, out[0].unseen_tokens) == (2, 30)
    assert out[1] is pool[1]  # nothing in flight: the same object
    t.finish("new1")
    again = t.apply(pool)
    assert (again[0].unseen_requests, again[0].unseen_tokens) == (1, 20)


def test_apply_reuses_unchanged_states_and_clears_stale_counts() -> None:
    t = InflightTracker()
    t.start("x", key(1), 5, now=11.0)
    pool = [state(1, updated_at=10.0)]
    first = t.apply(pool)
    assert t.apply(pool)[0] is first[0]  # no change: cached
    t.start("y", key(1), 5, now=11.5)
    assert t.apply(pool)[0].unseen_requests == 2
    t.finish("x")
    t.finish("y")
    carried = [state(1, unseen=3, inflight=3)]  # counts from an earlier apply
    cleared = t.apply(carried)[0]
    assert (cleared.inflight_requests, cleared.unseen_requests) == (0, 0)


def test_an_unseen_request_that_answered_runs_and_no_longer_queues() -> None:
    t = InflightTracker()
    t.start("old", key(1), 100, now=9.0)  # in the scraped gauges already
    t.start("a", key(1), 10, now=10.5)
    t.start("b", key(1), 20, now=10.6)
    pool = [state(1, updated_at=10.0, waiting=2)]
    before = t.apply(pool)[0]
    assert t.first_token("a")
    assert t.first_token("old")  # answered too, but the scrape already counted it somewhere
    assert not t.first_token("never-started")
    after = t.apply(pool)[0]
    assert after is not before  # the change is seen, not a cached state
    assert (after.unseen_requests, after.unseen_tokens, after.unseen_answered) == (2, 30, 1)
    # The queue estimates leave the answered one out; KV and running still count it.
    assert effective_waiting(after) == 2 + 1
    assert saturations([after], now=10.7, staleness_s=1, queue_threshold=3, kv_threshold=1) == [1.0]
    t.finish("a")
    assert t.apply(pool)[0].unseen_answered == 0


def test_scrape_lag_counts_requests_just_before_the_scrape_as_unseen() -> None:
    t = InflightTracker(scrape_lag_s=0.05)
    t.start("b", key(1), 1, now=9.90)
    t.start("a", key(1), 1, now=9.97)
    assert t.apply([state(1, updated_at=10.0)])[0].unseen_requests == 1
    with pytest.raises(ValueError, match="scrape_lag_s"):
        InflightTracker(scrape_lag_s=-1)


def test_sweep_drops_requests_whose_finish_was_lost() -> None:
    t = InflightTracker()
    t.start("a", key(1), 1, now=1.0)
    t.start("b", key(1), 1, now=50.0)
    assert t.sweep(now=60.0, max_age_s=30.0) == ["a"]
    assert t.counts(key(1)) == (1, 1)


def burst(
    preset: str, pool: list[EndpointState], n: int, *, track: bool
) -> collections.Counter[str]:
    """n decisions between two scrapes (all metrics taken at t=99.99)."""
    sched = scheduler(preset, seed=3)
    tracker = InflightTracker()
    picks: collections.Counter[str] = collections.Counter()
    for i in range(n):
        now = 100.0 + i * 0.001
        states = tracker.apply(pool) if track else pool
        req = request(prompt=f"distinct prompt {i} " * 8, request_id=f"r{i}")
        target = sched.schedule(req, states, now=now).primary.key
        tracker.start(req.request_id, target, 100, now)
        picks[target] += 1
    return picks


def test_burst_between_scrapes_spreads_over_endpoints() -> None:
    # One endpoint looks best in the last scrape; 16 requests arrive before the next.
    pool = [state(1, waiting=0, updated_at=99.99)] + [
        state(i, waiting=1, updated_at=99.99) for i in range(2, 9)
    ]
    with_tracking = burst("default", pool, 16, track=True)
    assert max(with_tracking.values()) <= 3, with_tracking
    assert len(with_tracking) == 8  # every endpoint used
    # Without router-side accounting the stale "best" endpoint takes the whole burst.
    blind = burst("gie-v1-default", pool, 16, track=False)
    assert blind == {key(1): 16}


def test_equal_pool_burst_is_even_with_tracking() -> None:
    pool = [state(i, updated_at=99.99) for i in range(1, 5)]
    picks = burst("default", pool, 12, track=True)
    assert sorted(picks.values()) == [3, 3, 3, 3]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "finish", "scrape", "first"]),
        st.integers(0, 7),  # request id
        st.integers(1, 3),  # endpoint
        st.integers(0, 50),  # tokens
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_apply_matches_a_naive_recount(ops: list[tuple[str, int, int, int]]) -> None:
    """Whatever the order of starts, finishes and scrapes, `apply` (with its cache) gives the
    counts a from-scratch recount gives."""
    tracker = InflightTracker()
    live: dict[str, tuple[int, int, float]] = {}  # id -> (endpoint, tokens, started)
    answered: set[str] = set()  # ids whose first byte came back
    scraped = {1: 0.5, 2: 0.5, 3: 0.5}
    # Snapshots are replaced only by a scrape, so `apply`'s per-endpoint cache gets hits.
    pool = [state(i, updated_at=scraped[i]) for i in (1, 2, 3)]
    now = 1.0
    for op, rid, ep, tokens in ops:
        now += 0.01
        if op == "start":
            tracker.start(f"r{rid}", key(ep), tokens, now)
            live[f"r{rid}"] = (ep, tokens, now)
            answered.discard(f"r{rid}")  # a restart has not answered yet
        elif op == "finish":
            assert tracker.finish(f"r{rid}") == (f"r{rid}" in live)
            live.pop(f"r{rid}", None)
            answered.discard(f"r{rid}")
        elif op == "first":
            assert tracker.first_token(f"r{rid}") == (f"r{rid}" in live)
            if f"r{rid}" in live:
                answered.add(f"r{rid}")
        else:
            scraped[ep] = now
            pool[ep - 1] = state(ep, updated_at=now)
        for got in tracker.apply(pool):
            i = int(got.endpoint.name.removeprefix("pod"))
            mine = [(r, t, s) for r, (e, t, s) in live.items() if e == i]
            unseen = [(r, t) for r, t, s in mine if s > scraped[i]]
            assert got.inflight_requests == len(mine)
            assert got.inflight_tokens == sum(t for _, t, _ in mine)
            assert got.unseen_requests == len(unseen)
            assert got.unseen_tokens == sum(t for _, t in unseen)
            assert got.unseen_answered == sum(r in answered for r, _ in unseen)


def test_a_new_pod_at_a_reused_address_starts_clean() -> None:
    tracker = InflightTracker()
    old = state(1)
    tracker.apply([old])  # the tracker notes which pod sits at 10.0.0.1:8000
    tracker.start("r1", key(1), 50, now=1.0)
    tracker.start("r2", key(1), 70, now=1.1)
    tracker.finish("r2", now=2.0, output_tokens=10)  # an observed speed for the old pod
    assert tracker.apply([old])[0].inflight_requests == 1
    new_pod = replace(old, endpoint=replace(old.endpoint, name="another-pod"))
    fresh = tracker.apply([new_pod])[0]
    assert fresh.inflight_requests == 0
    assert fresh.inflight_tokens == 0
    assert fresh.seconds_per_output_token is None
    assert tracker.finish("r1") is False  # the old pod's request no longer counts
    assert len(tracker) == 0
    # The same pod again (same name and namespace) keeps its counts.
    tracker.start("r3", key(1), 10, now=3.0)
    assert tracker.apply([new_pod])[0].inflight_requests == 1


def test_a_standalone_server_in_pools_of_two_namespaces_keeps_its_counts() -> None:
    # A spec without a namespace takes each pool's: one server, two Endpoint namespaces. Read
    # through both pools in turn it is still the one pod at its ip:port, not IP reuse.
    store = Datastore()
    store.set_resources([pool("p", {"app": "x"}, ns="a"), pool("q", {"app": "x"}, ns="b")], [])
    store.set_endpoints([spec("e0", "10.0.0.1", app="x")])
    snap = store.snapshot()
    tracker = InflightTracker()
    tracker.apply(snap.states("a/p"))
    tracker.start("r1", "10.0.0.1:8000", 10, now=1.0)
    assert [s.inflight_requests for s in tracker.apply(snap.states("a/p"))] == [1]
    assert [s.inflight_requests for s in tracker.apply(snap.states("b/q"))] == [1]
    assert "r1" in tracker
