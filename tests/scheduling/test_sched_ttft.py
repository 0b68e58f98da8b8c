"""The predicted-TTFT model and scorer: it learns a latency law from observed first tokens,
ranks endpoints by it, stays out of the way until trained, and keeps bounded state."""

from __future__ import annotations

import random

import pytest

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import SchedulingConfig, preset_config
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, TypedName
from poolkeeper.scheduling.plugins.ttft_scorer import PredictedTtftParams, PredictedTtftScorer
from poolkeeper.scheduling.ttft import FEATURES, TtftModel
from tests.scheduling.sched_factories import NOW, request, state

# A latency law the model should recover: 20 ms + 0.1 s per 1k uncached tokens + 30 ms per
# waiting request + 10 ms per 1k unseen tokens + 50 ms per 100 running + 40 ms at full KV
# + 200 ms to load an adapter.
TRUE_W = (0.02, 0.1, 0.03, 0.01, 0.05, 0.04, 0.2)


def _x(rng: random.Random) -> tuple[float, ...]:
    return (
        1.0,
        rng.uniform(0, 4),
        float(rng.randint(0, 20)),
        rng.uniform(0, 8),
        rng.uniform(0, 2.56),
        rng.uniform(0, 1),
        float(rng.random() < 0.2),
    )


def _truth(x: tuple[float, ...]) -> float:
    return sum(w * v for w, v in zip(TRUE_W, x, strict=True))


def test_the_model_recovers_a_linear_latency_law_from_noisy_samples() -> None:
    rng = random.Random(7)
    model = TtftModel(min_samples=10)
    for _ in range(3000):
        x = _x(rng)
        model.learn(x, max(0.0, _truth(x) + rng.gauss(0, 0.01)))
    assert model.ready
    for got, want in zip(model.w, TRUE_W, strict=True):
        assert got == pytest.approx(want, abs=0.01)
    fresh = _x(rng)
    assert model.predict(fresh) == pytest.approx(_truth(fresh), rel=0.1, abs=0.01)


def test_the_fit_follows_a_change_and_unexcited_directions_do_not_wind_up() -> None:
    rng = random.Random(3)
    model = TtftModel(min_samples=10, forgetting=0.995)
    for _ in range(2000):  # no adapter ever missing: that direction is never excited
        x = (*_x(rng)[:6], 0.0)
        model.learn(x, _truth(x))
    # Bounded by the prior, not grown by 1/0.995^2000 (= 22,000x).
    assert max(model.p[i][i] for i in range(len(FEATURES))) <= model.prior * 1.0001
    for _ in range(2000):  # the servers got twice as slow
        x = (*_x(rng)[:6], 0.0)
        model.learn(x, 2 * _truth(x))
    assert model.w[1] == pytest.approx(2 * TRUE_W[1], rel=0.05)


