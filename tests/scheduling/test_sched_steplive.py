"""The step clock fed live (`stepclock.py`'s `back_date`, `steplive.py`, the scorer's `live`):
first bytes dated by the batch that stored their prompt, ends back-dated, the clocks mapped."""

from __future__ import annotations

import asyncio
import copy
import random
from typing import Any

import pytest

from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.candidate_presets import candidate_document
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, TypedName
from poolkeeper.scheduling.plugins.stepphase_scorer import StepPhaseParams, StepPhaseScorer
from poolkeeper.scheduling.stepclock import StepClock
from poolkeeper.scheduling.steplive import StepBatchFeed, feeds
from poolkeeper.scheduling.types import LLMRequest

PRIOR = (0.006, 45e-6, 20e-6, 0.0)  # 6 ms a step, 45 us a prefill token, 20 us a decoder
STEP = 0.00602  # one decode step of one request under PRIOR


def _request(request_id: str, prompt_tokens: int = 100, char: str = "x") -> LLMRequest:
    return LLMRequest(
        request_id=request_id, model="m", target_model="m", prompt=char * (4 * prompt_tokens),
        prompt_tokens=prompt_tokens, max_tokens=10, stream=True,
    )  # fmt: skip


def _decode_steps(clock: StepClock, first: float, n: int) -> float:
    """n decode steps after `first`, each publishing a batch; the last one's end."""
    for i in range(1, n + 1):
        clock.step_ended("e1", first + i * STEP)
    return first + n * STEP


def test_a_first_byte_dated_by_its_batch_counts_as_on_time_and_its_late_report_does_nothing() -> (
    None
):
    live = StepClock(PRIOR, require_fit=False, back_date=True)
    live.sent("e1", "a", 100, 0, 0.0)
    live.watch("e1", "a", (7,))
    live.step_ended("e1", 0.0105, firsts=["a"])  # the batch that stored its prompt
    _decode_steps(live, 0.0105, 3)
    live.first_token("a", 0.040)  # its first byte, reported 30 ms late
    live.clocks["e1"].learner.advance(1.0)
    learner = live.clocks["e1"].learner
    assert learner.decoding["a"][1] == 1  # decoding from the first step on
    assert learner.steps == 4
    assert live.clocks["e1"].dated == 1
    # Told the late report as the step's time instead, the learner counts the wrong step:
    naive = StepClock(PRIOR, require_fit=False)
    naive.sent("e1", "a", 100, 0, 0.0)
    naive.step_ended("e1", 0.0105)
    _decode_steps(naive, 0.0105, 3)
    naive.first_token("a", 0.040)
    naive.clocks["e1"].learner.advance(1.0)
    assert naive.clocks["e1"].learner.decoding["a"][1] != 1


def test_an_undated_first_byte_decodes_from_its_report_and_anchors_nothing() -> None:
    live = StepClock(PRIOR, require_fit=False, back_date=True)
    live.sent("e1", "a", 10, 0, 0.0)  # shorter than a block: nothing stored, nothing watched
    last = _decode_steps(live, 0.0, 20)
    live.first_token("a", last + 0.002)
    learner = live.clocks["e1"].learner
    assert "a" in learner.decoding
    assert "a" not in learner.waiting
    assert live.clocks["e1"].undated == 1
    live.ended("a", last + 0.5, 40)
    assert "a" not in learner.decoding
    assert not learner.counts


def test_an_end_reported_late_is_anchored_at_its_back_dated_step() -> None:
    live = StepClock(PRIOR, require_fit=False, back_date=True, end_late_s=0.02)
    live.sent("e1", "a", 100, 0, 0.0)
    live.watch("e1", "a", (7,))
    live.step_ended("e1", 0.0105, firsts=["a"])
    out = 40
    last = _decode_steps(live, 0.0105, out - 1)  # its last token's step
    _decode_steps(live, last, 5)  # others' steps go on while its end is on its way
    live.ended("a", last + 0.02, out)
    assert live.clocks["e1"].learner.counts[-1] == (out - 1, out - 1)


