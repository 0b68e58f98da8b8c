"""The prefill backlog and its scorer: unanswered prompt tokens per endpoint, ended by the first
byte or the request's end, bounded, and turned into scores that keep a short prompt off a server
still prefilling a long one, unless that server holds the prompt's prefix."""

from __future__ import annotations

import math
import random

import pytest

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.backlog import PrefillBacklog
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import SchedulingConfig, preset_config
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from tests.scheduling.sched_factories import NOW, key, plugin, request, state

A, B = key(1), key(2)


def _pool(n: int = 2) -> list[EndpointState]:
    """`n` idle endpoints serving the base model the test requests ask for."""
    return [state(i, served_model="base") for i in range(1, n + 1)]


def test_tokens_count_until_the_first_byte_or_the_end() -> None:
    backlog = PrefillBacklog()
    backlog.sent("r1", A, 2000, NOW)
    backlog.sent("r2", A, 30, NOW)
    backlog.sent("r3", B, 0, NOW)  # a fully cached prompt: an entry with no tokens
    assert (backlog.tokens(A), backlog.tokens(B), len(backlog)) == (2030, 0, 3)
    assert backlog.first_token("r1")
    assert not backlog.first_token("r1")  # once only
    assert backlog.tokens(A) == 30
    assert backlog.ended("r2")  # ended before any first byte (an error, a disconnect)
    assert not backlog.ended("r2")
    assert backlog.ended("r3")
    assert dict(backlog.snapshot()) == {}  # no empty keys left behind
    assert len(backlog) == 0


def test_a_reused_id_is_the_newest_decision() -> None:
    backlog = PrefillBacklog()
    backlog.sent("r1", A, 500, NOW)
    backlog.sent("r1", B, 700, NOW + 1)  # re-routed
    assert dict(backlog.snapshot()) == {B: 700}


def test_entries_are_bounded_in_count_and_age() -> None:
    backlog = PrefillBacklog(max_entries=3, max_age_s=10.0)
    for i in range(5):
        backlog.sent(f"r{i}", A if i % 2 else B, 100, NOW + i)
    assert len(backlog) == 3  # r0 and r1 were dropped, oldest first
    assert not backlog.first_token("r0")
    assert (backlog.tokens(A), backlog.tokens(B)) == (100, 200)
    backlog.sent("late", A, 1, NOW + 13.5)  # r2 and r3 are older than 10 s by now
    assert not backlog.ended("r3")
    assert dict(backlog.snapshot()) == {B: 100, A: 1}


def test_endpoints_that_left_are_forgotten() -> None:
    backlog = PrefillBacklog()
    backlog.sent("r1", A, 10, NOW)
    backlog.sent("r2", B, 20, NOW)
    backlog.forget_endpoints({B})
    assert dict(backlog.snapshot()) == {B: 20}
    assert not backlog.first_token("r1")


@pytest.mark.parametrize("bad", [{"max_entries": 0}, {"max_age_s": 0.0}])
def test_bad_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        PrefillBacklog(**bad)  # type: ignore[arg-type]


def _decide(scorer: PrefillBacklogScorer, rid: str, prompt: str, pick: int) -> None:
    """Record a decision for `rid` on endpoint `pick` (1 or 2), as the scheduler would."""
    cycle = CycleState(NOW)
    req = request(prompt=prompt, request_id=rid)
    pool = _pool()
    scorer.score(cycle, req, pool)
    scorer.post_cycle(cycle, req, ProfileResult("p", (pool[pick - 1],)))


def test_the_scorer_ranks_by_prefill_ahead_and_forgets_it_at_the_first_byte() -> None:
    scorer = plugin("prefill-backlog-scorer")
    assert isinstance(scorer, PrefillBacklogScorer)
    pool = _pool()
    short = request(prompt="x" * 400, request_id="short")  # 100 tokens
    assert scorer.score(CycleState(NOW), short, pool) == 1.0  # nothing sent: no signal
    _decide(scorer, "long", "y" * 8000, 1)  # 2,000 tokens now prefilling on endpoint 1
    scores = scorer.score(CycleState(NOW), short, pool)
    assert isinstance(scores, list)
    # (128 + 100) / (128 + 100 + 2000): the short prompt waits ten times as long there.
    assert scores == pytest.approx([228 / 2228, 1.0])
    scorer.observe_first_token("long", A, NOW + 0.1)
    assert scorer.score(CycleState(NOW), short, pool) == 1.0
    _decide(scorer, "gone", "z" * 400, 2)
    scorer.request_ended("gone")
    assert scorer.score(CycleState(NOW), short, pool) == 1.0
    _decide(scorer, "left", "z" * 400, 2)
    scorer.forget_endpoints({A})
    assert scorer.score(CycleState(NOW), short, pool) == 1.0


