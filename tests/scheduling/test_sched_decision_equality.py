"""The decision-time shortcuts compute the same floats as the straightforward code they replaced.

Each reference below is the plain form kept for comparison (one pass per term, a separate fade
pass, the profile's zip-and-sum): the optimised plugins must return bit-identical scores on
seeded random pools, so no pick can change (pickers compare totals exactly).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from functools import reduce
from itertools import repeat
from operator import add, mul
from typing import Any

import pytest
from hypothesis import given, strategies as st

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import STALE, effective_kv, saturations
from poolkeeper.scheduling.interfaces import AffineScores, CycleState
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.plugins.saturation_filter import SaturationFilter
from poolkeeper.scheduling.plugins.scorers import (
    KvCacheScorer,
    inverse_min_max,
    inverse_min_max_ints,
)
from poolkeeper.scheduling.plugins.shared import residency, speed_bar
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.scheduling.wsum import MAX_INLINE, Summers, weighted_sum
from tests.scheduling.sched_factories import NOW, plugin, request, scheduler, state

FLOATS = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


def _general_sum(columns: list[list[float]], factors: list[float], offset: float) -> list[float]:
    """The profile's former sum: weighted columns and the offset zipped, each row added left
    to right (as `sum` did before Python 3.12 began to compensate float rounding)."""
    parts: list[Any] = [map(mul, c, repeat(f)) for c, f in zip(columns, factors, strict=True)]
    if offset:
        parts.append(repeat(offset, len(columns[0])))
    return [reduce(add, row, 0) for row in zip(*parts, strict=True)]


@given(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.lists(st.lists(FLOATS, min_size=n, max_size=n), min_size=1, max_size=11),
            st.lists(FLOATS, min_size=11, max_size=11),
        )
    ),
    st.one_of(st.just(0.0), FLOATS),
)
def test_weighted_sum_is_the_zipped_left_to_right_sum_bit_for_bit(
    data: tuple[list[list[float]], list[float]], offset: float
) -> None:
    columns, weights = data
    factors = weights[: len(columns)]
    got = weighted_sum(columns, factors, offset, len(columns[0]))
    # bit for bit, but for the sign of a zero (the adds start from +0; pickers compare with ==)
    expected = _general_sum(columns, factors, offset)
    assert [(x + 0.0).hex() for x in got] == [(x + 0.0).hex() for x in expected]


def test_weighted_sum_covers_every_inline_width_and_none() -> None:
    rng = random.Random(3)
    for k in range(1, MAX_INLINE + 3):  # the compiled widths and the general form past them
        columns = [[rng.uniform(-2, 2) for _ in range(7)] for _ in range(k)]
        factors = [rng.choice([1.0, 2.0, -0.25, 3.0]) for _ in range(k)]
        for offset in (0.0, 1.5):
            assert weighted_sum(columns, factors, offset, 7) == _general_sum(
                columns, factors, offset
            )
    assert weighted_sum([], [], 0.0, 3) == [0.0, 0.0, 0.0]
    assert weighted_sum([], [], 2.5, 2) == [2.5, 2.5]


@given(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.lists(
                st.one_of(
                    st.lists(FLOATS, min_size=n, max_size=n),
                    st.lists(st.integers(0, 40), min_size=n, max_size=n),
                ),
                min_size=1,
                max_size=11,
            ),
            st.lists(FLOATS, min_size=11, max_size=11),
            st.lists(st.booleans(), min_size=11, max_size=11),
        )
    ),
    st.one_of(st.just(0.0), FLOATS),
)
def test_summers_read_table_columns_bit_for_bit(
    data: tuple[list[list[Any]], list[float], list[bool]], offset: float
) -> None:
    """Integer columns given as tables of their products sum to the plain form's floats."""
    columns, weights, use_table = data
    factors = weights[: len(columns)]
    given_factors: list[Any] = []
    tables = 0
    for j, (column, f) in enumerate(zip(columns, factors, strict=True)):
        if use_table[j] and all(isinstance(x, int) for x in column):
            tables |= 1 << j
            given_factors.append([i * f for i in range(max(column) + 1)])
        else:
            given_factors.append(f)
    summers = Summers()
    got = summers.sum(columns, given_factors, offset, len(columns[0]), tables)
    expected = _general_sum(columns, factors, offset)
    assert [(x + 0.0).hex() for x in got] == [(x + 0.0).hex() for x in expected]
    # the compiled form, kept: the same again
    assert summers.sum(columns, given_factors, offset, len(columns[0]), tables) == got