def test_an_end_told_at_its_report_time_would_overcount() -> None:
    live = StepClock(PRIOR, require_fit=False, back_date=True, end_late_s=0.0)
    live.sent("e1", "a", 100, 0, 0.0)
    live.watch("e1", "a", (7,))
    live.step_ended("e1", 0.0105, firsts=["a"])
    last = _decode_steps(live, 0.0105, 39)
    _decode_steps(live, last, 5)
    live.ended("a", last + 0.02, 40)  # not back-dated: three steps too many
    counted, true = live.clocks["e1"].learner.counts[-1]
    assert counted == true + 3


def test_a_batch_out_of_order_dates_nothing() -> None:
    live = StepClock(PRIOR, require_fit=False, back_date=True)
    live.sent("e1", "a", 100, 0, 0.0)
    live.watch("e1", "a", (7,))
    _decode_steps(live, 0.0, 3)
    live.step_ended("e1", 0.001, firsts=["a"])  # before the last boundary: dropped
    assert "a" in live.watched("e1")
    assert live.clocks["e1"].dated == 0


def test_the_feed_maps_the_engines_wall_clock_onto_the_decisions_and_chains() -> None:
    got: list[tuple[str, float]] = []
    seen: list[tuple[str, float, float]] = []

    class Scorer:
        def step_ended(self, endpoint: str, ts: float) -> None:
            got.append((endpoint, ts))

    feed = StepBatchFeed(
        [Scorer()],  # type: ignore[list-item]
        clock=lambda: 50.0,
        wall=lambda: 1_000_050.0,
        then=lambda e, ts, r: seen.append((e, ts, r)),
    )
    feed("e1", 1_000_049.99, 1_000_049.995)
    assert [e for e, _ in got] == ["e1"]
    assert got[0][1] == pytest.approx(49.99)
    assert seen == [("e1", 1_000_049.99, 1_000_049.995)]  # the tap keeps the engine's stamp


def _document(kv_events: bool) -> dict[str, Any]:
    doc = copy.deepcopy(candidate_document("default-stepclock-w4"))
    for plugin in doc["plugins"]:
        if plugin["type"] == "prefix-cache-scorer" and kv_events:
            plugin.setdefault("parameters", {}).update({"kvEvents": True, "kvEventsPort": 5557})
    return doc


def test_the_scorer_is_fed_only_by_a_prefix_scorer_with_exact_events() -> None:
    scheduler = build_scheduler(
        SchedulingConfig.model_validate(_document(True)), rng=random.Random(1)
    )
    fed, neutral = feeds(scheduler.plugins)
    assert neutral == []
    assert list(fed) == ["prefix-cache-scorer"]
    prefix, scorers = fed["prefix-cache-scorer"]
    assert len(scorers) == 1
    assert scorers[0].exact is prefix.exact
    assert scorers[0].clock.back_date
    assert prefix.subscriber is not None
    asyncio.run(prefix.subscriber.close())  # (its ZMQ context)
    plain = build_scheduler(SchedulingConfig.model_validate(_document(False)), rng=random.Random(1))
    fed, neutral = feeds(plain.plugins)
    assert fed == {}
    assert len(neutral) == 1


def test_live_the_scorer_watches_a_new_prompt_and_its_storing_batch_dates_it() -> None:
    exact = ExactPrefixIndex(block_size=16)
    scorer = StepPhaseScorer(
        TypedName("step-phase-scorer", "s"),
        StepPhaseParams.model_validate({"requireFit": False}),
        None,
    )
    scorer.live(exact)
    state = EndpointState(Endpoint(name="a", address="10.0.0.1", port=8000), EndpointMetrics())
    key = state.endpoint.hostport
    new, cached = _request("new", 100), _request("hit", 200, "y")
    hit_blocks = engine_block_hashes("m", cached.prompt, 16)
    exact.stored(key, hit_blocks, 0.0, head=True)  # the second prompt is all cached already
    for request in (new, cached):
        scorer.post_cycle(CycleState(now=0.001), request, ProfileResult("default", (state,)))
    assert list(scorer.clock.watched(key)) == [new.key]
    scorer.step_ended(key, 0.005)  # a batch that did not store it
    assert new.key in scorer.clock.watched(key)
    exact.stored(key, engine_block_hashes("m", new.prompt, 16), 0.011, head=True)
    scorer.step_ended(key, 0.0105)
    assert scorer.clock.watched(key) == {}
    assert scorer.clock.clocks[key].dated == 1
