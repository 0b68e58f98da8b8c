"""`ref-kv-phase-*`: step ends learnt from the steps that publish KV events (issue #38)."""

from __future__ import annotations

import random

import pytest

from poolkeeper.bench.policies.kv_event_phase import (
    KV_EVENT_POLICIES,
    KVEventPhase,
    StepEventRecorder,
)
from poolkeeper.bench.policies.reference_policies import is_baseline
from poolkeeper.bench.policies.routers import ALL_POLICIES, KNOWN_POLICIES, make_policy
from poolkeeper.datastore.endpoint import EndpointMetrics, EndpointState
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.engine import EngineModel
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.virtual import VirtualFleet

PROMPT = "abcd" * 40  # 40 tokens: two full prompt blocks of 16 and 8 tokens over


class _Sink:
    def __init__(self) -> None:
        self.events: list[str] = []

    def stored(self, hashes: list[int], parent: int | None) -> None:
        self.events.append(f"stored {len(hashes)}")

    def removed(self, hashes: list[int]) -> None:
        self.events.append(f"removed {len(hashes)}")


def _run(*, vllm: bool, inner: _Sink | None = None) -> tuple[list[float], StepEventRecorder]:
    """One request (40-token prompt, 30 output tokens) alone on an engine, step by step:
    every step end, and the recorder that saw them."""
    engine = EngineModel(EngineConfig())
    recorder = StepEventRecorder(inner, engine.config.block_size, vllm=vllm)
    engine.kv.sink = recorder
    engine.step_observer = recorder.step_ended
    model = engine.config.model
    engine.submit(engine.create_request("r", model, PROMPT, arrival=0.0, max_tokens=30), 0.0)
    ends: list[float] = []
    while (t := engine.next_event_time()) is not None:
        engine.advance(t)
        ends.append(t)
    return ends, recorder


def test_the_prompt_rule_publishes_the_steps_that_store_prompt_blocks() -> None:
    inner = _Sink()
    ends, recorder = _run(vllm=False, inner=inner)
    assert len(ends) == 30  # one prefill step that samples the first token, 29 decode steps
    assert list(recorder.publishing_ends) == [ends[0]]  # the prefill step stored two blocks
    assert inner.events == ["stored 1", "stored 1"]  # still told to the sink it replaced


def test_the_vllm_rule_also_publishes_each_output_block_as_it_fills() -> None:
    ends, recorder = _run(vllm=True)
    # Step 0 computes tokens 0-39 (blocks 0 and 1 full); decode step k (1-based) computes
    # token 39 + k, so tokens 47 and 63 (the ends of blocks 2 and 3) fill in steps 8 and 24.
    assert list(recorder.publishing_ends) == [ends[0], ends[8], ends[24]]


def test_a_recorder_knows_only_the_publishing_ends_before_its_horizon() -> None:
    recorder = StepEventRecorder(None, 16, vllm=False)
    assert recorder.published_before(1.0) is None
    recorder.publishing_ends.extend([0.010, 0.030])
    assert recorder.published_before(0.029) == 0.010
    assert recorder.published_before(0.030) == 0.030
    assert recorder.published_before(0.009) is None


def _request(rid: str) -> LLMRequest:
    return LLMRequest(
        request_id=rid, model="m", target_model=EngineConfig().model, prompt=PROMPT,
        prompt_tokens=40, max_tokens=30, stream=True,
    )  # fmt: skip


def test_the_policy_takes_the_latest_of_first_bytes_and_published_ends_late() -> None:
    fleet = VirtualFleet([EngineConfig()], seed=1)
    policy = KV_EVENT_POLICIES["ref-kv-phase-vllm-2ms"](random.Random(1))
    assert isinstance(policy, KVEventPhase)
    policy.bind(fleet)
    key = fleet.endpoints[0].hostport
    assert fleet.engines[0].step_observer is not None
    policy.pick(_request("r"), [EndpointState(fleet.endpoints[0], EndpointMetrics())], 0.0)
    recorder = policy.recorders[key]
    assert policy.known_step_end(key, 0.1) is None  # nothing seen, nothing published
    recorder.publishing_ends.extend([0.050, 0.060])
    assert policy.known_step_end(key, 0.061) == 0.050  # 0.060 is not 2 ms old yet
    assert policy.known_step_end(key, 0.062) == 0.060
    policy.on_first_token("r", 0.061)  # a first byte is seen at once
    assert policy.known_step_end(key, 0.0615) == 0.061
    step = policy.next_step_s(key)
    assert policy.score(key, 0.061 + step / 4) == pytest.approx((step * 0.75 + step,))


def test_the_kv_event_policies_are_references_run_by_name() -> None:
    assert set(KV_EVENT_POLICIES) == {
        f"ref-kv-phase-{rule}-{delay}"
        for rule in ("prompt", "vllm") for delay in ("0ms", "0p5ms", "1ms", "2ms")
    }  # fmt: skip
    for name, cls in KV_EVENT_POLICIES.items():
        assert name in KNOWN_POLICIES
        assert name not in ALL_POLICIES
        assert not is_baseline(name)
        assert make_policy(name, random.Random(1)).name == name
        assert cls.vllm_rule == ("-vllm-" in name)
    assert KV_EVENT_POLICIES["ref-kv-phase-prompt-0p5ms"].report_delay_s == 0.0005