# --- the prefill-backlog scorer: the former per-term passes ----------------------------------


def _reference_costs(
    b: PrefillBacklogScorer, cycle: CycleState, req: LLMRequest, cands: Sequence[EndpointState]
) -> list[float]:
    own = float(req.prompt_tokens + b.base_tokens)
    target, miss = req.target_model, b.adapter_tokens
    if miss:
        costs = [
            own
            if target == (m := s.metrics).served_model or target in m.active_adapters
            else own + miss
            for s in cands
        ]
    else:
        costs = [own] * len(cands)
    cached = b.prefix.cached_tokens(cycle, req) if b.prefix is not None else {}
    backlog = b.backlog.snapshot()
    if cached or backlog:
        hit, ahead = cached.get, backlog.get
        keys = [s.endpoint.hostport for s in cands]
        if cached and backlog:
            costs = [c - hit(k, 0) + ahead(k, 0) for c, k in zip(costs, keys, strict=True)]
        elif cached:
            costs = [c - hit(k, 0) for c, k in zip(costs, keys, strict=True)]
        else:
            costs = [c + ahead(k, 0) for c, k in zip(costs, keys, strict=True)]
        if b.marginal and backlog:
            waiting, tokens = b.backlog.counts().get, req.prompt_tokens
            costs = [
                c + waiting(k, 0) * max(0, tokens - hit(k, 0))
                for c, k in zip(costs, keys, strict=True)
            ]
    if b.drain_rate and (rates := b.backlog.rates()):
        fastest = max(rates.values())
        costs = [
            c / rates.get(s.endpoint.hostport, fastest) for c, s in zip(costs, cands, strict=True)
        ]
    if b.busy_penalty:
        costs = [
            c / (1.0 - min(0.9, b.backlog.utilisation(s.endpoint.hostport, cycle.now)))
            for c, s in zip(costs, cands, strict=True)
        ]
    if b.slack is not None and (found := speed_bar(cands, b.slack)) is not None:
        speeds, bar = found
        costs = [c if v <= bar else c * v / bar for c, v in zip(costs, speeds, strict=True)]
    return costs


def _reference_scores(
    b: PrefillBacklogScorer, cycle: CycleState, req: LLMRequest, cands: Sequence[EndpointState]
) -> list[float] | float:
    """Unfaded scores (the fade's share is read by the scorer itself, once per decision)."""
    costs = _reference_costs(b, cycle, req, cands)
    best = min(costs)
    if best == max(costs):
        return 1.0
    if b.mean_span:
        ahead = b.backlog.snapshot().get
        mean = sum(ahead(s.endpoint.hostport, 0) for s in cands) / len(cands)
        if b.drain_rate and (rates := b.backlog.rates()):
            mean /= max(rates.values())
        span = best + mean
        return [span / (span + c - best) for c in costs]
    if b.span_tokens is None:
        return [best / c for c in costs]
    span = float(b.span_tokens)
    if b.drain_rate and (rates := b.backlog.rates()):
        span /= max(rates.values())
    return [span / (span + c - best) for c in costs]


def _reference_floor(
    b: PrefillBacklogScorer, req: LLMRequest, cands: Sequence[EndpointState]
) -> list[float] | float:
    """What the fade leaves: 1 where the request's model is resident, own / (own + miss)
    where not; 1 for all where that is the same everywhere or there is no adapter term."""
    own, miss, target = req.prompt_tokens + b.base_tokens, b.adapter_tokens, req.target_model
    resident = [
        target == (m := s.metrics).served_model or target in m.active_adapters for s in cands
    ]
    if not miss or all(resident) or not any(resident):
        return 1.0
    return [1.0 if r else own / (own + miss) for r in resident]


VARIANTS: list[dict[str, Any]] = [
    {},
    {"fadeFrom": 0.5, "fadeTo": 0.8},
    {"fadeFrom": 0.0, "fadeTo": 1.0},
    {"adapterTokens": 0},
    {"adapterTokens": 0, "fadeFrom": 0.5, "fadeTo": 0.8},
    {"marginal": True},
    {"spanTokens": 2048, "fadeFrom": 0.1, "fadeTo": 0.9},
    {"meanSpan": True, "fadeFrom": 0.1, "fadeTo": 0.9},
    {"drainRate": True, "speedTolerance": None, "busyPenalty": True},
    {"speedTolerance": None},
]


