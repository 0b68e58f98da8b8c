"""Table-driven tests of every built-in filter."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from pydantic import ValidationError

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import STALE, saturations
from poolkeeper.errors import RequestShed
from poolkeeper.flowcontrol.saturation import SaturationDetector
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.plugins.saturation_filter import SaturationFilter
from poolkeeper.scheduling.plugins.stale_filter import ADAPTER_GRACE_S, StaleMetricsFilter
from tests.scheduling.sched_factories import NOW, cycle, key, plugin, request, state


def keys(states: object) -> list[str]:
    assert isinstance(states, list | tuple)
    return [s.key for s in states]


POOL_Q = [state(1, waiting=0), state(2, waiting=3), state(3, waiting=10), state(4, waiting=128)]


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({}, [1, 2, 3, 4]),  # default 128, inclusive (v0.5 plugin)
        ({"threshold": 128, "inclusive": False}, [1, 2, 3]),  # v0.3: strict <
        ({"threshold": 3}, [1, 2]),
        ({"threshold": 3, "inclusive": False}, [1]),
        ({"threshold": 0, "inclusive": False}, []),  # failure = empty
    ],
    ids=["default", "v0.3-strict", "3-inclusive", "3-strict", "none"],
)
def test_low_queue_filter(params: dict[str, object], want: list[int]) -> None:
    f = plugin("low-queue-filter", params)
    assert keys(f.filter(cycle(), request(), POOL_Q)) == [key(i) for i in want]


def test_low_queue_filter_counts_unseen_requests() -> None:
    pool = [state(1, waiting=2, unseen=2), state(2, waiting=3)]
    assert keys(plugin("low-queue-filter", {"threshold": 3}).filter(cycle(), request(), pool)) == [
        key(2)
    ]
    blind = plugin("low-queue-filter", {"threshold": 3, "countUnseen": False})
    assert keys(blind.filter(cycle(), request(), pool)) == [key(1), key(2)]


@pytest.mark.parametrize(
    ("waiting", "want"),
    [
        ([0, 4, 10], [1]),  # band: q <= 0 + 10/3
        ([0, 3, 10], [1, 2]),
        ([0, 3, 9], [1, 2]),  # 3 <= 0 + 9/3
        ([5, 5, 5], [1, 2, 3]),  # all equal: all kept
        ([7], [1]),
        ([0, 100, 100, 1], [1, 4]),  # band 0..25
    ],
)
def test_least_queue_filter_keeps_lowest_band(waiting: list[int], want: list[int]) -> None:
    pool = [state(i + 1, waiting=w) for i, w in enumerate(waiting)]
    assert keys(plugin("least-queue-filter").filter(cycle(), request(), pool)) == [
        key(i) for i in want
    ]


@pytest.mark.parametrize(
    ("kv", "want"),
    [
        ([0.1, 0.2, 0.9], [1, 2]),  # band 0.1 + 0.8/3 = 0.367
        ([0.1, 0.5, 0.9], [1]),
        ([0.3, 0.3], [1, 2]),
    ],
)
def test_least_kv_cache_filter_keeps_lowest_band(kv: list[float], want: list[int]) -> None:
    pool = [state(i + 1, kv=v) for i, v in enumerate(kv)]
    assert keys(plugin("least-kv-cache-filter").filter(cycle(), request(), pool)) == [
        key(i) for i in want
    ]


def test_least_kv_cache_filter_adds_unseen_tokens_when_capacity_known() -> None:
    # 1000 tokens of capacity: 500 unseen tokens add 0.5 to pod1's 0.1.
    pool = [
        state(1, kv=0.1, unseen=1, unseen_tokens=500, num_gpu_blocks=10, block_size=100),
        state(2, kv=0.3),
    ]
    assert keys(plugin("least-kv-cache-filter").filter(cycle(), request(), pool)) == [key(2)]


LORA_POOL = [
    state(1, active=("a",), max_adapters=2),  # affinity (active)
    state(2, queued_adapters=("a",), max_adapters=1),  # affinity (waiting)
    state(3, active=("b",), max_adapters=2),  # available (free slot)
    state(4, active=("b", "c"), max_adapters=2),  # full
]


@pytest.mark.parametrize(
    ("target", "pool", "threshold", "want"),
    [
        ("a", LORA_POOL, 1.0, [1, 2]),  # both groups, threshold 1 -> affinity
        ("a", LORA_POOL, 0.0, [3]),  # both groups, threshold 0 -> available
        ("z", LORA_POOL, 1.0, [1, 3]),  # no affinity: the free-slot endpoints
        ("a", LORA_POOL[3:], 1.0, []),  # neither: failure
        ("a", LORA_POOL[:2], 0.0, [1, 2]),  # only affinity exists
    ],
    ids=["affinity", "available", "new-adapter", "none", "only-affinity"],
)
def test_lora_affinity_filter(
    target: str, pool: list[EndpointState], threshold: float, want: list[int]
) -> None:
    f = plugin("lora-affinity-filter", {"threshold": threshold})
    assert keys(f.filter(cycle(), request(target), pool)) == [key(i) for i in want]


def served_by(pool: list[EndpointState], *served: str | None) -> list[EndpointState]:
    """`pool` with endpoint i reporting `served[i]` as its base model."""
    return [
        replace(s, metrics=replace(s.metrics, served_model=m))
        for s, m in zip(pool, served, strict=True)
    ]


@pytest.mark.parametrize(
    ("target", "served", "threshold", "want"),
    [
        # The base model is loaded wherever it is served: every endpoint, whatever the adapters
        # and whatever the threshold (nothing is in the free-slot group).
        ("base", ("base",) * 4, 1.0, [1, 2, 3, 4]),
        ("base", ("base",) * 4, 0.0, [1, 2, 3, 4]),
        # Adapter requests are unaffected by the served model.
        ("a", ("base",) * 4, 1.0, [1, 2]),
        ("a", ("base",) * 4, 0.0, [3]),
        # Nothing reported: upstream's rule, only the free-slot endpoints.
        ("base", (None,) * 4, 1.0, [1, 3]),
        # Per endpoint: only those reporting this base model join the affinity group.
        ("base", ("other", None, "base", "base"), 1.0, [3, 4]),
    ],
    ids=["base", "base-threshold-0", "adapter", "adapter-available", "unreported", "mixed"],
)
def test_lora_affinity_filter_counts_the_served_base_model_as_loaded(
    target: str, served: tuple[str | None, ...], threshold: float, want: list[int]
) -> None:
    f = plugin("lora-affinity-filter", {"threshold": threshold})
    pool = served_by(LORA_POOL, *served)
    assert keys(f.filter(cycle(), request(target), pool)) == [key(i) for i in want]


@pytest.mark.parametrize(
    ("criticality", "passes"),
    [(Criticality.CRITICAL, True), (Criticality.STANDARD, False), (Criticality.SHEDDABLE, False)],
)
def test_critical_request_filter(criticality: Criticality, passes: bool) -> None:
    pool = [state(1), state(2)]
    out = plugin("critical-request-filter").filter(cycle(), request(criticality=criticality), pool)
    assert keys(out) == ([key(1), key(2)] if passes else [])


@pytest.mark.parametrize(
    ("metrics", "want"),
    [
        ([(5, 0.8), (6, 0.1), (0, 0.81)], [1]),  # inclusive thresholds
        ([(6, 0.85), (0, 0.9), (10, 0.85)], []),
        ([(0, 0.0), (1, 0.5)], [1, 2]),
    ],
)
def test_has_capacity_filter(metrics: list[tuple[int, float]], want: list[int]) -> None:
    pool = [state(i + 1, waiting=q, kv=kv) for i, (q, kv) in enumerate(metrics)]
    assert keys(plugin("has-capacity-filter").filter(cycle(), request(), pool)) == [
        key(i) for i in want
    ]


def test_drop_request_filter_sheds_with_429() -> None:
    with pytest.raises(RequestShed, match="shed") as info:
        plugin("drop-request-filter").filter(cycle(), request(), [state(1)])
    assert info.value.http_status == 429


@pytest.mark.parametrize(
    ("pool", "want"),
    [
        ([state(1, waiting=7), state(2, waiting=8)], [1]),  # queue limit 5 x 1.5 = 7.5
        ([state(1, kv=0.95), state(2, kv=0.97)], [1, 2]),  # KV limit 0.8 x 1.5 = 1.2 -> none over
        ([state(1), state(2, updated_at=NOW - 0.3)], [1]),  # stale (> 200 ms)
        ([state(1, updated_at=0.0), state(2)], [2]),  # never scraped
        ([state(1, waiting=3, unseen=5), state(2, waiting=6)], [2]),  # unseen counts
        ([state(1, waiting=50), state(2, updated_at=NOW - 5)], [1, 2]),  # none pass: fail open
    ],
    ids=["queue", "kv-not-over", "stale", "never-scraped", "unseen", "fail-open"],
)
def test_saturation_filter(pool: list[EndpointState], want: list[int]) -> None:
    assert keys(list(plugin("saturation-filter").filter(cycle(), request(), pool))) == [
        key(i) for i in want
    ]


def test_saturation_filter_and_admission_share_one_definition() -> None:
    """The filter keeps what `saturations` says is within 1 + headroom; admission averages the
    same values (stale counted 1.0): one definition of saturation, two consumers."""
    pool = [
        state(1, waiting=7),
        state(2, waiting=8),
        state(3, kv=float("nan")),
        state(4, waiting=3, unseen=5),
        state(5, updated_at=NOW - 0.3),
        state(6, kv=1.7),
    ]
    values = saturations(pool, now=NOW, staleness_s=0.2, queue_threshold=5, kv_threshold=0.8)
    kept = plugin("saturation-filter").filter(cycle(), request(), pool)
    assert keys(list(kept)) == [s.key for s, v in zip(pool, values, strict=True) if v <= 1.5]
    assert keys(list(kept)) == [key(1), key(3), key(6)]
    report = SaturationDetector().assess(pool, NOW)
    assert report.stale == 1
    assert report.saturation == pytest.approx(
        sum(1.0 if v == STALE else v for v in values) / len(pool)
    )


def test_saturation_filter_headroom_and_kv_threshold() -> None:
    f = plugin("saturation-filter", {"headroom": 0.0, "kvCacheUtilThreshold": 0.5})
    pool = [state(1, kv=0.49), state(2, kv=0.51), state(3, waiting=4), state(4, waiting=6)]
    assert keys(list(f.filter(cycle(), request(), pool))) == [key(1), key(3)]


# queueDepthThreshold 1, headroom 1: a queue of 2 is overloaded; batches of 8 slots.
SLOTS8 = {"queueDepthThreshold": 1, "kvCacheUtilThreshold": 1.0, "headroom": 1, "maxNumSeqs": 8}


def test_saturation_filter_max_num_seqs_counts_the_queue_of_a_full_batch_only() -> None:
    f = plugin("saturation-filter", SLOTS8)
    pool = [
        state(1, running=8, waiting=3),  # full batch with a queue: its requests wait for slots
        state(2, running=5, waiting=3),  # free slots: the queue starts at the next step
        state(3, running=8, waiting=1),  # full, a queue of one: below the limit
        state(4, running=7, waiting=2, unseen=1),  # 7 + 1 unseen: full once it answers
    ]
    assert keys(list(f.filter(cycle(), request(), pool))) == [key(2), key(3), key(4)]
    without = plugin("saturation-filter", {k: v for k, v in SLOTS8.items() if k != "maxNumSeqs"})
    assert keys(list(without.filter(cycle(), request(), pool))) == [key(3)]


def test_saturation_filter_max_num_seqs_keeps_kv_stale_and_fail_open() -> None:
    f = plugin("saturation-filter", {**SLOTS8, "kvCacheUtilThreshold": 0.4})  # KV limit 0.8
    pool = [
        state(1, running=2, waiting=5, kv=0.9),  # batch not full, but KV past its limit
        state(2, running=2, waiting=5, updated_at=NOW - 5.0),  # stale
        state(3, running=2, waiting=5, kv=0.1),
    ]
    assert keys(list(f.filter(cycle(), request(), pool))) == [key(3)]
    full = [state(1, running=8, waiting=4), state(2, running=9, waiting=2)]
    assert keys(list(f.filter(cycle(), request(), full))) == [key(1), key(2)]  # fails open


LEARN = {k: v for k, v in SLOTS8.items() if k != "maxNumSeqs"} | {"learnMaxNumSeqs": True}


def _scrapes(f: SaturationFilter, gauges: list[tuple[int, int]], first: int = 0) -> list[str]:
    """Feed pod1's scrapes (running, waiting), numbered from `first`, one per call, beside an
    idle pod2; the kept keys of the last call."""
    kept: list[str] = []
    for i, (running, waiting) in enumerate(gauges, start=first):
        pool = [
            state(1, running=running, waiting=waiting, updated_at=NOW - 0.15 + 0.001 * i),
            state(2, running=1),
        ]
        kept = keys(list(f.filter(cycle(), request(), pool)))
    return kept


def test_learn_max_num_seqs_confirms_a_full_batch_when_its_queue_turns_over() -> None:
    f = plugin("saturation-filter", LEARN)
    assert isinstance(f, SaturationFilter)
    # Grows to 8, then stays at 8 while its queue shrinks 4 -> 3: slots turned over, still full.
    assert _scrapes(f, [(4, 0), (8, 2), (8, 4)]) == [key(1), key(2)]  # not confirmed yet
    assert _scrapes(f, [(8, 3)], first=3) == [key(2)]
    assert _scrapes(f, [(7, 3)], first=4) == [
        key(1),
        key(2),
    ]  # a free slot: the queue starts next step


def test_learn_max_num_seqs_never_takes_a_long_prefill_step_for_a_full_batch() -> None:
    """During a long step nothing is admitted: the queue grows, then running grows past the
    old most when the step ends (256-slot engines prefilling new 2,000-token prompts)."""
    f = plugin("saturation-filter", LEARN)
    assert isinstance(f, SaturationFilter)
    steps = [(3, 0), (3, 2), (3, 5), (3, 7), (10, 0), (10, 3), (10, 6), (16, 1), (16, 4)]
    for n in range(1, len(steps) + 1):
        g = plugin("saturation-filter", LEARN)
        assert isinstance(g, SaturationFilter)
        assert _scrapes(g, steps[:n]) == [key(1), key(2)]
    # The same scrapes without the learning drop pod1 whenever 2 or more wait there.
    plain = plugin("saturation-filter", {k: v for k, v in LEARN.items() if k != "learnMaxNumSeqs"})
    assert isinstance(plain, SaturationFilter)
    assert _scrapes(plain, steps) == [key(2)]


@pytest.mark.parametrize(
    ("metrics", "want"),
    [
        ([(1, 0.1), (4, 0.7)], [1, 2]),  # All pass - under thresholds
        ([(5, 0.8)], [1]),  # Pass - at threshold but under burst
        ([(5, 0.9)], [1]),  # Pass - in headroom burst
        ([(7, 0.1), (1, 0.1)], [2]),  # Filtered - exceeds queue burst
        ([(1, 0.97), (1, 0.5)], [2]),  # Filtered - exceeds KV burst
        ([(10, 0.1), (1, 0.99)], [1, 2]),  # Pass - all saturated (fail open)
        ([(6, 0.1), (1, 0.1)], [2]),  # exactly at the queue limit 6.0: dropped
        ([(1, 0.8 * 1.2), (1, 0.1)], [2]),  # exactly at the KV limit: dropped
    ],
)
def test_detector_test_go_filter(metrics: list[tuple[int, float]], want: list[int]) -> None:
    """Upstream `saturationdetector/utilization/detector_test.go@v1.5.0` TestDetector_Filter
    (queue 5, KV 0.8, headroom 0.2: limits 6.0 and 0.96, kept only strictly below)."""
    f = plugin("saturation-filter", {"headroom": 0.2})
    pool = [state(i + 1, waiting=q, kv=kv) for i, (q, kv) in enumerate(metrics)]
    assert keys(list(f.filter(cycle(), request(), pool))) == [key(i) for i in want]


@pytest.mark.parametrize(
    ("pool", "want"),
    [
        ([state(1), state(2, updated_at=NOW - 0.3)], [1]),
        ([state(1, updated_at=0.0), state(2, waiting=50)], [2]),  # never scraped; load ignored
        ([state(1, updated_at=NOW - 0.2), state(2)], [1, 2]),  # exactly at the limit: fresh
        ([state(1, updated_at=NOW - 1), state(2, updated_at=0.0)], [1, 2]),  # all stale: open
    ],
    ids=["stale", "never-scraped", "at-limit", "fail-open"],
)
def test_stale_metrics_filter(pool: list[EndpointState], want: list[int]) -> None:
    got = plugin("stale-metrics-filter").filter(cycle(), request(), pool)
    assert keys(list(got)) == [key(i) for i in want]


def test_stale_metrics_filter_threshold() -> None:
    f = plugin("stale-metrics-filter", staleness_s=1.0)
    pool = [state(1, updated_at=NOW - 0.9), state(2, updated_at=NOW - 1.1)]
    assert keys(list(f.filter(cycle(), request(), pool))) == [key(1)]


def test_stale_metrics_filter_keeps_late_servers_running_the_requests_adapter() -> None:
    # One adapter slot per server: lora-c runs only on pod1, whose scrape is 0.5 s late. Sent
    # to pod2, the request would wait there for an adapter slot behind pod2's whole batch.
    f = plugin("stale-metrics-filter")
    late = state(1, active=("lora-c",), max_adapters=1, updated_at=NOW - 0.5)
    other = state(2, active=("lora-a",), max_adapters=1)
    assert keys(list(f.filter(cycle(), request("lora-c"), [late, other]))) == [key(1), key(2)]
    assert keys(list(f.filter(cycle(), request("lora-a"), [late, other]))) == [key(2)]
    # A fresh server running it is enough; a scrape past the grace is dropped as before.
    fresh = state(3, active=("lora-c",), max_adapters=1)
    assert keys(list(f.filter(cycle(), request("lora-c"), [late, other, fresh]))) == [
        key(2), key(3)]  # fmt: skip
    gone = state(1, active=("lora-c",), max_adapters=1, updated_at=NOW - ADAPTER_GRACE_S - 0.1)
    assert keys(list(f.filter(cycle(), request("lora-c"), [gone, other]))) == [key(2)]


def test_staleness_comes_from_the_build_not_from_parameters() -> None:
    # One freshness setting (spec.scraping.stalenessMs): build_scheduler hands it to both
    # filters that skip stale endpoints; neither takes a threshold of its own.
    doc = {
        "plugins": [{"type": "stale-metrics-filter"}, {"type": "saturation-filter"}],
    }
    config = SchedulingConfig.model_validate(doc)
    for sched, want in [
        (build_scheduler(config, rng=random.Random(0)), 0.2),
        (build_scheduler(config, rng=random.Random(0), staleness_s=1.5), 1.5),
    ]:
        stale, saturation = sched.profiles["default"].filters
        assert isinstance(stale, StaleMetricsFilter)
        assert isinstance(saturation, SaturationFilter)
        assert (stale.staleness_s, saturation.staleness_s) == (want, want)
    for type_ in ("stale-metrics-filter", "saturation-filter"):
        bad = {"plugins": [{"type": type_, "parameters": {"metricsStalenessMs": 1000}}]}
        with pytest.raises(ValidationError, match="metricsStalenessMs"):
            SchedulingConfig.model_validate(bad)
