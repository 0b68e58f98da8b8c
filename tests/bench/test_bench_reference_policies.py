"""The reference policies (`ref-*`): what more information would buy, never a baseline."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from poolkeeper.bench.policies.reference_policies import (
    FirstBytePhase,
    LateObservedPhase,
    LateObservedPhase2ms,
    LateObservedPhase5ms,
    LateObservedPhase20ms,
    ObservedPhase,
    Oracle,
    PendingPrefill,
    SizeLanes,
    StepPhase,
    is_baseline,
)
from poolkeeper.bench.policies.routers import ALL_POLICIES, KNOWN_POLICIES, make_policy
from poolkeeper.bench.results.seedmeans import seed_tables
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.engine import STEP_END_HISTORY, EngineModel
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.virtual import VirtualFleet
from poolkeeper.sim.virtual_results import Arrival
from poolkeeper.tokens import count_tokens

LONG = "word " * 6000  # one long prefill (several 8192-token chunks' worth of work)
SHORT = "hello there"


def _request(rid: str, prompt: str, max_tokens: int = 4) -> LLMRequest:
    return LLMRequest(
        request_id=rid, model="m", target_model=EngineConfig().model, prompt=prompt,
        prompt_tokens=count_tokens(prompt), max_tokens=max_tokens, stream=True,
    )  # fmt: skip


def test_what_if_predicts_the_first_token_exactly_and_leaves_the_engine_alone() -> None:
    engine = EngineModel(EngineConfig(), max_fused_steps=64)
    model = EngineConfig().model
    engine.submit(engine.create_request("a", model, LONG, arrival=0.0, max_tokens=50), 0.0)
    engine.next_event_time()  # plans the first step (the what-if must not change it)
    before = (engine.stats(), engine.next_event_time())
    predicted = engine.first_token_if_submitted("b", model, SHORT, 0.001, max_tokens=5)
    assert (engine.stats(), engine.next_event_time()) == before
    assert predicted is not None
    assert predicted > 0.001
    b = engine.create_request("b", model, SHORT, arrival=0.001, max_tokens=5)
    engine.submit(b, 0.001)
    seen = None
    while seen is None and (t := engine.next_event_time()) is not None:
        for outcome in engine.advance(t):
            if any(r is b for r in outcome.tokens):
                seen = outcome.first_time
    assert seen == predicted
    assert engine.first_token_if_submitted("c", "no-such-model", SHORT, 0.0) is None


def _fleet_run(policy: Oracle | PendingPrefill) -> dict[str, str]:
    """Two idle servers; a long prompt at t=0, a short one 1 ms later: where each went."""
    fleet = VirtualFleet([EngineConfig(), EngineConfig()], seed=1)
    bind = getattr(policy, "bind", None)
    if bind is not None:  # as simrun.replay does
        bind(fleet)
    index = {e.hostport: i for i, e in enumerate(fleet.endpoints)}
    arrivals = [
        Arrival(0.0, "long", EngineConfig().model, prompt=LONG, max_tokens=4),
        Arrival(0.001, "short", EngineConfig().model, prompt=SHORT, max_tokens=4),
    ]

    def route(a: Arrival, states: Sequence[EndpointState], now: float) -> int | None:
        return index[policy.pick(_request(a.request_id, a.prompt), states, now).key]

    result = fleet.run(
        arrivals, route,
        on_first_token=lambda r: policy.on_first_token(r.request_id, r.first_token or 0.0),
        on_finish=lambda r: policy.on_finish(r.request_id, r.server_name, r.finish or 0.0),
    )  # fmt: skip
    return {r.request_id: r.server_name for r in result.requests}


@pytest.mark.parametrize(
    "make",
    [
        Oracle, StepPhase, PendingPrefill, ObservedPhase, LateObservedPhase2ms,
        LateObservedPhase5ms, LateObservedPhase20ms, FirstBytePhase,
    ],
)  # fmt: skip
def test_each_reference_policy_sends_the_short_prompt_away_from_the_long_prefill(
    make: type[Oracle] | type[PendingPrefill],
) -> None:
    # Round-robin-like tie breaks would put it behind the long prefill half the time; every
    # reference policy knows (from its own bookkeeping or the engine) that server is busy.
    for seed in range(5):
        where = _fleet_run(make(random.Random(seed)))
        assert where["short"] != where["long"]


def test_pending_prefill_bookkeeping_follows_first_tokens_and_completions() -> None:
    policy = PendingPrefill(random.Random(1))
    states = [
        EndpointState(Endpoint(f"s{i}", "10.0.0.1", 8000 + i), EndpointMetrics()) for i in range(2)
    ]
    first = policy.pick(_request("r1", LONG), states, 0.0)
    second = policy.pick(_request("r2", SHORT), states, 0.0)
    assert second.key != first.key  # the other one has nothing pending
    assert policy.pending[first.key] == count_tokens(LONG)
    policy.on_first_token("r1", 0.1)
    assert (policy.pending[first.key], policy.decoding[first.key]) == (0, 1)
    policy.on_first_token("r1", 0.2)  # a repeat changes nothing
    policy.on_finish("r1", "s0", 0.3)
    policy.on_finish("r2", "s1", 0.3)  # finished before any first token was seen
    assert set(policy.pending.values()) == {0}
    assert set(policy.decoding.values()) == {0}


def test_size_lanes_keep_long_prompts_in_the_first_quarter_and_short_ones_out_of_it() -> None:
    policy = SizeLanes(random.Random(1))
    states = [
        EndpointState(Endpoint(f"s{i}", "10.0.0.1", 8000 + i), EndpointMetrics()) for i in range(8)
    ]
    lane = {states[0].key, states[1].key}  # a quarter of eight
    long_prompt = "word " * (2 * SizeLanes.long_prompt_tokens)
    longs = {policy.pick(_request(f"l{i}", long_prompt), states, 0.0).key for i in range(6)}
    shorts = {policy.pick(_request(f"s{i}", SHORT), states, 0.0).key for i in range(12)}
    assert longs == lane  # both lane servers used (least pending prefill), nothing else
    assert shorts == {s.key for s in states} - lane
    # A single endpoint is a lane for everything (nothing to split).
    assert policy.pick(_request("one", SHORT), states[:1], 0.0).key == states[0].key


@pytest.mark.parametrize("make", [StepPhase, ObservedPhase, LateObservedPhase20ms, FirstBytePhase])
def test_the_step_phase_policies_step_one_by_one_once_bound(make: type[StepPhase]) -> None:
    fleet = VirtualFleet([EngineConfig()], seed=1, fuse_decode_steps=64)
    make(random.Random(1)).bind(fleet)
    assert [e.max_fused_steps for e in fleet.engines] == [1]


def test_the_engine_remembers_its_last_step_ends_bounded() -> None:
    engine = EngineModel(EngineConfig())
    model = EngineConfig().model
    assert engine.step_end_before(1e9) == float("-inf")
    engine.submit(engine.create_request("a", model, SHORT, arrival=0.0, max_tokens=200), 0.0)
    ends = []
    while (t := engine.next_event_time()) is not None:
        engine.advance(t)
        ends.append(engine.last_step_end)
    assert len(ends) > STEP_END_HISTORY  # one step per token, so older ends were forgotten
    assert ends == sorted(ends)
    assert engine.step_end_before(ends[-1]) == ends[-1]
    assert engine.step_end_before(ends[-1] - 1e-9) == ends[-2]
    assert engine.step_end_before((ends[-3] + ends[-2]) / 2) == ends[-3]
    assert engine.step_end_before(ends[-STEP_END_HISTORY]) == ends[-STEP_END_HISTORY]
    assert engine.step_end_before(ends[-STEP_END_HISTORY] - 1e-9) == float("-inf")


def test_first_byte_phase_knows_step_ends_only_from_first_bytes_and_ends() -> None:
    fleet = VirtualFleet([EngineConfig(), EngineConfig()], seed=1)
    policy = FirstBytePhase(random.Random(1))
    policy.bind(fleet)
    states = [EndpointState(e, EndpointMetrics()) for e in fleet.endpoints]
    busy = policy.pick(_request("r1", SHORT), states, 0.0).key
    idle = next(s.key for s in states if s.key != busy)
    c = EngineConfig()
    assert policy.score(idle, 0.0) == (c.step_overhead_s * c.time_scale,)  # nothing there
    pending_step = policy.next_step_s(busy)
    assert policy.score(busy, 0.0) == (1.5 * pending_step,)  # busy, no step end known yet
    policy.on_first_token("r1", 0.05)
    step = policy.next_step_s(busy)  # now one decoding request
    assert step < pending_step
    assert policy.known_step_end(busy, 0.06) == 0.05
    assert policy.score(busy, 0.05 + step / 4) == pytest.approx((step * 0.75 + step,))
    # steps assumed back to back: a quarter into the third one after the known end
    assert policy.score(busy, 0.05 + 2.25 * step) == pytest.approx((step * 0.75 + step,))
    policy.on_finish("r1", busy, 0.2)
    assert policy.known_step_end(busy, 0.2) == 0.2
    assert policy.score(busy, 0.3) == (c.step_overhead_s * c.time_scale,)  # idle again


def test_reference_policies_run_only_by_name_and_are_never_the_best_baseline() -> None:
    names = (
        "ref-pending-prefill", "ref-step-phase", "ref-observed-phase", "ref-observed-phase-2ms",
        "ref-observed-phase-5ms", "ref-observed-phase-20ms", "ref-first-byte-phase", "ref-oracle",
        "ref-size-lanes",
    )  # fmt: skip
    for name in names:
        assert name in KNOWN_POLICIES
        assert name not in ALL_POLICIES
        assert make_policy(name, random.Random(1)).name == name
        assert not is_baseline(name)
    assert is_baseline("round-robin")
    assert not is_baseline("poolkeeper")
    runs = [
        {"policy": policy, "load": 0.7,
         "summary": {"ttft_s": {"p90": p90}, "goodput_rps": 200.0, "shed": 0}}
        for policy, p90 in (("round-robin", 0.040), ("poolkeeper", 0.038), ("ref-oracle", 0.020))
    ]  # fmt: skip
    sweep = {"workload": {"kind": "heavy-tail"}, "fleet": {"servers": 8}, "seed": 1, "runs": runs}
    table = seed_tables([sweep])
    row = next(line for line in table.splitlines() if line.startswith("| 0.7"))
    # The oracle is a column of its own (0.50 of the best baseline), not the best baseline,
    # and not the floor either (that would be 0.020, and 0.040 far above it).
    assert row.startswith("| 0.7 | 0.040 (round-robin) floor |")
    assert "| 0.038 | 0.95 |" in row
    assert "| 0.020 | 0.50 |" in row


def test_the_late_observed_phase_knows_step_ends_only_up_to_its_horizon() -> None:
    fleet = VirtualFleet([EngineConfig()], seed=1)
    late, now_seen = LateObservedPhase20ms(random.Random(1)), LateObservedPhase(random.Random(1))
    exact = ObservedPhase(random.Random(1))
    for policy in (late, now_seen, exact):
        policy.bind(fleet)
    engine, key = fleet.engines[0], fleet.endpoints[0].hostport
    for policy in (late, now_seen, exact):
        policy.pick(_request("r1", SHORT, max_tokens=400), [EndpointState(fleet.endpoints[0],
                    EndpointMetrics())], 0.0)  # fmt: skip
    engine.submit(engine.create_request("r1", EngineConfig().model, SHORT, arrival=0.0,
                  max_tokens=400), 0.0)  # fmt: skip
    for _ in range(30):  # thirty steps, then ask between two step ends
        t = engine.next_event_time()
        assert t is not None
        engine.advance(t)
    for policy in (late, now_seen, exact):
        policy.on_first_token("r1", 0.0)  # one decoding request there: steps of one length
    step = exact.next_step_s(key)
    now = engine.last_step_end + step / 4
    # Told at once, it is `ref-observed-phase`: three quarters of a step left, then a step.
    assert now_seen.score(key, now) == exact.score(key, now)
    assert exact.score(key, now) == pytest.approx((step * 0.75 + step,))
    # 20 ms late it knows an older end and counts whole steps since: in this run of identical
    # decode steps (the model's length to within a microsecond) that is the same phase.
    known = engine.step_end_before(now - 0.020)
    assert known < engine.last_step_end - 0.015
    left = late.score(key, now)[0] - step
    assert left == pytest.approx(step - (now - known) % step)
