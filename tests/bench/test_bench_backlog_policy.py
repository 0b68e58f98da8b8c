"""`poolkeeper-backlog`: the real scheduler on the `prefill-backlog` preset behind flow control,
fed the virtual fleet's first tokens and ends as the EPP's Director feeds the real one."""

from __future__ import annotations

import random

from poolkeeper.bench.policies.flowpolicy import FlowPolicy
from poolkeeper.bench.policies.routers import ALL_POLICIES, make_policy
from poolkeeper.bench.policies.schedpolicy import SchedulerPolicy
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.types import LLMRequest


def _pool() -> list[EndpointState]:
    return [
        EndpointState(
            Endpoint(f"s{i}", f"10.0.0.{i}", 8000),
            EndpointMetrics(updated_at=1.0, served_model="m"),
        )
        for i in (1, 2, 3)
    ]


def _request(rid: str, tokens: int) -> LLMRequest:
    return LLMRequest(rid, "m", "m", prompt="p" * 4 * tokens, prompt_tokens=tokens, max_tokens=8)


def test_first_tokens_and_ends_reach_the_backlog_and_steer_the_next_picks() -> None:
    assert "poolkeeper-backlog" in ALL_POLICIES
    flow = make_policy("poolkeeper-backlog", random.Random(2))
    assert isinstance(flow, FlowPolicy)
    # It learns from first tokens, so the fleet shows it which unseen requests answered (as
    # Envoy's first-byte report shows the EPP); `classic` learns nothing and sees none.
    assert flow.observes_first_tokens
    classic = make_policy("poolkeeper-classic", random.Random(2))
    assert isinstance(classic, FlowPolicy)
    assert not classic.observes_first_tokens
    default = make_policy("poolkeeper", random.Random(2))
    assert isinstance(default, FlowPolicy)
    assert default.observes_first_tokens  # the default learns them (its backlog and gate)
    inner = flow.inner
    assert isinstance(inner, SchedulerPolicy)
    scorer = inner.scheduler.plugins["prefill-backlog-scorer"]
    assert isinstance(scorer, PrefillBacklogScorer)
    pool = _pool()
    busy = flow.pick(_request("long", 4000), pool, now=2.0).key
    assert scorer.backlog.tokens(busy) == 4000
    for i in range(12):  # short prompts stay off the server still prefilling the long one
        chosen = flow.pick(_request(f"s{i}", 20), pool, now=2.0)
        assert chosen.key != busy
        flow.on_first_token(f"s{i}", now=2.01)
        flow.on_finish(f"s{i}", chosen.endpoint.name, now=2.1)
    flow.on_first_token("long", now=2.2)
    assert scorer.backlog.tokens(busy) == 0
    flow.on_finish("long", busy, now=3.0)
    assert len(scorer.backlog) == 0


def test_every_candidate_runs_by_name_behind_flow_control_or_shedding() -> None:
    from poolkeeper.bench.policies.routers import CANDIDATE_POLICIES, KNOWN_POLICIES
    from poolkeeper.bench.policies.schedpolicy import CANDIDATE_PRESETS
    from poolkeeper.scheduling.candidate_presets import CANDIDATES

    assert set(CANDIDATE_PRESETS.values()) <= set(CANDIDATES) | {"classic", "default"}
    assert not set(CANDIDATE_POLICIES) & set(ALL_POLICIES)  # only when asked for by name
    for name in CANDIDATE_PRESETS:
        assert name in KNOWN_POLICIES
        flow = make_policy(name, random.Random(1))
        shed = make_policy(f"{name}-shed", random.Random(1))
        assert isinstance(flow, FlowPolicy)
        assert isinstance(shed, SchedulerPolicy)
        assert shed.admission is not None
        assert flow.pick(_request("r", 10), _pool(), now=2.0).key
