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


def _run(rule: str, inner: _Sink | None = None) -> tuple[list[float], StepEventRecorder]:
    """One request (40-token prompt, 30 output tokens) alone on an engine, step by step:
    every step end, and the recorder that saw them."""
    engine = EngineModel(EngineConfig())
    recorder = StepEventRecorder(inner, engine.config.block_size, rule=rule)
    engine.kv.sink = recorder
    engine.step_observer = recorder.step_ended
    model = engine.config.model
    engine.submit(engine.create_request("r", model, PROMPT, arrival=0.0, max_tokens=30), 0.0)
    ends: list[float] = []
    while (t := engine.next_event_time()) is not None:
        engine.advance(t)
        ends.append(t)
    return ends, recorder


def test_the_prompt_rule_publishes_the_steps_whose_sink_events_the_simulator_sends() -> None:
    inner = _Sink()
    ends, recorder = _run("prompt", inner)
    assert len(ends) == 30  # one prefill step that samples the first token, 29 decode steps
    # The simulator's events: the prefill step stored two blocks, and since the KV events
    # were made vLLM's (docs/notes/2026-12-07-kv-events-decode.md) the steps that fill
    # output blocks store them too: the same steps as the vllm rule's.
    assert list(recorder.publishing_ends) == [ends[0], ends[8], ends[24]]
    assert inner.events == ["stored 1"] * 4  # still told to the sink it replaced


def test_the_vllm_rule_also_publishes_each_output_block_as_it_fills() -> None:
    ends, recorder = _run("vllm")
    # Step 0 computes tokens 0-39 (blocks 0 and 1 full); decode step k (1-based) computes
    # token 39 + k, so tokens 47 and 63 (the ends of blocks 2 and 3) fill in steps 8 and 24.
    assert list(recorder.publishing_ends) == [ends[0], ends[8], ends[24]]


def test_a_recorder_knows_only_the_publishing_ends_before_its_horizon() -> None:
    recorder = StepEventRecorder(None, 16, rule="prompt")
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


def test_the_sent_model_leaves_later_requests_out_of_the_step_in_progress() -> None:
    fleet = VirtualFleet([EngineConfig()], seed=1)
    policy = KV_EVENT_POLICIES["ref-kv-phase-vllm-0ms-sent"](random.Random(1))
    policy.bind(fleet)
    key, state = fleet.endpoints[0].hostport, EndpointState(fleet.endpoints[0], EndpointMetrics())
    c = EngineConfig()
    policy.pick(_request("a"), [state], 0.0)
    policy.on_first_token("a", 0.010)  # one decoding request; a step began at 0.010
    policy.pick(_request("b"), [state], 0.012)  # 40 prompt tokens sent during that step
    in_progress = (c.step_overhead_s + c.decode_token_s) * c.time_scale
    assert policy.step_after_s(key, 0.010) == pytest.approx(in_progress)
    step = policy.next_step_s(key)  # the next step holds b's prefill too
    assert step == pytest.approx(in_progress + 40 * c.prefill_token_s * c.time_scale)
    now = 0.013
    assert policy.score(key, now) == pytest.approx((0.010 + in_progress - now + step,))
    # Past its modelled end, the later steps (with b's prefill) follow back to back.
    later = 0.010 + in_progress + 1.5 * step
    assert policy.score(key, later) == pytest.approx((0.5 * step + step,))
    policy.on_first_token("b", 0.020)
    assert policy.sent[key] == {}  # answered: no longer pending anywhere


def test_the_none_and_all_rules_bound_what_a_step_can_tell() -> None:
    ends, recorder = _run("all")
    assert list(recorder.publishing_ends) == ends
    assert not _run("none")[1].publishing_ends
    with pytest.raises(ValueError, match="unknown rule 'sglang'"):
        StepEventRecorder(None, 16, rule="sglang")


def test_the_kv_event_policies_are_references_run_by_name() -> None:
    screened = (
        "ref-kv-phase-prompt-0p5ms", "ref-kv-phase-vllm-2ms", "ref-kv-phase-vllm-1ms-sent",
        "ref-kv-phase-vllm-0p5ms-count", "ref-kv-phase-none-0ms-sent-ctx-errp3",
        "ref-kv-phase-vllm-1ms-late-ctx-errm3", "ref-kv-phase-all-2ms-late-ctx",
    )  # fmt: skip
    assert set(screened) <= set(KV_EVENT_POLICIES)
    for name, cls in KV_EVENT_POLICIES.items():
        assert name in KNOWN_POLICIES
        assert name not in ALL_POLICIES
        assert not is_baseline(name)
        assert make_policy(name, random.Random(1)).name == name
        assert name.startswith(f"ref-kv-phase-{cls.rule}-")
        assert cls.sent_model == any(f"-{m}" in name for m in ("sent", "count", "late"))
        assert cls.count_model == ("-count" in name)
        assert cls.late_model == ("-late" in name)
        assert cls.context_model == ("-ctx" in name)
        assert cls.model_error == {"": 0.0, "p": 0.03, "m": -0.03}[name.partition("-err")[2][:1]]