def _pool(rng: random.Random, n: int) -> list[EndpointState]:
    pool = []
    for i in range(1, n + 1):
        s = state(
            i,
            waiting=rng.randrange(6),
            running=rng.randrange(20),
            active=tuple(rng.sample(["a", "b", "c"], rng.randrange(3))),
            served_model=rng.choice([None, "base", "other"]),
        )
        spt = rng.choice([None, rng.uniform(0.01, 0.05)])
        pool.append(EndpointState(s.endpoint, s.metrics, seconds_per_output_token=spt))
    return pool


def _scorer(params: dict[str, Any]) -> PrefillBacklogScorer:
    """A backlog scorer reading a prefix scorer's index (16-character blocks), as built."""
    sched = scheduler(
        {
            "plugins": [
                {"type": "prefix-cache-scorer", "parameters": {"blockSize": 16}},
                {
                    "type": "prefill-backlog-scorer",
                    "parameters": {"prefixScorer": "prefix-cache-scorer", **params},
                },
            ]
        }
    )
    found = sched.plugins["prefill-backlog-scorer"]
    assert isinstance(found, PrefillBacklogScorer)
    assert isinstance(found.prefix, PrefixCacheScorer)
    return found


@pytest.mark.parametrize("params", VARIANTS)
def test_backlog_scores_are_the_per_term_passes_bit_for_bit(params: dict[str, Any]) -> None:
    rng = random.Random(17)
    scorer = _scorer(params)
    prefix = scorer.prefix
    assert prefix is not None
    prompts = ["x" * 40 + "y" * rng.randrange(200) for _ in range(4)] + ["z" * 120]
    faded = 0
    for i in range(200):
        pool = _pool(rng, rng.randrange(1, 9))
        now = NOW + 0.01 * i
        req = request(
            rng.choice(["base", "a", "c"]), prompt=rng.choice(prompts), request_id=f"r{i}"
        )
        cycle = CycleState(now)
        expected = _reference_scores(scorer, cycle, req, pool)
        say = 1.0
        if scorer.fade_from is not None:  # the share as the scorer will read it (same `now`)
            share = scorer.busy_share(now, len(pool))
            say = (scorer.fade_to - share) / (scorer.fade_to - scorer.fade_from)
        got = scorer.score(cycle, req, pool)
        floor = _reference_floor(scorer, req, pool)
        if say <= 0.0:
            assert got == floor
        elif say >= 1.0:
            assert got == expected
        elif isinstance(expected, float):  # a tie: the faded floor alone
            assert got == (
                floor if isinstance(floor, float) else [(1.0 - say) * f + say for f in floor]
            )
        elif isinstance(floor, list):  # the fade blends toward the adapter term alone
            faded += 1
            assert got == [(1.0 - say) * f + say * v for f, v in zip(floor, expected, strict=True)]
        else:
            faded += 1
            assert got == [(1.0 - say) + say * v for v in expected]
        # what a decision leaves behind: a prefix placed, a backlog entry, some answered
        pick = pool[rng.randrange(len(pool))]
        prefix.index.insert(pick.endpoint.hostport, prefix.hashes(cycle, req))
        scorer.backlog.sent(req.request_id, pick.endpoint.hostport, req.prompt_tokens, now)
        if rng.random() < 0.4:
            scorer.observe_first_token(f"r{rng.randrange(i + 1)}", None, now + 0.005)
    if scorer.fade_from == 0.5:
        assert faded > 0  # the fade's blend was compared, not only its ends


def test_speed_bar_is_worked_out_once_per_decision_and_candidates() -> None:
    pool = _pool(random.Random(1), 6)  # three of six observed
    cycle = CycleState(NOW)
    first = speed_bar(pool, 1.3, cycle)
    assert first is not None
    assert first == speed_bar(pool, 1.3)  # the rule itself, uncached
    assert speed_bar(pool, 1.3, cycle) is first  # the second scorer reads the first's
    other = list(pool)  # another profile's candidates (same endpoints): worked out again
    assert speed_bar(other, 1.3, cycle) == first
    assert speed_bar(other, 1.3, cycle) is not first
    assert speed_bar(pool, 2.0, cycle) == speed_bar(pool, 2.0)  # another slack: its own
    unobserved = [EndpointState(s.endpoint, s.metrics) for s in pool]
    assert speed_bar(unobserved, 1.3) is None