def test_observations_pair_with_remembered_decisions_only() -> None:
    model = TtftModel(min_samples=1)
    x = (1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert not model.observe("unknown", NOW)
    model.remember("r1", "10.0.0.1:8000", NOW, x)
    # A first byte from another endpoint (a retry on a fallback) is not this decision's.
    assert not model.observe("r1", NOW + 0.1, endpoint="10.0.0.2:8000")
    assert model.samples == 0
    assert model.pending == 0
    model.remember("r2", "10.0.0.1:8000", NOW, x)
    assert not model.observe("r2", NOW - 1.0)  # a clock that went backwards: no sample
    model.remember("r3", "10.0.0.1:8000", NOW, x)
    assert model.observe("r3", NOW + 0.25, endpoint="10.0.0.1:8000")
    assert model.samples == 1
    model.remember("r4", "10.0.0.1:8000", NOW, x)
    model.drop("r4")
    assert not model.observe("r4", NOW + 1.0)
    assert model.pending == 0


def test_pending_decisions_are_bounded_and_forgotten_with_their_endpoint() -> None:
    model = TtftModel(max_pending=3)
    x = (1.0,) * len(FEATURES)
    for i in range(5):
        model.remember(f"r{i}", f"10.0.0.{i % 2}:8000", NOW, x)
    assert model.pending == 3  # the two oldest were dropped
    assert not model.observe("r0", NOW + 1)
    model.forget_endpoints({"10.0.0.1:8000"})
    assert model.pending == 1  # r3 (on .1) is all that is left
    assert model.observe("r3", NOW + 1)


def test_a_negative_fit_predicts_zero_and_the_prior_is_a_ridge() -> None:
    model = TtftModel(prior=0.5)
    assert model.p == [[0.5 if i == j else 0.0 for j in range(7)] for i in range(7)]
    model.w = [-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert model.predict((1.0,) * 7) == 0.0
    model.w = [0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert model.predict((1.0,) * 7) == 0.25


def test_a_reused_request_id_is_the_newest_decision() -> None:
    model = TtftModel(max_pending=2, min_samples=1)
    x = (1.0,) * 7
    model.remember("a", "e1", NOW, x)
    model.remember("b", "e1", NOW, x)
    model.remember("a", "e2", NOW + 1, x)  # a again: now the newest
    model.remember("c", "e1", NOW + 2, x)  # evicts b, the oldest
    assert not model.observe("b", NOW + 3)
    assert model.observe("a", NOW + 1, endpoint="e2")  # the same instant: a sample of 0 s
    assert not model.observe("c", float("inf"))


@pytest.mark.parametrize("ok", [{"forgetting": 1.0}, {"forgetting": 0.9}, {"max_pending": 1}])
def test_edge_settings_are_accepted(ok: dict[str, float]) -> None:
    assert not TtftModel(**ok).ready  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [{"forgetting": 0.5}, {"forgetting": 1.5}, {"min_samples": 0}, {"max_pending": 0},
     {"prior": 0.0}],
)  # fmt: skip
def test_bad_model_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        TtftModel(**bad)  # type: ignore[arg-type]


def _trained_scorer() -> PredictedTtftScorer:
    scorer = PredictedTtftScorer(
        TypedName("predicted-ttft-scorer", "predicted-ttft-scorer"),
        PredictedTtftParams.model_validate({"minSamples": 5}),
    )
    rng = random.Random(1)
    for _ in range(500):
        x = _x(rng)
        scorer.model.learn(x, _truth(x))
    return scorer


def test_untrained_the_scorer_has_no_effect() -> None:
    scorer = PredictedTtftScorer(
        TypedName("predicted-ttft-scorer", "predicted-ttft-scorer"), PredictedTtftParams()
    )
    pool = [state(1, waiting=30), state(2)]
    assert scorer.score(CycleState(NOW), request(), pool) == 1.0


def test_trained_it_ranks_by_predicted_time_and_agrees_with_the_model() -> None:
    scorer = _trained_scorer()
    req = request("base", prompt="q" * 4000)
    pool = [
        state(1, waiting=10, served_model="base"),  # 10 x 30 ms queue
        state(2, waiting=1, served_model="base"),
        state(3, waiting=0, running=200, served_model="base"),  # a full batch: +100 ms
        state(4, waiting=0, served_model="other"),  # would load an adapter: +200 ms
        state(5, waiting=1, kv=float("nan"), served_model="base"),  # unknown KV counts as full
    ]
    cycle = CycleState(NOW)
    preds = scorer.predictions(cycle, req, pool)
    for s, p in zip(pool, preds, strict=True):
        x = scorer.features(req, s, 0, len(req.prompt))
        assert p == pytest.approx(scorer.model.predict(x), rel=1e-9)
    scores = scorer.score(cycle, req, pool)
    assert isinstance(scores, list)
    assert scores[1] == 1.0  # endpoint 2: one waiting request is the cheapest here
    assert scores[0] < scores[2] < scores[1]
    assert scores[3] < scores[1]
    assert preds[4] == pytest.approx(preds[1] + scorer.model.w[5])  # + the full-KV term
    assert all(0.0 < v <= 1.0 for v in scores)


def test_the_expected_prefix_hit_comes_from_the_named_prefix_scorer() -> None:
    doc = preset_config("predicted-ttft")
    scheduler = build_scheduler(doc, rng=random.Random(1))
    scorer = scheduler.plugins["predicted-ttft-scorer"]
    assert isinstance(scorer, PredictedTtftScorer)
    assert scorer.prefix is not None
    rng = random.Random(2)
    for _ in range(500):
        x = _x(rng)
        scorer.model.learn(x, _truth(x))
    req = request(prompt="a long shared system prompt " * 100)  # 700 tokens
    pool = [state(1, waiting=2), state(2, waiting=2)]
    scorer.prefix.index.insert(pool[0].key, scorer.prefix.hashes(CycleState(NOW), req))
    preds = scorer.predictions(CycleState(NOW), req, pool)
    # Endpoint 1 caches the prompt: 700 tokens x 0.1 s / 1k less prefill.
    assert preds[1] - preds[0] == pytest.approx(0.07, abs=0.005)


def test_prefix_scorer_reference_must_name_a_prefix_cache_scorer() -> None:
    def build(ref: str) -> None:
        config = SchedulingConfig.model_validate(
            {
                "plugins": [
                    {"type": "queue-scorer"},
                    {"type": "predicted-ttft-scorer", "parameters": {"prefixScorer": ref}},
                ]
            }
        )
        build_scheduler(config, rng=random.Random(1))

    with pytest.raises(ConfigError, match="is not a prefix-cache-scorer"):
        build("queue-scorer")
    with pytest.raises(ConfigError, match="no plugin named 'nope'"):
        build("nope")


def test_the_scheduler_feeds_first_tokens_to_the_learner() -> None:
    scheduler = build_scheduler(preset_config("predicted-ttft"), rng=random.Random(1))
    assert scheduler.observes_first_tokens
    classic = build_scheduler(preset_config("classic"), rng=random.Random(1))
    assert not classic.observes_first_tokens
    scorer = scheduler.plugins["predicted-ttft-scorer"]
    assert isinstance(scorer, PredictedTtftScorer)
    pool = [state(1), state(2)]
    for i in range(3):
        scheduler.schedule(request(request_id=f"r{i}"), pool, now=NOW)
    assert scorer.model.pending == 3
    picked = scheduler.schedule(request(request_id="r9"), pool, now=NOW).primary.key
    scheduler.observe_first_token("r9", picked, NOW + 0.05)
    scheduler.request_ended("r9")
    scheduler.request_ended("r0")  # ended without a first byte: forgotten, no sample
    assert scorer.model.samples == 1
    assert scorer.model.pending == 2


def test_post_cycle_remembers_the_cache_as_it_was_at_the_decision() -> None:
    scheduler = build_scheduler(preset_config("predicted-ttft"), rng=random.Random(1))
    scorer = scheduler.plugins["predicted-ttft-scorer"]
    assert isinstance(scorer, PredictedTtftScorer)
    req = request(request_id="cold", prompt="never seen before " * 60)  # 270 tokens
    scheduler.schedule(req, [state(1)], now=NOW)
    # The prefix scorer recorded the prompt after the decision; the remembered features must
    # still say "uncached" (270 tokens), not the hit the index now reports.
    entry = scorer.model._pending["cold"]
    assert entry.x[1] == pytest.approx(0.27)


def test_a_result_without_targets_is_not_remembered() -> None:
    scorer = _trained_scorer()
    scorer.post_cycle(CycleState(NOW), request(), ProfileResult("default", ()))
    assert scorer.model.pending == 0
