"""The cold-placement filter's `shareBacklog`: an endpoint at its share of chain heads counts
as backlogged for flow control's hold and the band, so a held new prefix is not released onto
the one endpoint with room when that endpoint already holds its share
(docs/notes/2026-12-07-uneven-start.md)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from poolkeeper.flowcontrol.config import HoldNewPrefixes
from poolkeeper.flowcontrol.prefixhold import PrefixHold
from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.prefillfacts import PrefillFacts
from poolkeeper.scheduling.scheduler import Scheduler
from tests.scheduling.sched_factories import NOW, cycle, key, request, scheduler, state
from tests.scheduling.test_sched_cold_placement import (
    SYSTEMS,
    _backlog_doc,
    _exact,
    _filter,
    _report,
)

FP = {"balance": 1, "pendingHeads": True}


def _fleet(share: bool) -> Scheduler:
    """4 endpoints; endpoint 1 holds 2 groups (one reported, one sent and pending), the others
    one each, so balance's bound over the pool is ceil(6 / 4) = 2; endpoints 2-4 are busy
    prefilling (3,000 tokens each without a first byte), endpoint 1 is not."""
    doc = _backlog_doc(**FP, **({"shareBacklog": True} if share else {}))
    doc["plugins"][1]["parameters"] = {"kvEvents": True, "kvEventsSubscribe": False}
    sched = scheduler(doc)
    for i, g in ((1, 10), (2, 11), (3, 12), (4, 13)):
        _report(sched, key(i), SYSTEMS[g])
    _exact(sched).sent(key(1), engine_block_hashes("base", SYSTEMS[14][:64], 16)[0], NOW)
    backlog = _filter(sched).backlog
    assert backlog is not None
    for i in (2, 3, 4):
        backlog.backlog.sent(f"busy{i}", key(i), 3_000, NOW)
    return sched


def _hold() -> PrefixHold[Any]:
    return PrefixHold(HoldNewPrefixes())


def test_a_new_prefix_waits_rather_than_take_the_only_room_at_its_share() -> None:
    pool = [state(i) for i in range(1, 5)]
    plain, shared = _fleet(share=False), _fleet(share=True)
    _filter(plain).filter(cycle(), request(prompt=SYSTEMS[2]), pool)  # a cycle at NOW
    _filter(shared).filter(cycle(), request(prompt=SYSTEMS[2]), pool)
    # Without it, endpoint 1 has room: released, and `placeUnderBacklog` sends it only there
    # (a third group on it while the others hold one).
    facts = PrefillFacts(plain).backlogs(pool)
    assert facts == [0, 3_000, 3_000, 3_000]
    assert not _hold().holds(2_000, facts)
    assert _hold().room(2_000, facts) == [0]
    # With it, endpoint 1 is at its share: every endpoint counts as backlogged, so it waits.
    facts = PrefillFacts(shared).backlogs(pool)
    assert facts == [2_048, 3_000, 3_000, 3_000]
    assert _hold().holds(2_000, facts)
    # Once endpoint 3's prefill answers, it is the room the prefix is released to.
    backlog = _filter(shared).backlog
    assert backlog is not None
    backlog.backlog.first_token("busy3", NOW)
    facts = PrefillFacts(shared).backlogs(pool)
    assert not _hold().holds(2_000, facts)
    assert _hold().room(2_000, facts) == [2]


def test_the_band_does_not_narrow_to_an_endpoint_at_its_share() -> None:
    """The filter's own band reads the same backlog. Without the option, endpoint 1 (the only
    one under the backlog) is the band, and balance computed over that band of one keeps it
    for every cold prompt; with it, endpoint 1 is not preferred for being idle, and balance
    over the pool keeps it out."""
    pool = [state(i) for i in range(1, 5)]
    plain, shared = _fleet(share=False), _fleet(share=True)
    for g in range(20, 36):
        prompt = request(prompt=SYSTEMS[g])
        assert [s.key for s in _filter(plain).filter(cycle(), prompt, pool)] == [key(1)]
        (kept,) = _filter(shared).filter(cycle(), prompt, pool)
        assert kept.key != key(1)


def test_share_backlog_needs_a_backlog_scorer_and_balance() -> None:
    from tests.scheduling.test_sched_cold_placement import _doc

    with pytest.raises(ValidationError, match="shareBacklog needs backlogScorer and balance"):
        scheduler(_doc(exact=True, balance=1, shareBacklog=True))
    with pytest.raises(ValidationError, match="shareBacklog needs backlogScorer and balance"):
        scheduler(_backlog_doc(shareBacklog=True))
