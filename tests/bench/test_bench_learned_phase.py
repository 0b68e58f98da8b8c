"""`ref-learned-phase*`: the step model and context learnt from what the EPP sees (issue #38)."""

from __future__ import annotations

import random

import pytest

from poolkeeper.bench.fleet.simrun import replay, scenario_for
from poolkeeper.bench.policies.learned_phase import (
    LEARNED_PHASE_POLICIES,
    LearnedPhase,
    default_coefficients,
)
from poolkeeper.bench.policies.reference_policies import is_baseline
from poolkeeper.bench.policies.routers import ALL_POLICIES, KNOWN_POLICIES, make_policy
from poolkeeper.bench.workload.workloads import generate
from poolkeeper.datastore.endpoint import EndpointMetrics, EndpointState
from poolkeeper.scheduling.steplearner import StepLearner
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.engine import EngineModel
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.virtual import VirtualFleet

PROMPT = "abcd" * 40  # 40 tokens


def _request(request_id: str, prompt: str = PROMPT, max_tokens: int = 30) -> LLMRequest:
    return LLMRequest(
        request_id=request_id, model="m", target_model=EngineConfig().model, prompt=prompt,
        prompt_tokens=len(prompt) // 4, max_tokens=max_tokens, stream=True,
    )  # fmt: skip


def _drive(
    learner: StepLearner, outputs: dict[str, tuple[float, int]], batches: bool = False
) -> EngineModel:
    """Requests (id -> (arrival, output tokens), 40-token prompts) on one engine, step by
    step, their sends, first bytes and ends told to `learner` as a router would see them."""
    engine = EngineModel(EngineConfig())
    engine.max_fused_steps = 1  # one outcome a step, as the stream shows them
    model = engine.config.model
    arrivals = sorted((t, rid) for rid, (t, _) in outputs.items())
    firsts: set[str] = set()
    while arrivals or engine.next_event_time() is not None:
        nxt = engine.next_event_time()
        if arrivals and (nxt is None or arrivals[0][0] <= nxt):
            at, rid = arrivals.pop(0)
            out = outputs[rid][1]
            engine.submit(engine.create_request(rid, model, PROMPT, arrival=at, max_tokens=out), at)
            learner.sent(rid, 40, at)
            continue
        assert nxt is not None
        for outcome in engine.advance(nxt):
            if batches:  # every step publishes a KV-event batch at its end
                learner.step_ended(outcome.time)
            for r in outcome.tokens:
                if r.request_id not in firsts:
                    firsts.add(r.request_id)
                    learner.observed(r.request_id, outcome.time, first=True, out=None)
            for r in outcome.finished:
                learner.observed(r.request_id, outcome.time, first=False, out=r.output_tokens)
    learner.advance(float("inf"))
    return engine


def _true(c: EngineConfig) -> tuple[float, float, float, float]:
    terms = (c.step_overhead_s, c.prefill_token_s, c.decode_token_s, c.kv_read_token_s)
    return tuple(x * c.time_scale for x in terms)  # type: ignore[return-value]


def test_with_the_engines_coefficients_every_span_is_counted_exactly() -> None:
    # Staggered requests: gaps of one and of several silent decode steps between step ends.
    learner = StepLearner(_true(EngineConfig()), learn=False)
    _drive(learner, {"a": (0.0, 40), "b": (0.013, 7), "c": (0.05, 25), "d": (0.2, 3)})
    assert list(learner.counts) == [(6, 6), (24, 24), (2, 2), (39, 39)]  # by end
    assert learner.coefficients() == _true(EngineConfig())  # `learn=False`: never moved


def test_a_prior_twice_too_long_counts_too_few_steps_and_the_counts_pull_r_down() -> None:
    learner = StepLearner(default_coefficients(2.0))
    _drive(learner, {"a": (0.0, 60), "b": (0.3, 60)})
    (counted_a, true_a), _ = list(learner.counts)
    assert counted_a < true_a  # two-step gaps taken for one
    assert learner.scale < 1.0