def test_with_a_prefix_index_a_cached_prompt_costs_only_its_uncached_part() -> None:
    scheduler = build_scheduler(preset_config("prefill-backlog"), rng=random.Random(1))
    scorer = scheduler.plugins["prefill-backlog-scorer"]
    assert isinstance(scorer, PrefillBacklogScorer)
    assert scorer.prefix is not None
    shared = "a long shared system prompt " * 100  # 2,800 characters, 700 tokens
    req = request(prompt=shared + "question?", request_id="q")
    pool = _pool()
    scorer.prefix.index.insert(A, scorer.prefix.hashes(CycleState(NOW), req))
    scorer.backlog.sent("other", A, 300, NOW)  # endpoint 1 also has 300 tokens ahead
    costs = scorer.costs(CycleState(NOW), req, pool)
    # 2,809 characters, 702 tokens; endpoint 1 caches its 43 whole blocks of 64 characters,
    # 2,752 characters at 702 / 2,809 tokens each: 687 tokens.
    assert costs == [128 + 702 - 687 + 300, 128 + 702]
    assert scheduler.schedule(req, pool, now=NOW).primary.key == A
    # The decision counted the 15 uncached tokens on endpoint 1, not the whole prompt.
    assert scorer.backlog.tokens(A) == 315
    scheduler.observe_first_token("q", A, NOW + 0.05)
    assert scorer.backlog.tokens(A) == 300


def test_the_scheduler_keeps_short_prompts_off_a_long_prefill() -> None:
    scheduler = build_scheduler(preset_config("prefill-backlog"), rng=random.Random(3))
    pool = _pool(4)
    assert scheduler.observes_first_tokens
    first = scheduler.schedule(request(prompt="w" * 16000, request_id="long"), pool, now=NOW)
    busy = first.primary.key
    for i in range(20):
        req = request(prompt=f"short question {i} " * 4, request_id=f"s{i}")
        chosen = scheduler.schedule(req, pool, now=NOW).primary.key
        assert chosen != busy
        scheduler.observe_first_token(f"s{i}", chosen, NOW)
    scheduler.observe_first_token("long", busy, NOW)
    picks = set()
    for i in range(40):
        req = request(prompt=f"later question {i} " * 4, request_id=f"t{i}")
        picks.add(scheduler.schedule(req, pool, now=NOW).primary.key)
        scheduler.observe_first_token(f"t{i}", None, NOW)
    assert busy in picks  # once its prefill is over it is a candidate like the others


def test_an_absent_adapter_costs_its_load() -> None:
    scorer = plugin("prefill-backlog-scorer", {"adapterTokens": 1000})
    pool = [
        state(1, served_model="base", active=("sql",)),  # the adapter is loaded here
        state(2, served_model="base"),  # it would have to be loaded here
        state(3, served_model="sql"),  # the target is this server's base model
    ]
    req = request("sql", prompt="x" * 400)  # 100 tokens
    assert scorer.costs(CycleState(NOW), req, pool) == [228, 1228, 228]
    scorer.backlog.sent("other", A, 2000, NOW)  # a long prefill where the adapter is
    assert scorer.costs(CycleState(NOW), req, pool) == [2228, 1228, 228]
    off = plugin("prefill-backlog-scorer", {"adapterTokens": 0})
    assert off.costs(CycleState(NOW), req, pool) == [228, 228, 228]


