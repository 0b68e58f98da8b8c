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
