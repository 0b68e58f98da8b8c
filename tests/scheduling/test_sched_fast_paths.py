"""The scheduler's and the profile's per-request shortcuts decide exactly as the general code:
the single-profile handler's loop taken directly, the profile's precomputed plugin calls. Two
schedulers from one configuration and seed, one with the shortcut off, see the same requests
and pools and must return the same results (endpoints, scores, profile) and errors."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import GatewayError
from poolkeeper.scheduling.candidate_presets import candidate_document
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.interfaces import AffineScores, CycleState, TypedName
from poolkeeper.scheduling.profile import SchedulerProfile, clamp_unit
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import SchedulingResult
from tests.scheduling.sched_factories import request, scheduler, state

FILTERING = {
    "plugins": [
        {"type": "low-queue-filter", "parameters": {"threshold": 3}},
        {"type": "queue-scorer"},
        {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 2}},
    ]
}


def _pair(name: str) -> tuple[Scheduler, Scheduler]:
    if name == "filtering":
        fast, general = scheduler(FILTERING, seed=5), scheduler(FILTERING, seed=5)
    elif name.startswith("candidate:"):
        doc = candidate_document(name.partition(":")[2])
        config = SchedulingConfig.model_validate(doc)
        fast, general = (
            scheduler(config.model_dump(by_alias=True, exclude_unset=True), seed=5)
            for _ in range(2)
        )
    else:
        fast, general = scheduler(name, seed=5), scheduler(name, seed=5)
    assert fast._only is not None
    general._only = None  # the handler's loop, as before the shortcut
    return fast, general


def _outcome(sched: Scheduler, *args: object, **kwargs: object) -> object:
    try:
        result: SchedulingResult = sched.schedule(*args, **kwargs)  # type: ignore[arg-type]
    except GatewayError as exc:
        return (type(exc), exc.message)
    return [t.key for t in result.targets], result.profile, dict(result.scores)


@pytest.mark.parametrize(
    "name",
    ["default", "prefix-affinity", "filtering", "candidate:prefix-affinity-miss-gate"],
)
def test_shortcuts_decide_as_the_general_loop(name: str) -> None:
    fast, general = _pair(name)
    kinds = set()
    rng = random.Random(11)
    prompts = ["", "a" * 300, "b" * 3000, "a" * 300 + "c" * 900, "d" * 6000]
    for i in range(300):
        pool = [
            state(j, waiting=rng.randrange(5), running=rng.randrange(9), kv=rng.random())
            for j in range(1, rng.randrange(1, 6) + 1)
        ]
        req = request(prompt=rng.choice(prompts), request_id=f"r{i}")
        now = 100.0 + i * 0.01
        outcome = _outcome(fast, req, pool, now=now)
        assert outcome == _outcome(general, req, pool, now=now), i
        kinds.add(isinstance(outcome, tuple) and isinstance(outcome[0], type))
    # every plugin timed as often (the durations themselves are the clock's)
    counts = {key: hist.count for key, hist in fast.stats.plugins()}
    assert counts == {key: hist.count for key, hist in general.stats.plugins()}
    if name == "filtering":
        assert len(kinds) == 2  # decisions and FilteredOut both happened


def test_cycle_state_get_and_put_are_per_decision() -> None:
    one, two = CycleState(1.0), CycleState(2.0)
    assert one.get("k") is None
    one.put("k", [1])
    assert one.get("k") == [1]
    assert two.get("k") is None  # each decision its own scratch space


class _Const:
    """A scorer that returns one value for every candidate."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.typed_name = TypedName("const", f"const-{value}")

    def score(self, cycle: object, request: object, candidates: object) -> float:
        return self.value


class _Recorder:
    typed_name = TypedName("recorder", "recorder")

    def __init__(self) -> None:
        self.totals: list[float] = []

    def pick(self, candidates: Sequence[EndpointState], scores: Sequence[float]) -> list[int]:
        self.totals = list(scores)
        return [0]


@pytest.mark.parametrize("value", [2.0, 1.0, 0.25, 0.0, -1.0, math.nan, 3, -0.0])
def test_a_constant_score_is_clamped_into_the_unit_range(value: float) -> None:
    picker = _Recorder()
    weight = 1.5
    profile = SchedulerProfile("p", [], [(_Const(value), weight)], picker)
    profile.run(CycleState(1.0), request(), [state(1), state(2)])
    assert picker.totals == [weight * clamp_unit(float(value))] * 2


class _LyingBound:
    """A third-party scorer, bounded, whose `top` its own values break (-1 is below 0)."""

    typed_name = TypedName("liar", "liar")
    bounded = True

    def score(self, cycle: object, request: object, candidates: object) -> AffineScores:
        return AffineScores([-1, 0, 1], 0.25, 0.5, top=1)


def test_only_built_in_scorers_table_bounds_are_read() -> None:
    # A table of products indexed by a value below 0 reads from its end (-1 -> 1 x factor)
    # and one above `top` raises: a third-party scorer's bound is not trusted.
    picker = _Recorder()
    profile = SchedulerProfile("p", [], [(_LyingBound(), 2.0)], picker)
    profile.run(CycleState(1.0), request(), [state(1), state(2), state(3)])
    assert picker.totals == [2.0 * 0.25, 2.0 * 0.5, 2.0 * 0.75]