def test_a_slower_endpoints_cost_is_scaled_by_how_much_slower() -> None:
    scorer = plugin("prefill-backlog-scorer")  # speedTolerance 0.3
    fast, near, slow, new = (state(i, served_model="base") for i in range(1, 5))
    pool = [
        EndpointState(fast.endpoint, fast.metrics, seconds_per_output_token=0.01),
        EndpointState(near.endpoint, near.metrics, seconds_per_output_token=0.012),  # noise
        EndpointState(slow.endpoint, slow.metrics, seconds_per_output_token=0.026),
        new,  # not observed yet: counts as fast
    ]
    req = request(prompt="x" * 400)  # 100 tokens: 228 with the base
    costs = scorer.costs(CycleState(NOW), req, pool)
    # 0.026 s against 1.3 x 0.01 s: twice as slow beyond the tolerance.
    assert costs == pytest.approx([228, 228, 456, 228])
    blind = plugin("prefill-backlog-scorer", {"speedTolerance": None})
    assert blind.costs(CycleState(NOW), req, pool) == [228, 228, 228, 228]


def test_prefix_scorer_reference_must_name_a_prefix_cache_scorer() -> None:
    config = SchedulingConfig.model_validate(
        {
            "plugins": [
                {"type": "queue-scorer"},
                {"type": "prefill-backlog-scorer", "parameters": {"prefixScorer": "queue-scorer"}},
            ],
            "schedulingProfiles": [
                {"name": "p", "plugins": [{"pluginRef": "prefill-backlog-scorer"}]}
            ],
        }
    )
    with pytest.raises(ConfigError, match="is not a prefix-cache-scorer"):
        build_scheduler(config, rng=random.Random(1))


def test_the_drain_rate_is_cleared_work_over_busy_time() -> None:
    backlog = PrefillBacklog(work_tokens=100, rate_decay=0.5, min_samples=2)
    backlog.sent("r1", A, 900, NOW)  # A's busy period starts
    backlog.sent("r2", A, 1900, NOW + 0.5)
    assert backlog.first_token("r1", NOW + 0.1)  # 1,000 work tokens in 0.1 s
    assert backlog.rates() == {}  # one sample: not measured yet
    assert backlog.first_token("r2", NOW + 0.3)  # 2,000 more in 0.2 s since the last
    # decayed sums: (1000 x 0.5 + 2000) / (0.1 x 0.5 + 0.2)
    assert backlog.rates() == pytest.approx({A: 2500 / 0.25})
    backlog.sent("r3", A, 0, NOW + 5.0)  # idle from 0.3 s to 5 s: not drain time
    assert backlog.first_token("r3", NOW + 5.1)
    assert backlog.rates()[A] == pytest.approx((2500 * 0.5 + 100) / (0.25 * 0.5 + 0.1))
    backlog.sent("r4", B, 50, NOW)
    assert backlog.ended("r4")  # an end without a first byte is no sample
    assert B not in backlog.rates()
    backlog.forget_endpoints({B})
    assert backlog.rates() == {}


def test_with_drain_rates_the_cost_is_a_wait_in_seconds() -> None:
    scorer = plugin("prefill-backlog-scorer", {"drainRate": True, "speedTolerance": None})
    assert isinstance(scorer, PrefillBacklogScorer)
    fast, slow, new = (state(i, served_model="base") for i in range(1, 4))
    req = request(prompt="x" * 400)  # 100 tokens: 228 with the base
    assert scorer.costs(CycleState(NOW), req, [fast, slow, new]) == [228, 228, 228]
    for i in range(8):  # A clears 1,128 tokens per 0.05 s, B per 0.2 s
        for k, dt in ((A, 0.05), (B, 0.2)):
            scorer.backlog.sent(f"{k}{i}", k, 1000, NOW + i)
            scorer.backlog.first_token(f"{k}{i}", NOW + i + dt)
    costs = scorer.costs(CycleState(NOW), req, [fast, slow, new])
    # unmeasured: as fast as the fastest
    assert costs == pytest.approx([228 / 22560, 228 / 5640, 228 / 22560])


def test_a_fixed_span_scores_tokens_ahead_whatever_the_prompts_length() -> None:
    ratio = plugin("prefill-backlog-scorer")
    span = plugin("prefill-backlog-scorer", {"spanTokens": 1000})
    assert isinstance(ratio, PrefillBacklogScorer)
    assert isinstance(span, PrefillBacklogScorer)
    for scorer in (ratio, span):
        scorer.backlog.sent("ahead", A, 300, NOW)
    pool = _pool()
    short = request(prompt="x" * 200, request_id="short")  # 50 tokens: 178 with the base
    # The ratio rule: 178 / 478; the span: 300 tokens more ahead of 1,000.
    assert ratio.score(CycleState(NOW), short, pool) == pytest.approx([178 / 478, 1.0])
    assert span.score(CycleState(NOW), short, pool) == pytest.approx([1000 / 1300, 1.0])


