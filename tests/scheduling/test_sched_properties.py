"""Property tests: scores stay in [0, 1]; a decision only ever names one of the candidates."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.errors import NoReadyEndpoint, RequestShed
from poolkeeper.scheduling.interfaces import ProfileResult
from poolkeeper.scheduling.presets import PRESETS
from tests.scheduling.sched_factories import NOW, cycle, plugin, request, scheduler, scores_of

ADAPTERS = st.frozensets(st.sampled_from(["a", "b", "c", "d"]), max_size=3)
KV = st.one_of(st.floats(min_value=0.0, max_value=1.0), st.floats(allow_nan=True))


@st.composite
def endpoint_states(draw: st.DrawFn) -> list[EndpointState]:
    n = draw(st.integers(min_value=1, max_value=12))
    out = []
    for i in range(n):
        unseen = draw(st.integers(0, 20))
        metrics = EndpointMetrics(
            waiting=draw(st.integers(0, 500)),
            running=draw(st.integers(0, 500)),
            kv_cache_usage=draw(KV),
            active_adapters=draw(ADAPTERS),
            waiting_adapters=draw(ADAPTERS),
            max_adapters=draw(st.integers(0, 4)),
            block_size=draw(st.sampled_from([None, 16])),
            num_gpu_blocks=draw(st.sampled_from([None, 1, 1000])),
            updated_at=draw(st.sampled_from([0.0, NOW - 5.0, NOW - 0.05, NOW])),
        )
        out.append(
            EndpointState(
                Endpoint(f"p{i}", f"10.1.0.{i}", 8000),
                metrics,
                inflight_requests=unseen + draw(st.integers(0, 5)),
                inflight_tokens=draw(st.integers(0, 10**6)),
                unseen_requests=unseen,
                unseen_tokens=draw(st.integers(0, 10**5)),
            )
        )
    return out


SCORERS: list[tuple[str, dict[str, Any]]] = [
    ("queue-scorer", {}),
    ("queue-scorer", {"minSpan": 8, "countUnseen": False}),
    ("running-requests-size-scorer", {"minSpan": 3}),
    ("kv-cache-utilization-scorer", {}),
    ("inflight-load-scorer", {"unit": "tokens"}),
    ("inflight-load-scorer", {}),
    ("lora-affinity-scorer", {}),
    ("prefix-cache-scorer", {"blockSize": 4}),
]

PROMPTS = st.text(alphabet="abc", max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool=endpoint_states(), target=st.sampled_from(["a", "b", "base"]), prompt=PROMPTS)
def test_every_scorer_stays_in_unit_interval(
    pool: list[EndpointState], target: str, prompt: str
) -> None:
    for type_, params in SCORERS:
        scorer = plugin(type_, params)
        req = request(target, prompt=prompt)
        if type_ == "prefix-cache-scorer":  # warm the index with part of the pool
            scorer.post_cycle(cycle(), req, ProfileResult("p", (pool[0],)))
        values = scores_of(scorer, req, pool)
        assert len(values) == len(pool)
        for v in values:
            assert not math.isnan(v), (type_, values)
            assert 0.0 <= v <= 1.0, (type_, values)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pool=endpoint_states(),
    target=st.sampled_from(["a", "base"]),
    prompt=PROMPTS,
    criticality=st.sampled_from(list(Criticality)),
    seed=st.integers(0, 1000),
)
def test_decisions_only_name_candidates(
    pool: list[EndpointState], target: str, prompt: str, criticality: Criticality, seed: int
) -> None:
    keys = {id(s) for s in pool}
    for name in PRESETS:
        sched = scheduler(name, seed=seed)
        req = request(target, prompt=prompt * 20, criticality=criticality)
        for _ in range(2):  # the second decision sees the prefix index the first one filled
            try:
                result = sched.schedule(req, pool, now=NOW)
            except (RequestShed, NoReadyEndpoint):
                assert name == "gie-v0.3-decision-tree"  # only the tree may shed or fail here
                continue
            assert result.targets
            assert all(id(t) in keys for t in result.targets)
            assert len({t.key for t in result.targets}) == len(result.targets)
            assert set(result.scores) == {t.key for t in result.targets}


@settings(max_examples=100, deadline=None)
@given(
    scores=st.lists(
        st.floats(min_value=0.0, max_value=10.0, allow_nan=False), min_size=1, max_size=30
    ),
    k=st.integers(1, 6),
    picker=st.sampled_from(["max-score-picker", "random-picker", "weighted-random-picker"]),
)
def test_pickers_return_distinct_valid_indices(scores: list[float], k: int, picker: str) -> None:
    cands = [
        EndpointState(Endpoint(f"p{i}", f"10.2.0.{i}", 1), EndpointMetrics())
        for i in range(len(scores))
    ]
    out = plugin(picker, {"maxNumOfEndpoints": k}).pick(cands, scores)
    assert len(out) == min(k, len(scores))
    assert len(set(out)) == len(out)
    assert all(0 <= i < len(scores) for i in out)
    if picker == "max-score-picker":
        assert scores[out[0]] == max(scores)
        picked = [scores[i] for i in out]
        assert picked == sorted(picked, reverse=True)