# --- the saturation filter's batch path: the former loop, `_full` and the KV test per endpoint


def _reference_saturation(
    f: SaturationFilter, cycle: CycleState, cands: Sequence[EndpointState]
) -> Sequence[EndpointState]:
    p = f.params
    p = f.params
    values = saturations(  # the load module's function, not the filter's method under test
        cands,
        now=cycle.now,
        staleness_s=f.staleness_s,
        queue_threshold=p.queue_depth_threshold,
        kv_threshold=p.kv_cache_util_threshold,
        count_unseen=p.count_unseen,
    )
    kv_limit = f.limit * p.kv_cache_util_threshold
    kept: list[EndpointState] = []
    for s, v in zip(cands, values, strict=True):
        if v == STALE:
            continue
        full = f._full(s)
        if effective_kv(s, p.count_unseen) >= kv_limit:
            continue
        if not (full and v >= f.limit):
            kept.append(s)
    return cands if not kept or len(kept) == len(cands) else kept


@pytest.mark.parametrize(
    "params",
    [
        {"queueDepthThreshold": 1, "kvCacheUtilThreshold": 1.0, "headroom": 1,
         "learnMaxNumSeqs": True},
        {"queueDepthThreshold": 2, "kvCacheUtilThreshold": 0.8, "headroom": 0.2,
         "learnMaxNumSeqs": True},
        {"maxNumSeqs": 8, "kvCacheUtilThreshold": 0.5, "headroom": 0.5},
        {"maxNumSeqs": 8, "kvCacheUtilThreshold": 0.5, "headroom": 1},  # KV limit exactly 1
    ],
)  # fmt: skip
@pytest.mark.parametrize("after_stale", [False, True])
def test_saturation_filter_batch_path_is_the_former_loop(
    params: dict[str, Any], after_stale: bool
) -> None:
    """Alone, and after a stale-metrics filter in the same cycle (which tells it when every
    candidate is fresh: the default's order)."""
    new, reference = plugin("saturation-filter", params), plugin("saturation-filter", params)
    stale = plugin("stale-metrics-filter")
    rng = random.Random(23)
    n = 6
    running = [rng.randrange(4, 9) for _ in range(n)]
    differing = 0
    for step in range(300):
        now = NOW + 0.05 * step
        pool = []
        for i in range(n):  # each scrape moves a little: batches fill, queues shrink
            running[i] = max(0, min(8, running[i] + rng.choice([-1, 0, 0, 1])))
            pool.append(
                state(
                    i + 1,
                    waiting=rng.randrange(4) if running[i] >= 7 else 0,
                    running=running[i],
                    kv=rng.choice([rng.random(), 0.99, float("nan")]),
                    unseen=rng.randrange(3),
                    unseen_tokens=rng.choice([0, 5000]),
                    num_gpu_blocks=1000,
                    block_size=16,
                    updated_at=now - rng.choice([0.01, 0.01, 0.3]),
                )
            )
        # every scrape fresh in a third of the steps, so the stale filter passes them all
        if after_stale and step % 3 == 0:
            pool = [replace(s, metrics=replace(s.metrics, updated_at=now - 0.01)) for s in pool]
        cycle = CycleState(now)
        if after_stale:
            pool = stale.filter(cycle, request(), pool)  # (the same list when all are fresh)
        got = new.filter(cycle, request(), pool)
        assert [s.key for s in got] == [
            s.key for s in _reference_saturation(reference, CycleState(now), pool)
        ]
        differing += len(got) != len(pool)
    assert differing > 10  # the filter dropped endpoints, not only passed all


# --- the load scorers' shortcuts ----------------------------------------------------------------


@given(st.lists(st.integers(0, 300), min_size=1, max_size=60), st.sampled_from([0.0, 8.0]))
def test_int_min_max_is_the_plain_min_max(values: list[int], min_span: float) -> None:
    ints, plain = inverse_min_max_ints(values, min_span), inverse_min_max(values, min_span)
    if isinstance(ints, AffineScores):
        # The same affine map, told that its values are ints in 0..max (a products table).
        assert ints.top == max(values)
        ints = replace(ints, top=-1)
    assert ints == plain


PODS = [state(i) for i in range(1, 9)]


