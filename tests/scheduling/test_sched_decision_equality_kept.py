"""Values kept between decisions (`datastore/columns.py`) decide as the plain passes.

The companion of `test_sched_decision_equality.py` (same pattern: the optimised code against a
reference computation), for the per-candidate values the plugins keep from one decision to
the next and patch where a candidate changed. The reference is the same code with the kept
values off (`MIN_CACHED` raised past the pool: every plugin's plain comprehension), run side
by side on an evolving pool: scrapes that change a few endpoints' metrics, in-flight changes,
endpoints added, removed, swapped or replaced at a position, pool-wide changes. A kept value
that missed a change (a stale cache) gives another score or pick and fails here.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from itertools import count
from typing import Any, TypeVar

import pytest

from poolkeeper.datastore import columns
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import GatewayError
from poolkeeper.scheduling.config import preset_config
from poolkeeper.scheduling.interfaces import CycleState
from poolkeeper.scheduling.plugins import (
    backlog_scorer,
    fit_scorers,
    fullbatch,
    prefix_scorer,
    scorers,
    shared,
    stale_filter,
)
from poolkeeper.scheduling.plugins.fullbatch import FullBatches
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import LLMRequest
from tests.scheduling.evolving_pool import endpoint_state, evolve, metrics
from tests.scheduling.sched_factories import scheduler

_T = TypeVar("_T")

# Every module that reads `MIN_CACHED` (by name, at call time).
_READERS = (scorers, fit_scorers, shared, stale_filter, fullbatch, backlog_scorer, prefix_scorer)


@contextmanager
def _plain() -> Iterator[None]:
    """Kept values off: every plugin takes its plain comprehension (the reference)."""
    name = "MIN_CACHED"
    saved = [getattr(m, name) for m in _READERS]
    for m in _READERS:
        setattr(m, name, 10**9)
    try:
        yield
    finally:
        for m, v in zip(_READERS, saved, strict=True):
            setattr(m, name, v)


def _plainly(call: Callable[[], _T]) -> _T:
    with _plain():
        return call()


def _digest(sched: Scheduler, req: LLMRequest, pool: list[EndpointState], now: float) -> str:
    try:
        result = sched.schedule(req, pool, now=now)
    except GatewayError as e:
        return f"{type(e).__name__}: {e}"
    return repr(([t.key for t in result.targets], sorted(result.scores.items())))


def _fading_soon() -> dict[str, Any]:
    """The default with its backlog scorer fading from a busy share of 0 to none at 0.2: the
    fade's blend and the adapter floor it leaves, at 90 endpoints (the kept residency)."""
    doc = preset_config("default").model_dump(by_alias=True, exclude_none=True)
    for plugin in doc["plugins"]:
        if plugin["type"] == "prefill-backlog-scorer":
            plugin["parameters"] = {**plugin.get("parameters", {}), "fadeFrom": 0.0, "fadeTo": 0.2}
    return doc


@pytest.mark.parametrize(
    "preset",
    ["default", "classic", "prefill-backlog", "prefix-affinity", "gie-v1-default", "fading"],
)
@pytest.mark.parametrize("seed", [1, 2])
def test_kept_values_decide_as_the_plain_passes_on_an_evolving_pool(preset: str, seed: int) -> None:
    rng = random.Random(seed)
    now = 1000.0
    ips = count(1)
    pool = [endpoint_state(rng, next(ips), now) for _ in range(90)]
    doc = _fading_soon() if preset == "fading" else preset
    kept, plain = scheduler(doc, seed), scheduler(doc, seed)
    # shared heads, other tails: partial matches (scores between 0 and 1) as well as whole ones
    heads = ["".join(rng.choice("abcdefgh ") for _ in range(400)) for _ in range(3)]
    tails = ["".join(rng.choice("abcdefgh ") for _ in range(300)) for _ in range(5)]
    answered: list[tuple[str, str]] = []
    for k in range(400):
        now += 0.001
        pool = evolve(rng, pool, now, ips)
        req = LLMRequest(
            f"r{k}", "base", rng.choice(["base", "base", "a", "b", "z", "z"]),
            prompt=rng.choice(heads) + rng.choice(tails), prompt_tokens=175,
        )  # fmt: skip
        got = _digest(kept, req, pool, now)
        assert got == _plainly(lambda: _digest(plain, req, pool, now)), k  # noqa: B023
        if got.startswith("(["):
            answered.append((req.request_id, got.split("'")[1]))
        if len(answered) > 20:  # first bytes come back (the learning scorers' maps move)
            rid, endpoint = answered.pop(0)
            for sched in (kept, plain):
                sched.observe_first_token(rid, endpoint, now)


@pytest.mark.parametrize("preset", ["default", "prefill-backlog"])
def test_pools_crossing_min_cached_decide_as_the_plain_passes(preset: str) -> None:
    """Candidates one below, at and one above `MIN_CACHED` in turn: the plain comprehensions
    and the kept values take over from each other (a column kept at 64 and read again after
    a decision at 63 must not answer for positions that changed in between)."""
    rng = random.Random(4)
    now = 1000.0
    ips = count(1)
    pool = [endpoint_state(rng, next(ips), now) for _ in range(columns.MIN_CACHED + 1)]
    kept, plain = scheduler(preset, 4), scheduler(preset, 4)
    prompts = ["".join(rng.choice("abcd ") for _ in range(500)) for _ in range(4)]
    for k in range(240):
        now += 0.001
        pool = evolve(rng, pool, now, ips)
        given = pool[: columns.MIN_CACHED - 1 + k % 3]
        req = LLMRequest(f"r{k}", "base", "base", prompt=rng.choice(prompts), prompt_tokens=125)
        got = _digest(kept, req, given, now)
        assert got == _plainly(lambda: _digest(plain, req, given, now)), k  # noqa: B023


