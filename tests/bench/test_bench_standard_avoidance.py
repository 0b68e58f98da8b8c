"""A Standard `avoidPrefillTokens` on the virtual fleet's flow control, with and without its
prefix-aware form `avoidPrefillUnlessCached` (the match read from the real scheduler)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from poolkeeper.bench.policies.flowpolicy import FlowPolicy, flow_policy
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.scheduling.types import LLMRequest


def _request(rid: str, group: str) -> LLMRequest:
    prompt = (f"[{group}] you are helpful. " * 400)[:8000] + f" question {rid}"
    return LLMRequest(rid, "m", "m", prompt=prompt, prompt_tokens=2005, max_tokens=8, stream=True)


@pytest.mark.parametrize(("unless_cached", "to_holder"), [(None, False), (256, True)])
def test_standard_avoidance_keeps_a_busy_prefix_holder_only_when_prefix_aware(
    unless_cached: int | None, to_holder: bool
) -> None:
    # Standard's default speed and count refinements off: the two forms alone.
    band = {
        "avoidPrefillTokens": 256,
        "avoidPrefillUnlessCached": unless_cached,
        "avoidPrefillSlowdown": None,
        "avoidPrefillMinClear": None,
    }
    config = FlowControlConfig.model_validate(
        {"holdNewPrefixes": None, "bands": {"standard": band}}
    )
    policy = flow_policy("poolkeeper", random.Random(1), config)
    assert isinstance(policy, FlowPolicy)
    assert (policy.facts is not None) is to_holder  # read for the option, without the hold
    pool = [
        EndpointState(
            Endpoint(f"s{i}", f"10.0.0.{i}", 8000),
            EndpointMetrics(updated_at=1.0, served_model="m"),
        )
        for i in (1, 2, 3)
    ]
    holder = policy.offer(_request("a0", "a"), pool, now=1.0)
    assert holder is not None
    # The prompt just sent there is still in its prefill (2,005 tokens since the scrape).
    pool = [replace(s, unseen_tokens=2005) if s.key == holder.key else s for s in pool]
    again = policy.offer(_request("a1", "a"), pool, now=1.001)
    assert again is not None
    assert (again.key == holder.key) is to_holder


@pytest.mark.parametrize("observed", [False, True])
def test_the_default_standard_band_moves_off_a_prompt_just_sent_once_speeds_are_observed(
    observed: bool,
) -> None:
    # The shipped Standard refinements (speed and count), 10 servers: s1 looks idlest by its
    # scrape but was just sent 2,005 tokens. Observed at one speed, no request goes there;
    # unobserved (what the policy would see if it did not apply its own speeds before the
    # narrowing, as the EPP's states carry them) the scheduler sends it some.
    config = FlowControlConfig.model_validate({"holdNewPrefixes": None})
    policy = flow_policy("poolkeeper", random.Random(1), config)
    assert isinstance(policy, FlowPolicy)
    pool = [
        EndpointState(
            Endpoint(f"s{i}", f"10.0.0.{i}", 8000),
            EndpointMetrics(
                updated_at=1.0,
                served_model="m",
                running=0 if i == 1 else 24,
                kv_cache_usage=0.0 if i == 1 else 0.5,
            ),
            unseen_tokens=2005 if i == 1 else 0,
        )
        for i in range(1, 11)
    ]
    if observed:
        for state in pool:
            policy.inner.speed.observe(state.endpoint.hostport, 0.5, 50)
    picks = [policy.offer(_request(f"b{i}", f"g{i}"), pool, now=1.002) for i in range(20)]
    to_busy = sum(1 for p in picks if p is not None and p.endpoint.name == "s1")
    assert all(p is not None for p in picks)
    assert (to_busy == 0) is observed, to_busy
