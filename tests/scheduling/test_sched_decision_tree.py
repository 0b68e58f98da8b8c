"""The decision-tree filter and the GIE v0.3 parity preset against the upstream cases."""

from __future__ import annotations

import collections

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import RequestShed
from tests.scheduling.sched_factories import key, request, scheduler, state

V03 = "gie-v0.3-decision-tree"
CRIT, STD, SHED = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE

# The v0.3 hermetic test cases (gie.md section 7.2), as pools of three pods.
CASES: list[tuple[str, list[EndpointState], str, Criticality, int]] = [
    (
        "lower queue and kv, no active lora",
        [
            state(1, waiting=3, kv=0.2, active=("foo", "bar")),
            state(2, waiting=0, kv=0.1, active=("foo",)),
            state(3, waiting=10, kv=0.2, active=("foo",)),
        ],
        "my-model-12345",
        CRIT,
        2,
    ),
    (
        "active lora, low queue",
        [
            state(1, waiting=0, kv=0.2, active=("foo", "bar")),
            state(2, waiting=0, kv=0.1, active=("foo", "sql-lora-1fdg2")),
            state(3, waiting=10, kv=0.2, active=("foo", "bar")),
        ],
        "sql-lora-1fdg2",
        CRIT,
        2,
    ),
    (
        "no lora despite active model, avoid excessive queue",
        [
            state(1, waiting=10, kv=0.2, active=("foo", "bar")),
            state(2, waiting=200, kv=0.1, active=("foo", "sql-lora-1fdg2")),
            state(3, waiting=6, kv=0.2, active=("foo",)),
        ],
        "sql-lora-1fdg2",
        CRIT,
        3,
    ),
    (
        "non-critical but one server has capacity",
        [
            state(1, waiting=4, kv=0.2, active=("foo", "bar", "sql-lora-1fdg3")),
            state(2, waiting=200, kv=0.1, active=("foo", "sql-lora-1fdg3")),
            state(3, waiting=6, kv=0.2, active=("foo",)),
        ],
        "sql-lora-1fdg3",
        SHED,
        1,
    ),
    (
        "standard takes the non-critical path too (v0.3)",
        [state(1, waiting=6, kv=0.2), state(2, waiting=5, kv=0.8), state(3, waiting=0, kv=0.85)],
        "base",
        STD,
        2,
    ),
]


@pytest.mark.parametrize(
    ("pool", "target", "criticality", "want"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_v03_tree_picks_like_upstream(
    pool: list[EndpointState], target: str, criticality: Criticality, want: int
) -> None:
    for seed in range(20):  # the pick is deterministic in every case, whatever the RNG does
        sched = scheduler(V03, seed=seed)
        result = sched.schedule(request(target, criticality=criticality), pool, now=100.0)
        assert [t.key for t in result.targets] == [key(want)]


@pytest.mark.parametrize("criticality", [SHED, STD])
def test_v03_tree_sheds_non_critical_when_all_pods_are_past_thresholds(
    criticality: Criticality,
) -> None:
    pool = [
        state(1, waiting=6, kv=0.85),
        state(2, waiting=0, kv=0.9),
        state(3, waiting=10, kv=0.85),
    ]
    with pytest.raises(RequestShed) as info:
        scheduler(V03).schedule(request("foo", criticality=criticality), pool, now=100.0)
    assert info.value.http_status == 429


def test_v03_tree_never_sheds_critical() -> None:
    pool = [
        state(1, waiting=6, kv=0.85),
        state(2, waiting=0, kv=0.9),
        state(3, waiting=10, kv=0.85),
    ]
    result = scheduler(V03).schedule(request("foo", criticality=CRIT), pool, now=100.0)
    assert result.primary.key == key(2)  # least queue band -> pod2


def test_lora_soft_affinity_distribution() -> None:
    """Statistical check of the soft-affinity split (upstream TestLoRASoftAffinityDistribution)."""
    doc = {
        "plugins": [
            {"type": "lora-affinity-filter", "parameters": {"threshold": 0.9}},
            {"type": "random-picker", "parameters": {"maxNumOfEndpoints": 1}},
        ]
    }
    sched = scheduler(doc, seed=42)
    pool = [state(1, active=("a",), max_adapters=1), state(2, max_adapters=2)]
    n = 5000
    counts = collections.Counter(
        sched.schedule(request("a", request_id=f"r{i}"), pool, now=100.0).primary.key
        for i in range(n)
    )
    share = counts[key(1)] / n
    assert 0.88 < share < 0.92, counts  # 0.9 +- ~5 sigma
    assert counts[key(2)] > 0


def _tree(params: dict[str, object]) -> dict[str, object]:
    return {
        "plugins": [
            {"type": "low-queue-filter", "name": "q0", "parameters": {"threshold": 0}},
            {"type": "least-kv-cache-filter", "name": "kv"},
            {"type": "decision-tree-filter", "name": "tree", "parameters": params},
            {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 8}},
        ],
        "schedulingProfiles": [
            {"name": "p", "plugins": [{"pluginRef": "tree"}, {"pluginRef": "max-score-picker"}]}
        ],
    }


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({"current": "q0"}, {2, 3}),  # success, no next
        ({"current": "q0", "nextOnSuccess": "kv"}, {3}),  # kv band over the filtered {2, 3}
        ({"current": {"pluginRef": "kv"}, "nextOnSuccessOrFailure": {"pluginRef": "q0"}}, {3}),
        (
            {"current": "kv", "nextOnSuccess": {"decisionTree": {"current": "q0"}}},
            {3},
        ),
    ],
)
def test_decision_tree_success_paths(params: dict[str, object], want: set[int]) -> None:
    pool = [state(1, waiting=4, kv=0.0), state(2, waiting=0, kv=0.9), state(3, waiting=0, kv=0.1)]
    got = scheduler(_tree(params)).schedule(request(), pool, now=100.0)
    assert {t.key for t in got.targets} == {key(i) for i in want}


def test_decision_tree_failure_passes_the_original_input() -> None:
    pool = [state(1, waiting=4, kv=0.5), state(2, waiting=2, kv=0.0)]
    got = scheduler(_tree({"current": "q0", "nextOnFailure": "kv"})).schedule(
        request(), pool, now=100.0
    )
    assert [t.key for t in got.targets] == [key(2)]  # kv band over the original 2 endpoints


def test_decision_tree_failure_without_next_fails_the_profile() -> None:
    from poolkeeper.errors import FilteredOut

    pool = [state(1, waiting=4)]
    with pytest.raises(FilteredOut, match="passed the filters"):
        scheduler(_tree({"current": "q0"})).schedule(request(), pool, now=100.0)
