"""Table-driven tests of the load and LoRA scorers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from poolkeeper.datastore.endpoint import EndpointState
from tests.scheduling.sched_factories import plugin, request, scores_of, state


def approx(values: list[float]) -> list[object]:
    return [pytest.approx(v) for v in values]


@pytest.mark.parametrize(
    ("params", "waiting", "unseen", "want"),
    [
        ({}, [0, 5, 10], [0, 0, 0], [1.0, 0.5, 0.0]),
        ({}, [4, 4, 4], [0, 0, 0], [1.0, 1.0, 1.0]),  # all equal -> 1
        ({}, [0, 1], [2, 0], [0.0, 1.0]),  # unseen in-flight counts as queued
        ({"countUnseen": False}, [0, 1], [2, 0], [1.0, 0.0]),
        ({"minSpan": 8}, [0, 2], [0, 0], [1.0, 0.75]),  # small gap costs a little
        ({"minSpan": 8}, [0, 16], [0, 0], [1.0, 0.0]),  # a large gap spans the range
    ],
    ids=["minmax", "equal", "unseen", "blind", "minspan-small", "minspan-large"],
)
def test_queue_scorer(
    params: dict[str, object], waiting: list[int], unseen: list[int], want: list[float]
) -> None:
    pool = [
        state(i, waiting=w, unseen=u) for i, (w, u) in enumerate(zip(waiting, unseen, strict=True))
    ]
    assert scores_of(plugin("queue-scorer", params), request(), pool) == approx(want)


def test_queue_scorer_counts_answered_unseen_requests_only_if_told() -> None:
    # Endpoint 0: 3 unseen requests, 2 of which already answered; endpoint 1: 2 waiting.
    pool = [replace(state(0, unseen=3), unseen_answered=2), state(1, waiting=2)]
    # By default the answered ones run: 1 queued against 2.
    assert scores_of(plugin("queue-scorer"), request(), pool) == approx([1.0, 0.0])
    # `answeredRun: false`: every unseen request queues, 3 against 2.
    blind = plugin("queue-scorer", {"answeredRun": False})
    assert scores_of(blind, request(), pool) == approx([0.0, 1.0])


@pytest.mark.parametrize(
    ("running", "unseen", "want"),
    [
        ([0, 10, 20], [0, 0, 0], [1.0, 0.5, 0.0]),
        ([3, 3], [0, 0], [1.0, 1.0]),
        ([2, 3], [2, 0], [0.0, 1.0]),
    ],
)
def test_running_requests_size_scorer(
    running: list[int], unseen: list[int], want: list[float]
) -> None:
    pool = [
        state(i, running=r, unseen=u) for i, (r, u) in enumerate(zip(running, unseen, strict=True))
    ]
    assert scores_of(plugin("running-requests-size-scorer"), request(), pool) == approx(want)


@pytest.mark.parametrize(
    ("kv", "want"),
    [
        ([0.0, 0.25, 1.0], [1.0, 0.75, 0.0]),
        ([1.5, -0.2], [0.0, 1.0]),  # out-of-range scrapes are clamped
        ([math.nan, 0.5], [0.0, 0.5]),  # NaN counts as full
    ],
)
def test_kv_cache_scorer(kv: list[float], want: list[float]) -> None:
    pool = [state(i, kv=v) for i, v in enumerate(kv)]
    for name in ("kv-cache-utilization-scorer", "kv-cache-scorer"):  # alias
        assert scores_of(plugin(name), request(), pool) == approx(want)


def test_kv_cache_scorer_counts_unseen_tokens() -> None:
    pool = [
        state(1, kv=0.2, unseen=1, unseen_tokens=300, num_gpu_blocks=10, block_size=100),
        state(2, kv=0.2, unseen=1, unseen_tokens=300),  # capacity unknown: scraped value
    ]
    assert scores_of(plugin("kv-cache-scorer"), request(), pool) == approx([0.5, 0.8])


@pytest.mark.parametrize(
    ("unit", "pool", "want"),
    [
        ("requests", [state(1, inflight=4), state(2), state(3, inflight=2)], [0, 1, 0.5]),
        (
            "tokens",
            [state(1, inflight=1, inflight_tokens=10), state(2, inflight=1, inflight_tokens=30)],
            [1, 0],
        ),
        ("requests", [state(1), state(2)], [1, 1]),
    ],
)
def test_inflight_load_scorer(unit: str, pool: list[EndpointState], want: list[float]) -> None:
    scorer = plugin("inflight-load-scorer", {"unit": unit})
    assert scores_of(scorer, request(), pool) == approx([float(w) for w in want])


@pytest.mark.parametrize(
    ("endpoint", "want"),
    [
        (state(1, active=("a",), max_adapters=1), 1.0),  # active
        (state(1, active=("b",), max_adapters=2), 0.8),  # free slot
        (state(1, active=("b",), queued_adapters=("a",), max_adapters=2), 0.6),  # waiting, full
        (state(1, active=("b", "c"), max_adapters=2), 0.0),  # full, absent
        (state(1), 0.0),  # no LoRA on this server
    ],
    ids=["active", "free-slot", "waiting", "full", "no-lora"],
)
def test_lora_affinity_scorer_values(endpoint: EndpointState, want: float) -> None:
    assert scores_of(plugin("lora-affinity-scorer"), request("a"), [endpoint]) == [want]


def lora_pool(served: tuple[str | None, ...]) -> list[EndpointState]:
    """Five adapter states; `served[i]` is what endpoint i+1 reports as its base model."""
    s1, s2, s3, s4, s5 = served
    return [
        state(1, active=("a",), max_adapters=2, served_model=s1),  # a active, a slot free
        state(2, active=("b",), max_adapters=2, served_model=s2),  # free slot
        state(3, active=("b",), queued_adapters=("a",), max_adapters=2, served_model=s3),  # full
        state(4, active=("b", "c"), max_adapters=2, served_model=s4),  # full
        state(5, served_model=s5),  # no LoRA
    ]


ALL_SERVE = ("base",) * 5
NONE_SERVE = (None,) * 5


@pytest.mark.parametrize(
    ("target", "served", "want"),
    [
        # The base model is resident everywhere it is served: uniform, whatever the adapters.
        ("base", ALL_SERVE, [1.0] * 5),
        # Adapter requests are unaffected by the served model.
        ("a", ALL_SERVE, [1.0, 0.8, 0.6, 0.0, 0.0]),
        ("a", NONE_SERVE, [1.0, 0.8, 0.6, 0.0, 0.0]),
        # Nothing reported: the GIE values, which herd base traffic onto free slots.
        ("base", NONE_SERVE, [0.8, 0.8, 0.0, 0.0, 0.0]),
        # Per endpoint: a server of another base model, or one that does not say, is scored
        # as before.
        ("base", ("base", "other", "base", None, "base"), [1.0, 0.8, 1.0, 0.0, 1.0]),
    ],
    ids=["base-served", "adapter", "adapter-unreported", "base-unreported", "mixed"],
)
def test_lora_affinity_scorer_counts_the_served_base_model_as_active(
    target: str, served: tuple[str | None, ...], want: list[float]
) -> None:
    scores = scores_of(plugin("lora-affinity-scorer"), request(target), lora_pool(served))
    assert scores == approx(want)


def test_lora_affinity_scorer_custom_values() -> None:
    scorer = plugin("lora-affinity-scorer", {"activeScore": 0.9, "freeSlotScore": 0.1})
    pool = [state(1, active=("a",), max_adapters=1), state(2, max_adapters=1)]
    assert scores_of(scorer, request("a"), pool) == approx([0.9, 0.1])