def test_a_mean_span_weighs_differences_by_how_busy_the_pool_is() -> None:
    scorer = plugin("prefill-backlog-scorer", {"meanSpan": True})
    assert isinstance(scorer, PrefillBacklogScorer)
    pool = _pool()
    short = request(prompt="x" * 200, request_id="short")  # 178 with the base
    scorer.backlog.sent("a", A, 300, NOW)
    # Mean backlog 150: span 178 + 150; A costs 300 more.
    assert scorer.score(CycleState(NOW), short, pool) == pytest.approx([328 / 628, 1.0])
    scorer.backlog.sent("b", B, 3000, NOW)
    scorer.backlog.sent("c", A, 3000, NOW)
    # Both busy (3,300 and 3,000 ahead): span 3,178 + 3,150, the same 300 tokens weigh less.
    assert scorer.score(CycleState(NOW), short, pool) == pytest.approx([6328 / 6628, 1.0])


def test_a_busy_endpoints_cost_is_raised_by_its_utilisation() -> None:
    scorer = plugin("prefill-backlog-scorer", {"busyPenalty": True})
    assert isinstance(scorer, PrefillBacklogScorer)
    backlog = scorer.backlog
    assert backlog.utilisation(A, NOW) == 0.0  # never sent to
    backlog.sent("a", A, 100, NOW)
    backlog.first_token("a", NOW + 10.0)  # busy for 10 s: utilisation ~1
    assert backlog.utilisation(A, NOW + 10.0) == pytest.approx(1.0, abs=1e-4)
    assert backlog.utilisation(A, NOW + 11.0) == pytest.approx(math.exp(-1.0), abs=1e-4)
    req = request(prompt="x" * 400)  # 100 tokens: 228 with the base
    costs = scorer.costs(CycleState(NOW + 11.0), req, _pool())
    assert costs == pytest.approx([228 / (1 - math.exp(-1.0)), 228], rel=1e-3)


def test_the_backlogs_say_fades_as_the_pool_fills() -> None:
    scorer = plugin("prefill-backlog-scorer", {"fadeFrom": 0.6, "fadeTo": 0.9})
    assert isinstance(scorer, PrefillBacklogScorer)
    pool = _pool()
    short = request(prompt="x" * 400, request_id="short")  # 100 tokens: 228 with the base
    scorer.backlog.sent("a", A, 2000, NOW)
    # Half the pool has a backlog: below `fadeFrom`, the full say.
    assert scorer.score(CycleState(NOW), short, pool) == pytest.approx([228 / 2228, 1.0])
    scorer.backlog.sent("b", B, 1000, NOW)
    # Both busy for ln 2 time constants: the busy share is 0.75, half way to `fadeTo`, so the
    # scores are pulled half way to 1 (half the say).
    later = NOW + math.log(2.0)
    assert scorer.score(CycleState(later), short, pool) == pytest.approx(
        [0.5 + 0.5 * 1228 / 2228, 1.0]
    )
    # Busy long enough to pass `fadeTo`: no say at all.
    assert scorer.score(CycleState(NOW + 30.0), short, pool) == 1.0
    scorer.backlog.first_token("a", NOW + 30.0)
    scorer.backlog.first_token("b", NOW + 30.0)
    # Idle again: the busy share decays and the say comes back.
    scorer.backlog.sent("c", A, 2000, NOW + 60.0)
    assert scorer.score(CycleState(NOW + 60.0), short, pool) == pytest.approx([228 / 2228, 1.0])


