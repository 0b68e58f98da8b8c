"""Scheduler-backed bench policies observe speed from virtual finish times, as a router would."""

from __future__ import annotations

import random

import pytest

from poolkeeper.bench.policies.flowpolicy import FlowPolicy
from poolkeeper.bench.policies.routers import make_policy
from poolkeeper.bench.policies.schedpolicy import SchedulerPolicy
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.scheduling.types import LLMRequest


def _pool() -> list[EndpointState]:
    return [
        EndpointState(Endpoint(f"s{i}", f"10.0.0.{i}", 8000), EndpointMetrics(updated_at=1.0))
        for i in (1, 2)
    ]


def _request(rid: str, tokens: int = 100) -> LLMRequest:
    return LLMRequest(rid, "m", "m", prompt=f"prompt {rid}", prompt_tokens=3, max_tokens=tokens)


@pytest.mark.parametrize("name", ["poolkeeper-shed", "poolkeeper-proposed", "gie-v1"])
def test_finish_feeds_the_estimator_with_elapsed_virtual_time(name: str) -> None:
    policy = make_policy(name, random.Random(1))
    assert isinstance(policy, SchedulerPolicy)
    chosen = policy.pick(_request("a"), _pool(), now=2.0)
    policy.on_finish("a", chosen.endpoint.name, now=4.0)  # 2 s for 100 tokens
    policy.on_finish("a", chosen.endpoint.name, now=9.0)  # a repeat is not a second sample
    assert policy.speed.seconds_per_token(chosen.key) == pytest.approx(0.02)
    policy.on_finish("unknown", "s1", now=5.0)  # never picked: ignored
    assert len(policy.speed) == 1


def test_default_policy_moves_traffic_to_the_observed_faster_server() -> None:
    flow = make_policy("poolkeeper", random.Random(3))
    assert isinstance(flow, FlowPolicy)  # flow control in front of the scheduler policy
    policy = flow.inner
    assert isinstance(policy, SchedulerPolicy)
    pool = _pool()
    slow, fast = pool[0].key, pool[1].key
    # Equal load; one request each, and the first server took 8x longer per token.
    policy.speed.observe(slow, 8.0, 100)
    policy.speed.observe(fast, 1.0, 100)
    picks = [policy.pick(_request(f"r{i}"), pool, now=3.0).key for i in range(40)]
    assert picks.count(fast) == 40
    assert slow not in picks