def test_a_column_patches_only_the_changed_positions_and_shares_one_diff() -> None:
    seen: list[str] = []

    def one(s: EndpointState) -> str:
        seen.append(s.key)
        return s.key

    def all_of(c: object) -> list[str]:
        seen.append("all")
        return [s.key for s in c]  # type: ignore[attr-defined]

    a, b = columns.Column(all_of, one), columns.Column(all_of, one)
    rng = random.Random(3)
    pool = [endpoint_state(rng, i, 1000.0) for i in range(100)]
    first = a.values(CycleState(1.0), pool)
    assert seen == ["all"]
    assert first == [s.key for s in pool]
    moved = list(pool)
    moved[7] = endpoint_state(rng, 500, 1000.0)
    cycle = CycleState(2.0)
    b.values(cycle, pool)  # (b has no `before`: all; its snapshot is the decision's)
    seen.clear()
    assert a.values(cycle, moved) == [s.key for s in moved]
    assert seen == [moved[7].key]  # one patch
    assert first[7] == pool[7].key  # the list handed out before is not written


def test_full_batches_read_by_another_caller_are_worked_out_again() -> None:
    """`FullBatches.slots` between two decisions reads a scrape `full` did not see: the
    kept answers are then all recomputed (as the plain pass reads them again)."""
    rng = random.Random(5)
    now = 1000.0
    pool = [endpoint_state(rng, i, now) for i in range(80)]
    kept, plain = FullBatches(), FullBatches()
    differed = 0
    for k in range(600):
        now += 0.001
        pool = evolve(rng, pool, now, iter(range(10_000 + k * 10, 10_000 + k * 10 + 10)))
        if rng.random() < 0.2:  # one endpoint twice (an ip:port repeated; reads in order)
            i, j = rng.sample(range(len(pool)), 2)
            pool[i] = replace(pool[j], metrics=metrics(rng, now))
        if rng.random() < 0.3:  # a newer scrape of one endpoint, read outside `full`
            i = rng.randrange(len(pool))
            newer = replace(pool[i], metrics=metrics(rng, now))
            assert kept.slots(newer) == plain.slots(newer)
        got = kept.full(pool, CycleState(now))
        want = plain.full(pool)
        assert [id(s) for s in got] == [id(s) for s in want], k
        differed += bool(want)
    assert differed > 50  # (full batches were confirmed: the answers were not all empty)


def _scraped(s: EndpointState, at: float, running: int, waiting: int) -> EndpointState:
    return replace(s, metrics=replace(s.metrics, updated_at=at, running=running, waiting=waiting))


def _one_full_batch() -> tuple[FullBatches, list[EndpointState]]:
    """A pool of 80 whose last endpoint's batch of 8 is confirmed full (8 running twice, its
    queue shorter the second time), told to `full` with a kept answer."""
    rng = random.Random(9)
    pool = [_scraped(endpoint_state(rng, i, 1000.0), 999.0, 0, 0) for i in range(80)]
    batches = FullBatches()
    pool[-1] = _scraped(pool[-1], 999.1, 8, 5)
    batches.full(pool, CycleState(999.1))
    pool = list(pool)
    pool[-1] = _scraped(pool[-1], 999.2, 8, 3)
    assert batches.full(pool, CycleState(999.2)) == [pool[-1]]
    return batches, pool


def test_a_kept_full_batch_read_by_another_caller_is_worked_out_again() -> None:
    batches, pool = _one_full_batch()
    grown = _scraped(pool[-1], 999.3, 12, 0)  # a newer scrape: 12 run, the batch is not full
    assert batches.slots(grown) is None
    # the plain pass reads the older scrape again: the batch stays 12, not full
    assert batches.full(list(pool), CycleState(999.4)) == []


def test_a_kept_full_batch_is_worked_out_again_when_its_ip_port_comes_twice() -> None:
    batches, pool = _one_full_batch()
    twice = list(pool)
    twice[0] = _scraped(pool[-1], 999.3, 12, 0)  # the same endpoint, read first
    # in order: 12 running grows the batch (not full), then the older scrape leaves it so
    assert batches.full(twice, CycleState(999.4)) == []


def test_kept_full_batches_are_worked_out_again_when_the_map_is_cleared() -> None:
    """At `_MAX_TRACKED` endpoints a new one clears every learned batch (in order): the
    kept answers of the others go with them."""
    rng = random.Random(4)
    limit = fullbatch._MAX_TRACKED
    pool = [_scraped(endpoint_state(rng, i, 1000.0), 999.1, 8, 5) for i in range(limit)]
    batches = FullBatches()
    batches.full(pool, CycleState(999.1))
    pool = [_scraped(s, 999.2, 8, 3) for s in pool]
    assert len(batches.full(pool, CycleState(999.2))) == limit  # every batch confirmed full
    pool = list(pool)
    pool[0] = _scraped(endpoint_state(rng, limit + 1, 1000.0), 999.3, 8, 3)  # a new endpoint first
    assert batches.full(pool, CycleState(999.4)) == []  # all learned again from one scrape


def test_the_reference_turns_off_every_scheduling_module_that_keeps_values() -> None:
    """A module reading `MIN_CACHED` but missing from `_READERS` would be compared with
    itself above (kept on both sides), and a stale value there would pass unseen."""
    scheduler("default")  # (every built-in plugin module imported)
    readers = {
        name
        for name, module in list(sys.modules.items())
        if name.startswith("poolkeeper.scheduling.") and hasattr(module, "MIN_CACHED")
    }
    assert readers == {m.__name__ for m in _READERS}
