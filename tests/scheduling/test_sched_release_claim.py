"""`claimGraceMs`: the room a peer's first byte opens on a server is claimed, in this replica's
hold's view, for a grace (`scheduling/releaseclaims.py`, the fold's `claim_s`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolkeeper.flowcontrol.config import HoldNewPrefixes
from poolkeeper.flowcontrol.prefixhold import PrefixHold
from poolkeeper.scheduling.prefillfacts import PrefillFacts
from poolkeeper.scheduling.releaseclaims import ReleaseClaims
from poolkeeper.scheduling.replicasync.fold import bind_scheduler
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import LLMRequest
from tests.scheduling.sched_factories import NOW, request, scheduler, state

GRACE = 0.005
HOLD = HoldNewPrefixes()  # 2,048 tokens of backlog, 1,024 uncached


def _default() -> Scheduler:
    from poolkeeper.scheduling.presets import preset_document

    return scheduler(preset_document("default"))


def _prompt(tag: str) -> LLMRequest:
    # ~2,500 tokens, new (no shared prefix), streamed: its first byte is seen.
    return replace(request(prompt=tag * 10_000, request_id=tag), stream=True)


def _replicas(claim_s: float) -> tuple[Scheduler, Scheduler, ReplicaSync, ReplicaSync]:
    """Replica A and B, synced, B's fold claiming for `claim_s`."""
    a, b = _default(), _default()
    hub_a, hub_b = ReplicaSync("a"), ReplicaSync("b")
    bind_scheduler(hub_a, a, claim_s=claim_s)
    bind_scheduler(hub_b, b, claim_s=claim_s)
    return a, b, hub_a, hub_b


def _to(hub: ReplicaSync, out: ReplicaSync, now: float) -> None:
    batch = out.take()
    assert batch is not None
    assert hub.deliver(batch, now)


def _freed_by_a(claim_s: float) -> tuple[PrefillFacts, PrefillFacts, list[str], str]:
    """Two servers, each with one ~2,500-token new prefix (A's on one, B's on the other, each
    told to the other); then A's request answers: its server's backlog falls to 0 at A at
    NOW + 0.1, and at B when A's batch arrives, NOW + 0.1003."""
    a, b, hub_a, hub_b = _replicas(claim_s)
    pool = [state(1), state(2)]
    keys = [s.endpoint.hostport for s in pool]
    freed = a.schedule(_prompt("a"), pool, now=NOW).primary.key
    _to(hub_b, hub_a, NOW + 0.0003)
    other = b.schedule(_prompt("b"), pool, now=NOW + 0.001).primary.key
    assert other != freed  # B counted A's send: the other server
    _to(hub_a, hub_b, NOW + 0.0013)
    a.observe_first_token("a", freed, NOW + 0.1)
    _to(hub_b, hub_a, NOW + 0.1003)
    return PrefillFacts(a), PrefillFacts(b), keys, freed


def test_a_peer_does_not_release_onto_the_server_a_first_byte_freed_within_the_grace() -> None:
    _a, b, keys, freed = _freed_by_a(GRACE)
    pool = [state(1), state(2)]
    hold: PrefixHold[object] = PrefixHold(HOLD)
    new = 2_500
    # Within the grace B still counts the freed prompt there: held, and no room to place.
    within = b.backlogs(pool, NOW + 0.1003 + GRACE / 2)
    assert min(within) >= HOLD.backlog_tokens
    assert hold.holds(new, within)
    assert hold.room(new, within) is None
    # After it: released, onto the freed server only.
    after = b.backlogs(pool, NOW + 0.1003 + GRACE)
    assert not hold.holds(new, after)
    assert hold.room(new, after) == [keys.index(freed)]
    # Without `now` (the scorers, the filter's band): the backlog as it is.
    assert b.backlogs(pool)[keys.index(freed)] == 0


def test_without_the_grace_the_peer_releases_at_once() -> None:
    _a, b, keys, freed = _freed_by_a(0.0)
    pool = [state(1), state(2)]
    backlogs = b.backlogs(pool, NOW + 0.1004)
    assert not PrefixHold(HOLD).holds(2_500, backlogs)
    assert PrefixHold(HOLD).room(2_500, backlogs) == [keys.index(freed)]


def test_the_owner_of_the_first_byte_releases_at_once() -> None:
    a, _b, keys, freed = _freed_by_a(GRACE)
    pool = [state(1), state(2)]
    backlogs = a.backlogs(pool, NOW + 0.1)  # its own first byte: no claim
    assert PrefixHold(HOLD).room(2_500, backlogs) == [keys.index(freed)]


def test_one_epp_is_unaffected() -> None:
    one = _default()
    pool = [state(1), state(2)]
    first = one.schedule(_prompt("a"), pool, now=NOW).primary.key
    one.schedule(_prompt("b"), pool, now=NOW + 0.001)
    one.observe_first_token("a", first, NOW + 0.1)
    facts = PrefillFacts(one)
    assert facts.backlog is not None
    assert len(facts.backlog.backlog.claims) == 0
    backlogs = facts.backlogs(pool, NOW + 0.1)
    assert PrefixHold(HOLD).room(2_500, backlogs) == [
        [s.endpoint.hostport for s in pool].index(first)
    ]


def test_claims_expire_and_are_bounded() -> None:
    claims = ReleaseClaims(max_claims=2)
    claims.add("x", 0, NOW + 1)  # nothing cleared: no claim
    assert len(claims) == 0
    claims.add("x", 100, NOW + 1)
    claims.add("x", 50, NOW + 2)
    claims.add("y", 10, NOW + 3)  # the oldest goes
    assert claims.tokens(NOW) == {"x": 50, "y": 10}
    assert claims.tokens(NOW + 2) == {"y": 10}
    assert len(claims) == 1
    assert claims.tokens(NOW + 3) == {}
    with pytest.raises(ValueError, match="max_claims"):
        ReleaseClaims(max_claims=0)
