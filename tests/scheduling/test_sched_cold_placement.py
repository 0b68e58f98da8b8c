"""The cold-placement filter: independent schedulers send a new long prefix to the same endpoint,
load outside the band overrides, an endpoint leaving moves only its own prefixes, and warm or
short prompts pass untouched."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError

from poolkeeper.errors import ConfigError
from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.cold_placement import ColdPlacementFilter
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.scheduler import Scheduler
from tests.scheduling.sched_factories import NOW, cycle, key, request, scheduler, state

SYSTEMS = [f"system prompt {g:03d} " * 200 for g in range(64)]  # ~3,800 chars: 59 blocks


def _doc(exact: bool = False, **params: Any) -> dict[str, Any]:
    """The filter first, then the prefix scorer and a queue scorer that would pick the least
    loaded (weight 10) without it."""
    prefix: dict[str, Any] = {"type": "prefix-cache-scorer"}
    if exact:
        prefix["parameters"] = {"kvEvents": True, "kvEventsSubscribe": False}
    return {
        "plugins": [
            {"type": "cold-placement-filter", "parameters": params},
            prefix,
            {"type": "queue-scorer"},
            {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 1}},
        ],
        "schedulingProfiles": [
            {
                "name": "p",
                "plugins": [
                    {"pluginRef": "cold-placement-filter"},
                    {"pluginRef": "prefix-cache-scorer", "weight": 1},
                    {"pluginRef": "queue-scorer", "weight": 10},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def _filter(sched: Scheduler) -> ColdPlacementFilter:
    plugin = sched.plugins["cold-placement-filter"]
    assert isinstance(plugin, ColdPlacementFilter)
    return plugin


def _prefix(sched: Scheduler) -> PrefixCacheScorer:
    plugin = sched.plugins["prefix-cache-scorer"]
    assert isinstance(plugin, PrefixCacheScorer)
    return plugin


def _exact(sched: Scheduler) -> ExactPrefixIndex:
    exact = _prefix(sched).exact
    assert exact is not None
    return exact


def _pick(sched: Scheduler, prompt: str, pool: list[Any]) -> str:
    return sched.schedule(request(prompt=prompt), pool, now=NOW).primary.key


def _kept(sched: Scheduler, prompt: str, pool: list[Any]) -> list[str]:
    return [s.key for s in _filter(sched).filter(cycle(), request(prompt=prompt), pool)]


def test_two_independent_schedulers_place_every_new_prefix_on_the_same_endpoint() -> None:
    a, b = scheduler(_doc(), seed=1), scheduler(_doc(), seed=2)
    pool = [state(i) for i in range(1, 9)]
    shuffled = pool[::-1]  # another replica may list the endpoints in another order
    picks = [_pick(a, s + "question", pool) for s in SYSTEMS]
    assert picks == [_pick(b, s + "other question", shuffled) for s in SYSTEMS]
    # Deterministic yet spread: 64 prefixes over 8 endpoints land on every one.
    assert set(picks) == {key(i) for i in range(1, 9)}


def test_without_the_filter_the_load_scorer_decides() -> None:
    """The control for the test above: the queue scorer alone sends a new prefix to the least
    loaded endpoint; the filter keeps it on its owner while the owner is within the band."""
    (owner,) = _kept(scheduler(_doc()), SYSTEMS[0], [state(i) for i in range(1, 9)])
    idle = next(i for i in range(1, 9) if key(i) != owner)
    pool = [state(i, waiting=0 if i == idle else 2) for i in range(1, 9)]
    assert _pick(scheduler(_doc()), SYSTEMS[0], pool) == owner
    no_filter = _doc()
    no_filter["schedulingProfiles"][0]["plugins"].pop(0)
    assert _pick(scheduler(no_filter), SYSTEMS[0], pool) == key(idle)


def test_load_outside_the_band_overrides_the_owner() -> None:
    sched = scheduler(_doc())
    idle = [state(i, running=4) for i in range(1, 5)]
    (owner,) = _kept(sched, SYSTEMS[1], idle)
    i = int(owner.split(".")[3].split(":")[0])

    def with_owner(running: int, waiting: int = 0, unseen: int = 0) -> list[Any]:
        return [
            state(j, running=running, waiting=waiting, unseen=unseen)
            if j == i
            else state(j, running=4)
            for j in range(1, 5)
        ]

    # 8 more than the least (the band's edge): still the owner.
    assert _kept(sched, SYSTEMS[1], with_owner(8, waiting=4)) == [owner]
    # 9 more and 3.25x: out of the band, the next on the ring takes it.
    moved = _kept(sched, SYSTEMS[1], with_owner(9, waiting=4))
    assert len(moved) == 1
    assert moved != [owner]
    # Far more in absolute terms but under 1.5x the least: a busy fleet, still the owner.
    heavy = [state(j, running=100 if j != i else 140) for j in range(1, 5)]
    assert _kept(sched, SYSTEMS[1], heavy) == [owner]
    # Requests this EPP sent since the scrape count only with countUnseen.
    assert _kept(sched, SYSTEMS[1], with_owner(4, unseen=20)) == [owner]
    counting = scheduler(_doc(countUnseen=True))
    assert _kept(counting, SYSTEMS[1], with_owner(4, unseen=20)) != [owner]


def test_an_endpoint_leaving_moves_only_its_own_prefixes() -> None:
    sched = scheduler(_doc())
    pool = [state(i) for i in range(1, 9)]
    before = {s: _kept(sched, s, pool)[0] for s in SYSTEMS}
    gone = before[SYSTEMS[0]]
    rest = [s for s in pool if s.key != gone]
    after = {s: _kept(sched, s, rest)[0] for s in SYSTEMS}
    moved = {s for s in SYSTEMS if after[s] != before[s]}
    assert moved == {s for s in SYSTEMS if before[s] == gone}
    assert gone not in after.values()


def test_warm_and_short_prompts_pass_untouched() -> None:
    sched = scheduler(_doc())
    pool = [state(i) for i in range(1, 5)]
    assert len(_kept(sched, "a short question", pool)) == 4
    # Once an endpoint holds the prefix (a decision recorded it), the scorers decide.
    placed = ProfileResult("p", (pool[3],))
    _prefix(sched).post_cycle(cycle(), request(prompt=SYSTEMS[2] + "q"), placed)
    assert len(_kept(sched, SYSTEMS[2] + "q2", pool)) == 4


def test_keep_placed_sends_a_placed_prefix_only_to_its_holders_in_every_replica() -> None:
    """Two replicas whose load views differ (each counts its own unseen sends): without
    `keepPlaced` a placed prefix goes where each one's load scorer says, two servers; with it,
    both send it to the endpoint their shared index says holds it, whatever their load."""
    pool = [state(i) for i in range(1, 5)]
    holder = pool[2]

    def view(busy: int) -> list[Any]:  # endpoint `busy` has 6 requests this replica sent
        return [replace(s, unseen_requests=6) if i == busy else s for i, s in enumerate(pool)]

    def picks(**params: Any) -> set[str]:
        out = set()
        for seed, busy in ((1, 2), (2, 0)):
            sched = scheduler(_doc(countUnseen=True, **params), seed=seed)
            placed = ProfileResult("p", (holder,))  # a peer's send, folded into the index
            _prefix(sched).post_cycle(cycle(), request(prompt=SYSTEMS[6] + "q"), placed)
            out.add(_pick(sched, SYSTEMS[6] + "q2", view(busy)))
        return out

    assert len(picks()) == 2  # the control: the group is split across two servers
    assert picks(keepPlaced=True) == {holder.key}
    # Held by two (an earlier split): both stay candidates, the scorers choose between them.
    sched = scheduler(_doc(keepPlaced=True))
    for s in (pool[0], holder):
        placed = ProfileResult("p", (s,))
        _prefix(sched).post_cycle(cycle(), request(prompt=SYSTEMS[6] + "q"), placed)
    assert sorted(_kept(sched, SYSTEMS[6] + "q2", pool)) == sorted([pool[0].key, holder.key])
    # A holder gone from the candidates: placed as a cold prompt (its ring owner among them).
    rest = [s for s in pool if s.key not in (pool[0].key, holder.key)]
    cold = scheduler(_doc())
    assert _kept(sched, SYSTEMS[6] + "q2", rest) == _kept(cold, SYSTEMS[6] + "q2", rest)
    assert len(_kept(sched, SYSTEMS[6] + "q2", rest)) == 1
    # Short prompts still pass untouched.
    assert len(_kept(sched, "a short question", pool)) == 4


def _report(sched: Scheduler, endpoint: str, prompt: str, chars: int = 64) -> None:
    """`endpoint`'s engine reports storing `prompt`'s first `chars` (a chain from its head)."""
    exact = _exact(sched)
    exact.stored(endpoint, engine_block_hashes("base", prompt[:chars], 16), NOW, head=True)
    exact.heard(endpoint, NOW)


def test_balance_skips_an_owner_over_its_share_of_reported_prefixes() -> None:
    plain, bal = scheduler(_doc(exact=True)), scheduler(_doc(exact=True, balance=1))
    pool = [state(i) for i in range(1, 5)]
    (owner,) = _kept(plain, SYSTEMS[3], pool)
    assert _kept(bal, SYSTEMS[3], pool) == [owner]
    for sched in (plain, bal):  # the owner's engine reports two other prefixes
        for g in (10, 11):
            _report(sched, owner, SYSTEMS[g])
    assert _kept(plain, SYSTEMS[3], pool) == [owner]
    (moved,) = _kept(bal, SYSTEMS[3], pool)
    assert moved != owner
    # Prefixes this EPP sent but no engine reported count only with pendingHeads.
    pending = scheduler(_doc(exact=True, balance=1, pendingHeads=True))
    quiet = scheduler(_doc(exact=True, balance=1))
    for sched in (pending, quiet):
        exact = _exact(sched)
        for g in (10, 11):
            exact.sent(owner, engine_block_hashes("base", SYSTEMS[g][:64], 16)[0], NOW)
    assert _kept(quiet, SYSTEMS[3], pool) == [owner]
    assert _kept(pending, SYSTEMS[3], pool) != [owner]


def test_bad_configurations_are_refused_precisely() -> None:
    with pytest.raises(ConfigError, match="balance needs the prefix scorer's kvEvents"):
        scheduler(_doc(balance=1))
    with pytest.raises(ValueError, match="balance must be 0"):  # the config's validation
        scheduler(_doc(exact=True, balance=0.5))
    bad = _doc()
    bad["plugins"][0]["parameters"] = {"prefixScorer": "queue-scorer"}
    with pytest.raises(ConfigError, match="is not a prefix-cache-scorer"):
        scheduler(bad)


def test_the_cycle_state_is_shared_with_the_scorer() -> None:
    """The filter hashes the prompt once: the scorer reads the same cycle entry."""
    sched = scheduler(_doc())
    c = CycleState(NOW)
    req = request(prompt=SYSTEMS[4])
    _filter(sched).filter(c, req, [state(1), state(2)])
    assert c.get("prefix-hashes/prefix-cache-scorer") is not None


def test_without_own_placements_a_prefix_stays_cold_until_its_engine_reports_it() -> None:
    pool = [state(i) for i in range(1, 5)]
    mine, reports = scheduler(_doc(exact=True)), scheduler(_doc(exact=True, ownPlacements=False))
    (owner,) = _kept(mine, SYSTEMS[5], pool)
    other = next(s for s in pool if s.key != owner)
    for sched in (mine, reports):  # this EPP placed the prefix elsewhere (a load override)
        placed = ProfileResult("p", (other,))
        _prefix(sched).post_cycle(cycle(), request(prompt=SYSTEMS[5] + "q"), placed)
    # Its own index says `other` holds it: warm, the scorers decide.
    assert len(_kept(mine, SYSTEMS[5] + "q2", pool)) == 4
    # With reports only it is warm too while `other`'s feed has said nothing (not fresh) ...
    assert len(_kept(reports, SYSTEMS[5] + "q2", pool)) == 4
    # ... but once every engine's feed is fresh and none reported it, it is cold again: the
    # owner, as every other replica would choose.
    for s in pool:
        _exact(reports).heard(s.key, NOW)
    assert _kept(reports, SYSTEMS[5] + "q2", pool) == [owner]
    # The engine's report makes it warm in every replica.
    _report(reports, other.key, SYSTEMS[5], chars=32 * 64)
    assert len(_kept(reports, SYSTEMS[5] + "q2", pool)) == 4


def test_under_backlog_keeps_the_band_endpoints_under_the_tokens_or_all() -> None:
    from poolkeeper.scheduling.plugins.cold_placement import under_backlog

    band = {"a", "b", "c"}
    assert under_backlog(band, {"a": 4_000, "b": 2_047}, 2_048) == {"b", "c"}
    assert under_backlog(band, {"a": 4_000, "b": 2_048, "c": 9_000}, 2_048) == band
    assert under_backlog(band, {}, 2_048) == band


def test_backlog_scorer_moves_a_new_prefix_off_an_owner_busy_prefilling() -> None:
    """With `backlogScorer`, an owner with 2,048 or more prompt tokens sent there without a
    first byte back is out of the band while another endpoint is under (the hold's rule:
    flow control released the new prefix because some endpoint is); with none under, the
    ring decides as without it."""
    doc = _doc(backlogScorer="prefill-backlog-scorer")
    doc["plugins"].insert(2, {"type": "prefill-backlog-scorer"})
    refs = doc["schedulingProfiles"][0]["plugins"]
    refs.insert(2, {"pluginRef": "prefill-backlog-scorer", "weight": 0.001})
    sched = scheduler(doc)
    pool = [state(i) for i in range(1, 5)]
    (owner,) = _kept(sched, SYSTEMS[2], pool)
    backlog = _filter(sched).backlog  # the scorer it names
    assert isinstance(backlog, PrefillBacklogScorer)
    backlog.backlog.sent("long", owner, 3_000, NOW)
    (moved,) = _kept(sched, SYSTEMS[2], pool)
    assert moved != owner
    for i in range(1, 5):  # every endpoint busy: back to the owner
        backlog.backlog.sent(f"busy{i}", key(i), 3_000, NOW)
    assert _kept(sched, SYSTEMS[2], pool) == [owner]
    # Without the option the filter holds no backlog: the ring alone (tests above).
    assert _filter(scheduler(_doc())).backlog is None
    bad = _doc(backlogScorer="prefix-cache-scorer")
    with pytest.raises(ConfigError, match="is not a prefill-backlog-scorer"):
        scheduler(bad)


def test_backlog_tokens_without_a_backlog_scorer_is_refused() -> None:
    with pytest.raises(ValidationError, match="backlogTokens needs backlogScorer"):
        scheduler(_doc(backlogTokens=4096))


@pytest.mark.parametrize("weight", [None, 0])
def test_a_backlog_scorer_outside_the_profile_is_refused(weight: float | None) -> None:
    """The backlog fills in the scorer's PostCycle, which runs only where it scores: named
    but not in the profile, or there at weight 0, the option would do nothing."""
    doc = _doc(backlogScorer="prefill-backlog-scorer")
    doc["plugins"].insert(2, {"type": "prefill-backlog-scorer"})
    if weight is not None:
        ref = {"pluginRef": "prefill-backlog-scorer", "weight": weight}
        doc["schedulingProfiles"][0]["plugins"].insert(2, ref)
    with pytest.raises(ConfigError, match=r"backlogScorer 'prefill-backlog-scorer' must be a "
                       r"scorer with a non-zero weight in a profile"):  # fmt: skip
        scheduler(doc)


def _backlog_doc(**params: Any) -> dict[str, Any]:
    doc = _doc(backlogScorer="prefill-backlog-scorer", **params)
    doc["plugins"].insert(2, {"type": "prefill-backlog-scorer"})
    refs = doc["schedulingProfiles"][0]["plugins"]
    refs.insert(2, {"pluginRef": "prefill-backlog-scorer", "weight": 0.001})
    return doc


def test_scraped_waiting_moves_a_new_prefix_off_an_owner_with_a_queue_it_did_not_send() -> None:
    """With `scrapedWaiting`, an owner whose scrape shows a waiting request counts as busy
    prefilling although this EPP sent it nothing (another replica did); with every endpoint
    queued, the ring decides; without the option the queue is not read."""
    pool = [state(i) for i in range(1, 5)]
    plain, widened = scheduler(_backlog_doc()), scheduler(_backlog_doc(scrapedWaiting=True))
    (owner,) = _kept(widened, SYSTEMS[2], pool)
    queued = [state(i, waiting=1) if key(i) == owner else state(i) for i in range(1, 5)]
    assert _kept(plain, SYSTEMS[2], queued) == [owner]
    (moved,) = _kept(widened, SYSTEMS[2], queued)
    assert moved != owner
    assert _kept(widened, SYSTEMS[2], [state(i, waiting=1) for i in range(1, 5)]) == [owner]


def test_scraped_waiting_raises_the_hold_backlog_where_the_scrape_shows_a_queue() -> None:
    """Flow control's hold reads the same widened backlog (`PrefillFacts.backlogs`): an
    endpoint with a queue counts `backlogTokens`, a larger own backlog stays as it is."""
    from poolkeeper.scheduling.prefillfacts import PrefillFacts

    sched = scheduler(_backlog_doc(scrapedWaiting=True, backlogTokens=1_000))
    backlog = _filter(sched).backlog
    assert backlog is not None
    backlog.backlog.sent("mine", key(2), 3_000, NOW)
    pool = [state(1, waiting=2), state(2, waiting=1), state(3), state(4)]
    assert PrefillFacts(sched).backlogs(pool) == [1_000, 3_000, 0, 0]
    assert PrefillFacts(scheduler(_backlog_doc())).backlogs(pool) == [0, 0, 0, 0]
    # A failed scrape keeps its last values: its queue is not read (a dead endpoint whose
    # last good scrape showed one would otherwise count as busy until it came back).
    failed = replace(pool[0], metrics=replace(pool[0].metrics, error="connection refused"))
    assert PrefillFacts(sched).backlogs([failed, *pool[1:]]) == [0, 3_000, 0, 0]


def test_scraped_waiting_without_a_backlog_scorer_is_refused() -> None:
    with pytest.raises(ValidationError, match="scrapedWaiting needs backlogScorer"):
        scheduler(_doc(scrapedWaiting=True))