def test_the_learner_recovers_the_step_coefficients_from_a_wrong_prior() -> None:
    scenario = scenario_for("heavy-tail", 1)
    arrivals = generate(scenario.spec, rate=25.0, duration=10, seed=3)
    for factor in (2.0, 0.5):
        policy = make_policy("ref-learned-phase", random.Random(1), scenario)
        assert isinstance(policy, LearnedPhase)
        policy.prior_factor = factor
        replay(scenario.servers, arrivals, policy, seed=3)
        (learner,) = policy.learners.values()
        assert learner.fitting
        assert learner.resets == 0
        got, true = learner.coefficients(), _true(scenario.servers[0])
        assert got[0] == pytest.approx(true[0], rel=0.02)  # overhead
        assert got[1] == pytest.approx(true[1], rel=0.02)  # per prefill token
        # Decoding requests and context grow together: a trade between the two is allowed.
        assert got[2] == pytest.approx(true[2], rel=0.15)
        assert got[3] == pytest.approx(true[3], rel=0.15)


def test_an_idle_server_starts_a_step_when_a_request_arrives() -> None:
    learner = StepLearner(default_coefficients())
    learner.sent("a", 40, 1.0)
    assert learner.boundary == 1.0
    learner.sent("b", 40, 1.002)  # busy now: the step in progress began at 1.0
    assert learner.boundary == 1.0
    assert learner.prefill_sent(1.0) == 40
    assert learner.prefill_sent(2.0) == 80


def test_the_context_counts_each_decoding_request_prompt_plus_its_steps() -> None:
    learner = StepLearner(_true(EngineConfig()), learn=False)
    learner.sent("a", 40, 0.0)
    step = learner.step_s(40, 0, 40)
    learner.observed("a", step, first=True, out=None)
    assert learner.context() == 40  # its prompt, first byte not yet counted
    learner.advance(step + 0.001)  # the group at `step` is counted: one step
    assert learner.context() == 41  # prompt + its first token, read by the next step
    three = sum(learner.step_s(0, 1, 41 + i) for i in range(3))  # context 41, 42, 43
    learner.observed("a", step + three, first=False, out=4)
    learner.advance(2.0)
    assert list(learner.counts) == [(3, 3)]


def test_a_one_token_answer_ending_at_its_first_byte_never_decodes() -> None:
    # Its first byte and end come at one step end: it must leave no decoding entry behind
    # (one would keep the server busy and its context growing for ever).
    learner = StepLearner(default_coefficients())
    learner.sent("a", 40, 0.0)
    learner.observed("a", 0.01, first=True, out=None)
    learner.observed("a", 0.01, first=False, out=1)
    learner.advance(0.02)
    assert learner.decoding == {}
    assert not learner.busy()
    assert learner.context() == 0


def test_prompt_blocks_sent_before_to_a_server_are_taken_as_cached_there() -> None:
    fleet = VirtualFleet([EngineConfig(), EngineConfig()], seed=1)
    policy = LEARNED_PHASE_POLICIES["ref-learned-phase"](random.Random(1))
    policy.bind(fleet)
    a, b = (EndpointState(e, EndpointMetrics()) for e in fleet.endpoints)
    policy.pick(_request("r1"), [a], 0.0)
    policy.pick(_request("r2"), [a], 0.001)  # same 40-token prompt: two full blocks of 16
    policy.pick(_request("r3"), [b], 0.002)  # another server: nothing cached there
    waiting = policy.learners[a.key].waiting
    assert waiting["r1"] == (0.0, 40, 40)
    assert waiting["r2"] == (0.001, 40, 8)
    assert policy.learners[b.key].waiting["r3"] == (0.002, 40, 40)
    assert policy.next_step_s(a.key) == pytest.approx(policy.learners[a.key].step_s(48, 0, 80))


def test_the_learned_phase_policies_are_references_run_by_name() -> None:
    for name in LEARNED_PHASE_POLICIES:
        assert name in KNOWN_POLICIES
        assert name not in ALL_POLICIES
        assert not is_baseline(name)
        assert isinstance(make_policy(name, random.Random(1)), LearnedPhase)


def test_late_reports_are_seen_later_in_order_and_one_step_stays_one_group() -> None:
    fleet = VirtualFleet([EngineConfig()], seed=1)
    policy = LEARNED_PHASE_POLICIES["ref-learned-phase-oracle-late1ms"](random.Random(1))
    policy.bind(fleet)
    state = EndpointState(fleet.endpoints[0], EndpointMetrics())
    learner = policy.learners[state.key]
    assert learner.merge_s == 0.001
    policy.pick(_request("a"), [state], 0.0)
    policy.pick(_request("b", prompt="wxyz" * 40), [state], 0.0)
    policy.on_first_token("a", 0.010)  # both first bytes of one step, each 0-1 ms late
    policy.on_first_token("b", 0.010)
    policy.on_finish("a", state.key, 0.010)  # never seen before its first byte
    assert policy.decoding.get(state.key, 0) == 0  # nothing seen yet
    policy.pick(_request("c"), [state], 0.0111)
    assert policy.late == []
    assert policy.decoding[state.key] == 1  # b decoding, a ended
    seen = policy.seen_step_end[state.key]
    assert 0.010 <= seen <= 0.011
    learner.advance(0.02)
    assert learner.steps == 1  # one step: the two first bytes merged into one group


