"""Plugin timers record with an append and bucket later: the histograms read the same as if
every value had been observed at once, and what is pending stays bounded."""

from __future__ import annotations

import random

from poolkeeper.scheduling.profile import FOLD_EVERY
from poolkeeper.scheduling.stats import PLUGIN_DURATION_BUCKETS, HistogramData
from tests.scheduling.sched_factories import request, scheduler, state


def test_recorded_values_read_as_observed_ones_bit_for_bit() -> None:
    rng = random.Random(7)
    values = [rng.choice([0.0, 1e-4, 2e-4, 0.5]) or rng.expovariate(5000) for _ in range(997)]
    observed, recorded = (HistogramData(PLUGIN_DURATION_BUCKETS) for _ in range(2))
    for i, value in enumerate(values):
        observed.observe(value)
        recorded.record(value)
        if i % 301 == 0:
            recorded.observe(value)  # an `observe` between records keeps their order
            observed.observe(value)
    assert recorded.pending  # nothing was bucketed by `record` itself
    assert recorded.cumulative() == observed.cumulative()
    assert recorded.sum == observed.sum  # the same float: added in the same order
    assert recorded.count == observed.count == len(values) + 4
    assert recorded.counts == observed.counts
    assert not recorded.pending


def test_a_profile_buckets_its_timers_every_fold_every_runs() -> None:
    sched = scheduler("default")
    pool = [state(i) for i in range(1, 4)]
    timers = [hist for _, hist in sched.stats.plugins()]
    for _ in range(FOLD_EVERY - 1):
        sched.schedule(request(prompt="a" * 100), pool, now=100.0)
    assert all(len(t.pending) == FOLD_EVERY - 1 for t in timers if t.pending)
    assert any(t.pending for t in timers)
    sched.schedule(request(prompt="a" * 100), pool, now=100.0)
    # the run that reaches the bound buckets what came before it, then records its own
    assert max(len(t.pending) for t in timers) == 1
    assert {t.count for t in timers} == {FOLD_EVERY}