def test_a_fast_rise_fades_the_backlog_out_at_the_start_of_a_burst() -> None:
    slow = plugin("prefill-backlog-scorer", {"fadeFrom": 0.6, "fadeTo": 0.9})
    fast = plugin("prefill-backlog-scorer", {"fadeFrom": 0.6, "fadeTo": 0.9, "fadeRiseS": 0.1})
    assert isinstance(slow, PrefillBacklogScorer)
    assert isinstance(fast, PrefillBacklogScorer)
    pool = _pool()
    short = request(prompt="x" * 400, request_id="short")
    for scorer in (slow, fast):
        assert scorer.busy_share(NOW, 2) == 0.0  # idle at the first decision
        scorer.backlog.sent("a", A, 2000, NOW)
        scorer.backlog.sent("b", B, 1000, NOW)
    # 0.3 s into a burst that filled the pool: 3 time constants of the fast rise (share 0.95,
    # past `fadeTo`: no say), 0.3 of the 1 s average (0.26: the full say).
    later = NOW + 0.3
    assert fast.busy_share(later, 2) == pytest.approx(1.0 - math.exp(-3.0))
    assert fast.score(CycleState(later), short, pool) == 1.0
    assert slow.score(CycleState(later), short, pool) == pytest.approx([1228 / 2228, 1.0])
    # The pool empties: the share falls with the 1 s time constant in both.
    fast.backlog.first_token("a", later)
    fast.backlog.first_token("b", later)
    share = fast.busy_share(later, 2)
    assert fast.busy_share(later + 1.0, 2) == pytest.approx(share * math.exp(-1.0))


def test_a_faded_scorer_keeps_the_adapter_term() -> None:
    # In a LoRA pool requests starved of an adapter slot keep the busy share high; faded
    # out with the backlog, the adapter term sent requests where their adapter was not
    # (docs/notes/2026-12-07-lora-replicas-cliff.md).
    scorer = plugin("prefill-backlog-scorer", {"fadeFrom": 0.6, "fadeTo": 0.9})
    assert isinstance(scorer, PrefillBacklogScorer)
    pool = [state(1, served_model="base", active=("sql",)), state(2, served_model="base")]
    req = request("sql", prompt="x" * 400)  # 100 tokens: 228 with the base, 2276 without
    scorer.backlog.sent("a", A, 2000, NOW)
    scorer.backlog.sent("b", B, 1000, NOW)
    # Busy long enough to pass `fadeTo`: the backlog has no say, the adapter term stays.
    assert scorer.score(CycleState(NOW + 30.0), req, pool) == pytest.approx([1.0, 228 / 2276])
    # Half the say (as in the fade's test: a busy share of 0.75): half the backlog's ratio,
    # half the adapter floor, not half of 1.
    fresh = plugin("prefill-backlog-scorer", {"fadeFrom": 0.6, "fadeTo": 0.9})
    assert isinstance(fresh, PrefillBacklogScorer)
    fresh.backlog.sent("a", A, 2000, NOW)
    fresh.score(CycleState(NOW), req, pool)  # the busy share starts at 0.5
    fresh.backlog.sent("b", B, 1000, NOW)
    half = CycleState(NOW + math.log(2.0))
    assert fresh.costs(half, req, pool) == [2228, 3276]
    assert fresh.score(half, req, pool) == pytest.approx(
        [1.0, 0.5 * 228 / 2276 + 0.5 * 2228 / 3276]
    )
    # A request for the base model (resident everywhere): no floor, the fade as before.
    assert scorer.score(CycleState(NOW + 30.0), request(prompt="x" * 400), pool) == 1.0


def test_a_tie_while_fading_still_leans_to_the_adapter() -> None:
    # Equal costs (the resident endpoint's backlog as large as the other's adapter term) at
    # half the say: the faded floor, not 1.0 for both, as on either side of the tie.
    scorer = plugin("prefill-backlog-scorer", {"fadeFrom": 0.2, "fadeTo": 0.8})
    assert isinstance(scorer, PrefillBacklogScorer)
    pool = [state(1, served_model="base", active=("sql",)), state(2, served_model="base")]
    req = request("sql", prompt="x" * 400)  # 100 tokens: 228 with the base, 2276 without
    scorer.backlog.sent("a", A, 2048, NOW)  # one endpoint of two busy: a share of 0.5
    assert scorer.costs(CycleState(NOW), req, pool) == [2276, 2276]
    assert scorer.score(CycleState(NOW), req, pool) == pytest.approx([1.0, 0.5 * 228 / 2276 + 0.5])
