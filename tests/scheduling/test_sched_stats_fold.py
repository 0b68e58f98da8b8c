"""Plugin timers record with an append and bucket later: the histograms read the same as if
every value had been observed at once, and what is pending stays bounded."""

from __future__ import annotations

import random

import pytest

from poolkeeper.scheduling.profile import FOLD_EVERY
from poolkeeper.scheduling.stats import PLUGIN_DURATION_BUCKETS, HistogramData
from tests.scheduling.sched_factories import request, scheduler, state


@pytest.mark.parametrize("top", [0.5, 1e-4])  # (1e-4: all in the first bucket, folded at once)
def test_recorded_values_read_as_observed_ones_bit_for_bit(top: float) -> None:
    rng = random.Random(7)
    values = [
        min(top, rng.choice([0.0, 1e-4, 2e-4, 0.5]) or rng.expovariate(50000)) for _ in range(997)
    ]
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


def test_a_profile_buckets_one_timer_every_fold_every_runs_in_turn() -> None:
    sched = scheduler("default")
    pool = [state(i) for i in range(1, 4)]
    timers = [hist for _, hist in sched.stats.plugins()]
    bound = FOLD_EVERY * len(timers)
    runs = 2 * bound + 3 * FOLD_EVERY + 5
    for run in range(1, runs + 1):
        before = [len(t.pending) for t in timers]
        sched.schedule(request(prompt="a" * 100), pool, now=100.0)
        after = [len(t.pending) for t in timers]
        folded = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a <= b]
        # one timer bucketed on every FOLD_EVERY-th run, none on the others
        assert len(folded) == (run % FOLD_EVERY == 0), run
        assert max(after) <= bound  # never more pending
    pending = sorted(len(t.pending) for t in timers)
    assert pending[0] < pending[-1]  # in turn, not all at once
    # nothing lost: every run's value bucketed (`count` buckets what is pending first), once
    assert {t.count for t in timers} == {runs}
