"""The step clock (`scheduling/stepclock.py`) and the `step-phase-scorer` around it."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.candidate_presets import candidate_document
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, TypedName
from poolkeeper.scheduling.plugins.builtins import builtin_registry
from poolkeeper.scheduling.plugins.stepphase_scorer import StepPhaseParams, StepPhaseScorer
from poolkeeper.scheduling.stepclock import StepClock
from poolkeeper.scheduling.steplearner import StepLearner
from poolkeeper.scheduling.types import LLMRequest

# 6 ms a step, 45 us a prefill token, 20 us a decoding request, nothing for the context:
# round numbers to check the estimates by hand.
PRIOR = (0.006, 45e-6, 20e-6, 0.0)


def _state(host: str) -> EndpointState:
    return EndpointState(Endpoint(name=host, address=host, port=8000), EndpointMetrics())


def _request(request_id: str, prompt_tokens: int = 100) -> LLMRequest:
    return LLMRequest(
        request_id=request_id, model="m", target_model="m", prompt="x" * (4 * prompt_tokens),
        prompt_tokens=prompt_tokens, max_tokens=10, stream=True,
    )  # fmt: skip


def test_each_batch_is_one_step_and_a_late_duplicate_is_not_counted_twice() -> None:
    learner = StepLearner(PRIOR, learn=False)
    learner.sent("a", 100, 0.0)  # an idle engine: a step starts at 0
    learner.observed("a", 0.0105, first=True, out=None)  # 6 ms + 100 x 45 us
    for i in range(1, 4):  # three decode steps of 6.02 ms, each publishing a batch
        learner.step_ended(0.0105 + i * 0.00602)
    learner.advance(1.0)
    assert learner.steps == 4
    learner.step_ended(0.0105 + 3 * 0.00602)  # the last one again (a batch after its first byte)
    learner.step_ended(0.0105)  # and one before the boundary, out of order
    learner.advance(2.0)
    assert learner.steps == 4


def test_a_silent_step_between_batches_is_counted_from_the_gap() -> None:
    learner = StepLearner(PRIOR, learn=False)
    learner.sent("a", 100, 0.0)
    learner.observed("a", 0.0105, first=True, out=None)
    learner.step_ended(0.0105 + 2 * 0.00602)  # the step in between published nothing
    learner.advance(1.0)
    assert learner.steps == 3


def test_without_batches_an_endpoint_has_no_clock() -> None:
    clock = StepClock(PRIOR, require_fit=False)
    clock.sent("e1", "a", 100, 0, 0.0)
    clock.first_token("a", 0.0105)
    assert not clock.fresh("e1", 0.02)
    assert clock.prefill_done_s("e1", 100, 100, 0.02) is None
    assert clock.prefill_done_s("never-seen", 100, 100, 0.02) is None


def test_until_its_model_holds_an_endpoint_has_no_clock() -> None:
    clock = StepClock(PRIOR)  # require_fit
    clock.step_ended("e1", 0.0)
    assert clock.prefill_done_s("e1", 100, 100, 0.01) is None
    clock.clocks["e1"].learner.fitting = True  # (the usage counts agreed)
    assert clock.prefill_done_s("e1", 100, 100, 0.01) == pytest.approx(0.006 + 100 * 45e-6)


def test_the_clock_goes_stale_without_batches_while_requests_are_outstanding() -> None:
    clock = StepClock(PRIOR, stale_s=0.5, require_fit=False)
    clock.step_ended("e1", 1.0)
    clock.sent("e1", "a", 100, 0, 1.0)
    assert clock.fresh("e1", 1.4)
    assert not clock.fresh("e1", 1.6)
    clock.step_ended("e1", 0.9)  # an older batch, late: the clock's age is the newest's
    assert clock.clocks["e1"].last_batch == 1.0


def test_idle_endpoint_prefill_starts_now() -> None:
    clock = StepClock(PRIOR, require_fit=False)
    clock.step_ended("e1", 0.0)
    assert clock.prefill_done_s("e1", 100, 100, 0.1) == pytest.approx(0.006 + 100 * 45e-6)
    # A cached prompt prefills only its uncached part.
    assert clock.prefill_done_s("e1", 20, 100, 0.1) == pytest.approx(0.006 + 20 * 45e-6)


def test_the_step_in_progress_ends_at_its_model_then_one_step_with_the_request() -> None:
    clock = StepClock(PRIOR, late_s=0.001, require_fit=False)
    clock.sent("e1", "a", 100, 0, 0.0)
    clock.first_token("a", 0.0105)  # a decodes from here
    clock.step_ended("e1", 0.0105)  # (the same step's batch: one group)
    clock.sent("e1", "b", 200, 0, 0.012)  # sent after the step that began at 0.0105
    # The step that began at 0.0105 holds a's decode only: ends at 0.0105 + 6.02 ms; then a
    # step with b's and the new request's prefill and a's decode.
    got = clock.prefill_done_s("e1", 100, 100, 0.013)
    assert got == pytest.approx(0.0105 + 0.00602 - 0.013 + 0.006 + 300 * 45e-6 + 20e-6)


def test_a_step_not_reported_by_the_horizon_is_still_running() -> None:
    clock = StepClock(PRIOR, late_s=0.002, require_fit=False)
    clock.sent("e1", "a", 100, 0, 0.0)
    clock.first_token("a", 0.0105)
    clock.step_ended("e1", 0.0105)
    own = 0.006 + 100 * 45e-6 + 20e-6
    # At 0.0175 the step (modelled to end at 0.01652) is past its model and the horizon 0.0155
    # says nothing yet: steps back to back from its modelled end.
    got = clock.prefill_done_s("e1", 100, 100, 0.0175)
    assert got == pytest.approx(0.0105 + 2 * 0.00602 - 0.0175 + own)
    # At 0.0200, not reported by the horizon 0.0180: it ended after the horizon, so the step
    # in progress ends a model's step after it (not at 0.02254).
    got = clock.prefill_done_s("e1", 100, 100, 0.0200)
    assert got == pytest.approx(0.0180 + 0.00602 - 0.0200 + own)


def test_an_end_with_usage_leaves_the_batch_and_a_bare_end_drops_the_request() -> None:
    clock = StepClock(PRIOR, require_fit=False)
    clock.sent("e1", "a", 100, 0, 0.0)
    clock.sent("e1", "b", 100, 0, 0.0)
    clock.first_token("a", 0.015)
    clock.ended("a", 0.021, 2)
    clock.ended("b", None, None)  # failed before its first byte: no step end to count
    learner = clock.clocks["e1"].learner
    learner.advance(1.0)
    assert not learner.busy()
    assert clock.where == {}


def test_forgotten_endpoints_lose_their_clocks() -> None:
    clock = StepClock(PRIOR, require_fit=False)
    clock.step_ended("e1", 0.0)
    clock.step_ended("e2", 0.0)
    clock.sent("e2", "a", 10, 0, 0.0)
    clock.forget_endpoints({"e1"})
    assert set(clock.clocks) == {"e1"}
    assert clock.where == {}


def test_bad_priors_and_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="prior"):
        StepClock((0.0, 1e-5, 1e-5, 0.0))
    with pytest.raises(ValueError, match="stale_s"):
        StepClock(PRIOR, stale_s=0.0)
    with pytest.raises(ValidationError):
        StepPhaseParams.model_validate({"priorStepS": -1})
    with pytest.raises(ValidationError):
        StepPhaseParams.model_validate({"lateMs": 1})  # unknown key


def _scorer() -> StepPhaseScorer:
    params = StepPhaseParams(prior_step_s=0.006, prior_prefill_token_s=45e-6,
                             prior_decode_s=20e-6, prior_context_token_s=0.0,
                             require_fit=False)  # fmt: skip
    return StepPhaseScorer(TypedName("step-phase-scorer", "s"), params, None)


def test_the_scorer_is_neutral_where_no_engine_publishes() -> None:
    scorer = _scorer()
    states = [_state("10.0.0.1"), _state("10.0.0.2")]
    cycle = CycleState(now=1.0)
    scorer.post_cycle(cycle, _request("a", 2000), ProfileResult("default", (states[0],)))
    assert scorer.score(cycle, _request("b"), states) == 1.0


def test_the_scorer_prefers_the_sooner_prefill_and_scores_the_clockless_at_the_mean() -> None:
    scorer = _scorer()
    states = [_state("10.0.0.1"), _state("10.0.0.2"), _state("10.0.0.3")]
    keys = [s.endpoint.hostport for s in states]
    cycle = CycleState(now=0.001)
    scorer.step_ended(keys[0], 0.0)
    scorer.step_ended(keys[1], 0.0)
    scorer.post_cycle(cycle, _request("a", 2000), ProfileResult("default", (states[0],)))
    scores = scorer.score(CycleState(now=0.002), _request("b"), states)
    assert isinstance(scores, list)
    assert scores[1] == 1.0  # idle: the new prefill starts now
    assert scores[0] < 0.3  # behind a 2,000-token prefill (96 ms) in the step in progress
    assert scores[2] == 1.0  # no clock and nothing outstanding: as good as the best
    scorer.post_cycle(cycle, _request("c", 10), ProfileResult("default", (states[2],)))
    scores = scorer.score(CycleState(now=0.002), _request("b"), states)
    assert isinstance(scores, list)
    assert scores[2] == pytest.approx((scores[0] + scores[1]) / 2)  # busy, unknown: the mean


def test_the_scorer_is_registered_and_the_candidates_build() -> None:
    assert "step-phase-scorer" in builtin_registry()
    for name in ("default-stepclock", "default-stepclock-w1", "default-stepclock-w4"):
        scheduler = build_scheduler(
            SchedulingConfig.model_validate(candidate_document(name)), rng=random.Random(1)
        )
        found = [p for p in scheduler.plugins.values() if isinstance(p, StepPhaseScorer)]
        assert len(found) == 1
        assert found[0].prefix is not None  # reads the default profile's prefix index


def test_the_scheduler_passes_a_successful_ends_usage_to_the_scorer() -> None:
    """`Scheduler.request_done` (the Director's successful end with usage) reaches the
    scorer as an end the learner counts steps by; `request_ended` alone would only drop it."""
    scheduler = build_scheduler(
        SchedulingConfig.model_validate(candidate_document("default-stepclock-w4")),
        rng=random.Random(1),
    )
    (scorer,) = [p for p in scheduler.plugins.values() if isinstance(p, StepPhaseScorer)]
    scorer.clock.sent("e1", "r", 100, 0, 0.0)
    scheduler.observe_first_token("r", "e1", 0.01)
    scorer.step_ended("e1", 0.02)  # closes the first byte's group: "r" decodes
    learner = scorer.clock.clocks["e1"].learner
    assert "r" in learner.decoding
    scheduler.request_done("r", 0.05, 4)
    assert "r" not in learner.decoding
    assert len(learner.group_ends) == 1


def test_an_endpoint_without_the_requests_adapter_costs_its_load() -> None:
    scorer = _scorer()
    with_adapter = EndpointMetrics(served_model="base", active_adapters=frozenset({"m"}))
    states = [
        EndpointState(Endpoint(name="a", address="10.0.0.1", port=8000), EndpointMetrics()),
        EndpointState(Endpoint(name="b", address="10.0.0.2", port=8000), with_adapter),
    ]
    for s in states:
        scorer.step_ended(s.endpoint.hostport, 0.0)
    scores = scorer.score(CycleState(now=0.001), _request("r"), states)
    assert isinstance(scores, list)
    assert scores[1] == 1.0
    # idle both: 6 ms + 100 tokens, against 6 ms + (100 + 2,048) tokens
    assert scores[0] == pytest.approx((0.006 + 100 * 45e-6) / (0.006 + 2148 * 45e-6))


def test_ends_told_without_their_time_leave_nothing_behind() -> None:
    # The Director's `request_ended` (no time, no usage) before a later event closed the group
    # of the request's first byte: it must not move into `decoding` when the group closes.
    clock = StepClock(PRIOR, require_fit=False)
    for i in range(100):
        request_id = f"r{i}"
        clock.sent("e1", request_id, 100, 0, i * 0.1)
        clock.first_token(request_id, i * 0.1 + 0.0105)
        clock.ended(request_id, None, None)
    learner = clock.clocks["e1"].learner
    learner.advance(100.0)
    assert learner.decoding == {}
    assert learner.context() == 0
    assert not learner.busy()


def test_a_request_ended_before_its_first_byte_leaves_the_waiting_set() -> None:
    clock = StepClock(PRIOR, require_fit=False)
    clock.step_ended("e1", 0.0)
    clock.sent("e1", "failed", 4000, 0, 0.0)
    clock.ended("failed", 0.05, 0)  # an error: ended with no first byte
    assert clock.clocks["e1"].learner.waiting == {}
    assert clock.prefill_done_s("e1", 100, 100, 1.0) == pytest.approx(0.006 + 100 * 45e-6)


def test_a_live_request_ended_before_its_first_byte_leaves_the_waiting_set() -> None:
    clock = StepClock(PRIOR, require_fit=False, back_date=True)
    clock.step_ended("e1", 0.0)
    clock.sent("e1", "cancelled", 4000, 0, 0.0)
    clock.watch("e1", "cancelled", (7,))
    clock.ended("cancelled", None, None)  # live, errors and cancels tell `request_ended` only
    assert clock.clocks["e1"].learner.waiting == {}
    assert clock.watched("e1") == {}


def test_an_idle_fitted_endpoint_keeps_its_clock_without_batches() -> None:
    clock = StepClock(PRIOR, stale_s=0.5)
    clock.step_ended("e1", 0.0)
    clock.clocks["e1"].learner.fitting = True
    # An idle engine publishes no batches: 2 s on, its next step still starts at the send.
    assert clock.prefill_done_s("e1", 100, 100, 2.0) == pytest.approx(0.006 + 100 * 45e-6)
    clock.clocks["e1"].learner.fitting = False  # an unfitted one stays clockless
    assert clock.prefill_done_s("e1", 100, 100, 2.0) is None


def test_a_forgotten_endpoint_is_not_revived_by_a_late_batch() -> None:
    clock = StepClock(PRIOR, require_fit=False)
    clock.step_ended("e1", 0.0)
    clock.forget_endpoints(set())
    clock.step_ended("e1", 0.01)  # late, from the endpoint that left
    assert clock.clocks == {}
    clock.sent("e1", "a", 10, 0, 1.0)  # picked again: back in the pool
    clock.step_ended("e1", 1.01)
    assert clock.clocks["e1"].batches == 1


def test_endpoints_forgotten_are_not_remembered_for_ever() -> None:
    """Pods come and go: what is kept out is the latest forget's endpoints only."""
    clock = StepClock(PRIOR, require_fit=False)
    for n in range(100):
        clock.step_ended(f"e{n}", float(n))
        clock.forget_endpoints(set())
    assert clock.forgotten == {"e99"}
    assert clock.clocks == {}


def test_the_send_counts_the_adapter_load_as_the_score_does() -> None:
    scorer = _scorer()
    state = EndpointState(Endpoint(name="a", address="10.0.0.1", port=8000), EndpointMetrics(
        served_model="base"))  # fmt: skip
    scorer.post_cycle(CycleState(now=0.0), _request("r"), ProfileResult("default", (state,)))
    learner = scorer.clock.clocks[state.endpoint.hostport].learner
    assert learner.waiting["r"] == (0.0, 100, 100 + 2048)