def test_the_default_profile_sums_request_counts_through_product_tables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The queue and running scorers' columns are small ints: the profile reads their weighted
    # products from tables (bit-identical: test_summers_read_table_columns_bit_for_bit). A
    # decision that never took that path would leave the speedup dead code.
    used: list[int] = []
    plain = Summers.sum

    def counted(
        self: Summers, columns: Any, factors: Any, offset: float, n: int, tables: int
    ) -> Any:
        used.append(tables)
        return plain(self, columns, factors, offset, n, tables)

    monkeypatch.setattr(Summers, "sum", counted)
    pool = [
        replace(state(i), metrics=replace(state(i).metrics, waiting=i % 3)) for i in range(1, 9)
    ]
    scheduler("default").schedule(request(prompt="p" * 4000), pool, now=NOW)
    assert used
    assert any(used)


def _reference_kv(scorer: KvCacheScorer, cands: Sequence[EndpointState]) -> list[float]:
    """The former KV values: plain, then all clamped when a sum, min or max says one is bad."""
    if scorer.count_unseen:
        values = [
            s.metrics.kv_cache_usage if not s.unseen_tokens else effective_kv(s) for s in cands
        ]
    else:
        values = [s.metrics.kv_cache_usage for s in cands]
    total = sum(values)
    if total != total or min(values) < 0.0 or max(values) > 1.0:
        values = [0.0 if v <= 0.0 else v if v < 1.0 else 1.0 for v in values]
    return values


@pytest.mark.parametrize("count_unseen", [True, False])
def test_kv_scorer_marks_bad_values_in_its_pass_as_the_former_checks_found_them(
    count_unseen: bool,
) -> None:
    scorer = plugin("kv-cache-utilization-scorer", {"countUnseen": count_unseen})
    rng = random.Random(31)
    bad = 0
    for _ in range(300):
        n = rng.randrange(1, 9)
        odd = rng.random() < 0.3  # a broken exporter somewhere
        pool = [
            state(
                i + 1,
                kv=rng.choice([-0.0, 0.0, 1.0, rng.random()])
                if not odd or rng.random() < 0.6
                else rng.choice([float("nan"), -0.2, 1.5, float("inf"), -float("inf")]),
                unseen=1,
                unseen_tokens=rng.choice([0, 0, 3000]),
                num_gpu_blocks=rng.choice([None, 1000]),
                block_size=16,
            )
            for i in range(n)
        ]
        got = scorer.score(CycleState(NOW), request(), pool)
        expected = _reference_kv(scorer, pool)
        bad += expected != [s.metrics.kv_cache_usage for s in pool]
        assert [v.hex() for v in got.values] == [float(v).hex() for v in expected]
        assert (got.scale, got.offset) == (-1.0, 1.0)
    assert bad > 20  # clamped decisions were among them


def _reference_lora(p: Any, model: str, cands: Sequence[EndpointState]) -> list[float] | float:
    """The LoRA scorer's former single pass."""
    out = [
        p.active_score
        if model == m.served_model or model in m.active_adapters
        else p.free_slot_score
        if m.max_adapters and len(m.active_adapters) + len(m.waiting_adapters) < m.max_adapters
        else p.waiting_score
        if model in m.waiting_adapters
        else 0.0
        for s in cands
        for m in [s.metrics]
    ]
    return out[0] if out and out.count(out[0]) == len(out) else out


def test_lora_scorer_on_the_shared_residency_is_its_former_pass() -> None:
    scorer = plugin("lora-affinity-scorer", {"freeSlotScore": 0.7})
    rng = random.Random(41)
    kinds = set()
    for _ in range(400):
        pool = [
            state(
                i + 1,
                active=tuple(rng.sample(["a", "b"], rng.randrange(3))),
                queued_adapters=tuple(rng.sample(["c"], rng.randrange(2))),
                max_adapters=rng.choice([0, 1, 2, 4]),
                served_model=rng.choice([None, "base", "base", "other"]),
            )
            for i in range(rng.randrange(1, 7))
        ]
        model = rng.choice(["base", "a", "c", "zz"])
        cycle = CycleState(NOW)
        if rng.random() < 0.5:  # read first by another scorer (the backlog's order is after)
            residency(pool, model, cycle)
        got = scorer.score(cycle, request(model), pool)
        found = residency(pool, model, cycle)
        kinds.add(found if isinstance(found, bool) else "mixed")
        assert got == _reference_lora(scorer.params, model, pool)
    assert kinds == {True, False, "mixed"}