def test_kv_variant_hears_batches_first_bytes_and_ends_late_at_their_steps_time() -> None:
    fleet = VirtualFleet([EngineConfig()], seed=1)
    policy = LEARNED_PHASE_POLICIES["ref-learned-kv-phase-1ms"](random.Random(1))
    policy.bind(fleet)
    state = EndpointState(fleet.endpoints[0], EndpointMetrics())
    learner = policy.learners[state.key]
    assert policy.recorders[state.key].rule == "vllm"
    policy.pick(_request("a"), [state], 0.0)
    policy.on_first_token("a", 0.010)
    policy.batch(state.key, 0.010)  # the same step's batch
    policy.pick(_request("b", prompt="wxyz" * 40), [state], 0.0105)
    assert "a" in learner.waiting  # nothing heard yet
    policy.pick(_request("c", prompt="qrst" * 40), [state], 0.0111)
    assert "a" in learner.decoding  # heard 1 ms late...
    assert learner.boundary == 0.010  # ... at the step's own time
    policy.batch(state.key, 0.016)  # the next step's batch
    policy.pick(_request("d", prompt="lmno" * 40), [state], 0.0169)
    assert learner.boundary == 0.010
    policy.pick(_request("e", prompt="hijk" * 40), [state], 0.0171)
    assert learner.boundary == 0.016
    assert learner.steps == 2  # the first byte and its batch were one step


def test_the_step_feed_delivers_each_publishing_step_late_with_its_ts() -> None:
    from poolkeeper.bench.policies.schedpolicy import scheduler_policy
    from poolkeeper.bench.policies.stepfeed import StepFeed

    policy = scheduler_policy("poolkeeper-stepclock-late5ms-shed", random.Random(1))
    feed = policy.step_feed
    assert isinstance(feed, StepFeed)
    assert feed.late_s == 0.005
    assert all(s.clock.late_s == 0.005 for s in feed.scorers)  # its horizon as late
    assert scheduler_policy("poolkeeper-shed", random.Random(1)).step_feed is None
    fleet = VirtualFleet([EngineConfig()], seed=1)
    policy.bind(fleet)
    (scorer,) = feed.scorers
    key = fleet.endpoints[0].hostport
    feed._published(key, 0.010)
    feed.flush(0.0149)
    assert key not in scorer.clock.clocks
    feed.flush(0.015)
    assert scorer.clock.clocks[key].last_batch == 0.010
    assert fleet.engines[0].max_fused_steps == 1


def test_the_unfused_control_turns_fusing_off_without_a_step_feed() -> None:
    from poolkeeper.bench.policies.schedpolicy import scheduler_policy

    for name, fused in (("poolkeeper-nofuse-shed", 1), ("poolkeeper-shed", None)):
        policy = scheduler_policy(name, random.Random(1))
        assert policy.step_feed is None
        fleet = VirtualFleet([EngineConfig()], seed=1)
        before = fleet.engines[0].max_fused_steps
        policy.bind(fleet)
        assert fleet.engines[0].max_fused_steps == (fused or before)
        assert before != 1


def test_one_step_gaps_between_batches_still_learn_the_step_from_a_wrong_prior() -> None:
    # Batches at every step: gaps of one decode step, whose overhead, decoding count and
    # context grow together; the unconstrained fit goes negative there and the scale of the
    # 2x prior must still be learnt (it stayed 1.4x before the fallback to the scale alone).
    learner = StepLearner(default_coefficients(2.0))
    arrivals = {f"r{i}": (i * 0.01, 150 + 37 * (i % 7)) for i in range(150)}
    engine = _drive(learner, arrivals, batches=True)
    true = _true(engine.config)
    assert learner.fitting
    for decoding, context in ((5, 400), (10, 1500), (20, 3000)):
        got = learner.step_s(0, decoding, context)
        want = true[0] + true[2] * decoding + true[3] * context
        assert got == pytest.approx(want, rel=0.05)