def test_counting_the_silent_steps_tells_an_overrun_from_a_new_step() -> None:
    fleet = VirtualFleet([EngineConfig()], seed=1)
    names = (
        "ref-kv-phase-vllm-0ms-count",
        "ref-kv-phase-vllm-0p5ms-count",
        "ref-kv-phase-vllm-0ms-sent",
    )
    count, late, sent = (KV_EVENT_POLICIES[n](random.Random(1)) for n in names)
    state = EndpointState(fleet.endpoints[0], EndpointMetrics())
    for policy in (count, late, sent):
        policy.bind(fleet)  # the last bind's recorder sees the steps; share it
        policy.pick(_request("r"), [state], 0.0)
    engine, key = fleet.engines[0], fleet.endpoints[0].hostport
    for policy in (count, late):
        policy.recorders[key] = sent.recorders[key]
    engine.submit(engine.create_request("r", engine.config.model, PROMPT, arrival=0.0,
                  max_tokens=30), 0.0)  # fmt: skip
    for k in range(8):  # the prefill step and 7 silent decode steps; the 8th fills block 2
        t = engine.next_event_time()
        assert t is not None
        engine.advance(t)
        if k == 0:
            for policy in (count, late, sent):
                policy.on_first_token("r", t)
    current = engine._step
    assert current is not None
    assert sent.recorders[key].publishes(current)
    step = count.next_step_s(key)
    # The model leaves out the context read (44 ns a token), so its eight steps end a few
    # microseconds before the true one: ask just before the true end, after the model's.
    now = current.end - 2e-6
    known = sent.known_step_end(key, now)
    assert known is not None
    assert known + 8 * step < now
    # Told at once of every publishing step, and knowing this one publishes: not reported
    # yet, so it is still running (an overrun), ending about now.
    assert count.score(key, now) == pytest.approx((step,))
    # Half a millisecond late, or not counting, the wait says nothing: a new step began.
    for policy in (late, sent):
        assert policy.score(key, now)[0] == pytest.approx(2 * step, abs=1e-4)


def test_the_late_rule_and_the_context_read_and_a_model_error() -> None:
    fleet = VirtualFleet([EngineConfig()], seed=1)
    names = ("ref-kv-phase-vllm-1ms-late-ctx-errp3", "ref-kv-phase-all-1ms-late-ctx")
    wrong, late = (KV_EVENT_POLICIES[n](random.Random(1)) for n in names)
    state = EndpointState(fleet.endpoints[0], EndpointMetrics())
    for policy in (wrong, late):  # the last bound one's recorder sees the steps
        policy.bind(fleet)
        policy.pick(_request("r"), [state], 0.0)
    engine, key = fleet.engines[0], fleet.endpoints[0].hostport
    engine.submit(engine.create_request("r", engine.config.model, PROMPT, arrival=0.0,
                  max_tokens=30), 0.0)  # fmt: skip
    for k in range(5):
        t = engine.next_event_time()
        assert t is not None
        engine.advance(t)
        if k == 0:
            for policy in (late, wrong):
                policy.on_first_token("r", t)
    current = engine._step
    assert current is not None
    c = engine.config
    # One decoding request with 44 tokens computed: the model now has the step to within the
    # token it writes (the engine reads 45; 44 ns a step per request, left out).
    context = c.kv_read_token_s * 44 * c.time_scale
    assert late.context_s(key) == pytest.approx(context)
    step = late.next_step_s(key)
    assert step == pytest.approx((c.step_overhead_s + c.decode_token_s) * c.time_scale + context)
    assert step == pytest.approx(current.end - current.start, abs=c.kv_read_token_s * 1.01)
    assert wrong.next_step_s(key) == pytest.approx(1.03 * step)
    # Every step reports, 1 ms late, and the model is 30 % short: at 95 % of the step in
    # progress, the last known end is its start, its modelled end is before the horizon, yet
    # it was not reported by then: it was still running (steps follow from the horizon on).
    length = current.end - current.start
    now = current.start + 0.95 * length
    assert late.known_step_end(key, now) == current.start
    late.model_error = -0.3
    short = late.next_step_s(key)
    assert current.start + short < now - 0.001
    assert late.score(key, now) == pytest.approx((now - 0.001 + short - now + short,))
    late.late_model = False  # without the rule: a new step began at the modelled end
    assert late.score(key, now) == pytest.approx((current.start + 2 * short - now + short,))
