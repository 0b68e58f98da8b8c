"""Headroom: when a band may send (some endpoint below its limit, per endpoint, stale ones never)
and where a dispatched request may go (the band's placement)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.flowcontrol.bandconfig import BandConfig
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.flowcontrol.saturation import SaturationDetector
from tests.scheduling.sched_factories import NOW, state

BANDS = FlowControlConfig().bands
STANDARD, SHEDDABLE = BANDS.standard, BANDS.sheddable  # limit 1.5 (queue 5); queue 1, limit 1


def _headroom(**admission: object) -> Headroom:
    return Headroom(SaturationDetector(AdmissionConfig.model_validate(admission)))


def test_one_endpoint_below_the_limit_is_enough_and_placement_decides_where() -> None:
    busy, idle = state(1, waiting=10), state(2, waiting=0)  # Standard saturation 2.0 and 0
    h = _headroom()
    assert h.fits([busy, idle], STANDARD, NOW)
    assert not h.fits([busy], STANDARD, NOW)
    # Standard (`dispatch: slot`): only where it can start; with `dispatch: saturation` the
    # scheduler chooses among all (it may pick the busy prefix holder).
    assert h.room([busy, idle], STANDARD, NOW) == [idle]
    assert h.within([busy, idle], STANDARD, NOW) == [idle]
    old = BandConfig.model_validate({"saturationLimit": 1.2, "dispatch": "saturation"})
    assert h.room([busy, idle], old, NOW) == [busy, idle]
    assert h.within([busy, idle], old, NOW) == [busy, idle]
    # Sheddable: only where its own limit leaves room.
    assert h.room([busy, idle], SHEDDABLE, NOW) == [idle]
    assert list(h.within([busy, idle], SHEDDABLE, NOW)) == [idle]
    assert h.room([busy], STANDARD, NOW) is None


def test_unseen_requests_count_and_a_band_may_set_its_own_thresholds() -> None:
    sent_to = state(1, waiting=0, unseen=1)  # a request sent since the scrape: not empty
    assert not _headroom().fits([sent_to], SHEDDABLE, NOW)
    assert _headroom(countUnseen=False).fits([sent_to], SHEDDABLE, NOW)
    full_kv = state(1, kv=0.9)
    assert not _headroom().fits([full_kv], SHEDDABLE, NOW)  # admission's KV 0.8
    roomy = BandConfig.model_validate({"queueDepthThreshold": 1, "kvCacheUtilThreshold": 1.0})
    assert _headroom().fits([full_kv], roomy, NOW)


@pytest.mark.parametrize(("policy", "expected"), [("admit", True), ("shed", False)])
def test_stale_endpoints_have_no_headroom_and_all_stale_follows_the_policy(
    policy: str, expected: bool
) -> None:
    stale = state(1, updated_at=NOW - 5.0)
    fresh_busy = state(2, waiting=10)
    h = _headroom(allStalePolicy=policy)
    assert not h.fits([stale, fresh_busy], STANDARD, NOW)  # one fresh endpoint knows: no room
    assert h.fits([stale], STANDARD, NOW) is expected
    assert (h.room([stale], STANDARD, NOW) == [stale]) is expected
    # A dispatched Sheddable request among stale-only endpoints goes anywhere (fails open).
    assert list(h.within([stale], SHEDDABLE, NOW)) == [stale]


def test_no_endpoints_means_go_so_the_scheduler_answers_503_at_once() -> None:
    h = _headroom()
    assert h.fits([], STANDARD, NOW)
    assert h.room([], STANDARD, NOW) == []


def test_an_endpoint_running_the_adapter_has_room_past_other_adapters_deferred_requests() -> None:
    # Ten requests wait on the endpoint, all for adapters without a slot (vLLM skips them);
    # lora-a runs there and none of its requests waits, so a lora-a request joins the batch.
    deferred = state(1, waiting=10, active=("lora-a",), queued_adapters=("lora-b", "lora-c"))
    h = _headroom()
    assert not h.fits([deferred], STANDARD, NOW)  # no adapter named: the queue counts
    assert h.fits([deferred], STANDARD, NOW, "lora-a")
    assert h.room([deferred], STANDARD, NOW, "lora-a") == [deferred]
    # Another adapter would wait for a slot behind them: no room for it.
    assert not h.fits([deferred], STANDARD, NOW, "lora-b")
    assert not h.fits([deferred], STANDARD, NOW, "lora-z")
    # lora-a requests already wait there: they are not deferred by slots, the queue counts.
    own_waiting = state(2, waiting=10, active=("lora-a",), queued_adapters=("lora-a",))
    assert not h.fits([own_waiting], STANDARD, NOW, "lora-a")
    # What this router sent since the scrape still counts, and so does KV.
    sent = state(3, waiting=10, active=("lora-a",), unseen=10)
    assert not h.fits([sent], STANDARD, NOW, "lora-a")
    full = state(4, waiting=10, active=("lora-a",), kv=0.99)
    assert not h.fits([full], STANDARD, NOW, "lora-a")


def test_slot_dispatch_leaves_placement_to_the_scheduler_while_a_server_defers() -> None:
    # A pool where some server's queue holds other adapters' deferred requests: slot dispatch
    # decides when, the scheduler places among every candidate (issue 35's multi-LoRA
    # regression: placing by free slots overrode its adapter affinity): a lora-a request has
    # room on the server running lora-a.
    deferred = state(1, waiting=10, active=("lora-a",), queued_adapters=("lora-b", "lora-c"))
    idle = state(2)
    h = _headroom()
    assert list(h.within([deferred, idle], STANDARD, NOW, adapter="lora-a")) == [deferred, idle]
    assert h.room([deferred, idle], STANDARD, NOW, "lora-a") == [deferred, idle]
    assert h.room([deferred], STANDARD, NOW, "lora-b") is None  # it would wait for a slot
    assert list(h.within([deferred, idle], STANDARD, NOW)) == [deferred, idle]


def test_slot_dispatch_sends_only_while_a_server_can_start_the_request() -> None:
    """Issue 35: a server that has shown a full batch (2 running, some waiting) has room for
    Standard only while the EPP's in-flight count there is below the 2 slots it learned plus
    a short server queue of one; `dispatch: saturation` keeps the old rule."""
    h = _headroom()
    # Not known full yet: at most as many again as the most seen running may wait there.
    assert h.fits([state(1, running=2, waiting=0, inflight=3)], STANDARD, NOW)
    assert not h.fits([state(1, running=2, waiting=0, inflight=4)], STANDARD, NOW)
    h.fits([state(1, running=2, waiting=3, inflight=5, updated_at=NOW - 0.2)], STANDARD, NOW)
    assert h.slots.slots(state(1)) is None  # one queued scrape: maybe just arrived
    h.fits([state(1, running=2, waiting=3, inflight=5, updated_at=NOW - 0.1)], STANDARD, NOW)
    assert h.slots.slots(state(1)) == 2  # queued again and no more running: a full batch
    assert not h.fits([state(1, running=2, waiting=3, inflight=5)], STANDARD, NOW)
    assert not h.fits([state(1, running=2, waiting=1, inflight=3)], STANDARD, NOW)
    # One request may wait at the server (the next freed slot starts it at once, and the
    # queue it shows keeps the full batch believed); a response that ended since the scrape
    # counts at once: the in-flight count is current, the gauges lag.
    assert h.fits([state(1, running=2, waiting=1, inflight=2)], STANDARD, NOW)
    assert not h.fits([state(1, running=2, waiting=0, inflight=3)], STANDARD, NOW)
    # The learned slots grow with what is seen running; another server is learned apart.
    h.fits([state(1, running=3, waiting=0, inflight=3, updated_at=NOW - 0.05)], STANDARD, NOW)
    assert h.slots.slots(state(1)) == 3
    assert h.fits([state(2, running=2, waiting=0, inflight=3)], STANDARD, NOW)  # never full
    old = BandConfig.model_validate({"saturationLimit": 1.2, "dispatch": "saturation"})
    assert h.fits([state(1, running=3, waiting=3, inflight=6)], old, NOW)  # 3/5 < 1.2
    # Placement among endpoints: only those that can start it count as having room.
    full, free = state(1, running=3, waiting=2, inflight=5), state(2, running=0, inflight=0)
    placed = BandConfig.model_validate({"saturationLimit": 1.2, "placement": "headroom"})
    assert h.room([full, free], placed, NOW) == [free]  # pod1 is known full: 3 slots, 5 sent
    # Before a full batch is seen: beyond the most seen running, half as many again or the
    # band's 6 (5 x 1.2), whichever is more (a large batch fills geometrically), exactly
    # counted (not per scrape), and fewer than 6 waiting as scraped (other senders).
    fresh = _headroom()
    assert fresh.fits([state(3, running=24, inflight=35, unseen=35)], STANDARD, NOW)
    assert not fresh.fits([state(3, running=24, inflight=36)], STANDARD, NOW)
    assert fresh.fits([state(5, running=6, inflight=11)], STANDARD, NOW)
    assert not fresh.fits([state(5, running=6, inflight=12)], STANDARD, NOW)
    assert not fresh.fits([state(4, running=1, waiting=6, inflight=0)], STANDARD, NOW)


def test_slot_dispatch_with_every_gauge_stale_trusts_the_learned_batches() -> None:
    """Issue 35, live: a scraper 200 ms late on a loaded machine made every endpoint stale,
    the band failed open and flooded the servers' own queues. A learned full batch and the
    EPP's exact in-flight count still judge; with nothing learned, `allStalePolicy` does."""
    h = _headroom()
    for age in (0.2, 0.1):  # two queued scrapes: pod1 holds 2
        h.fits([state(1, running=2, waiting=2, inflight=4, updated_at=NOW - age)], STANDARD, NOW)
    stale = NOW - 10.0
    busy = state(1, running=2, waiting=1, inflight=3, updated_at=stale)
    unknown = state(2, running=0, waiting=0, inflight=0, updated_at=stale)
    assert h.room([busy, unknown], STANDARD, NOW) is None
    freed = state(1, running=2, waiting=1, inflight=2, updated_at=stale)
    assert h.room([freed, unknown], STANDARD, NOW) == [freed]
    assert list(h.within([freed, unknown], STANDARD, NOW)) == [freed]
    # Nothing learned anywhere: fail open as before (admit), or hold (reject policy).
    assert _headroom().room([unknown], STANDARD, NOW) == [unknown]
    # Uncontended (`dispatch: slot` applies only while flows contend): the saturation
    # limit's allowance (6 waiting) beyond the batch, by the in-flight count (below).
    assert h.room([busy, unknown], STANDARD, NOW, contended=False) == [busy, unknown]


def test_an_uncontended_band_with_every_gauge_stale_fails_open_only_within_its_allowance() -> None:
    """Issue 35, live: before the light model's first request the band is uncontended and the
    saturation limit decides; with every gauge stale it failed open, and the busier model's
    first arrivals filled the servers' own queues up to 14 per 2-slot server (7 s to clear).
    Now the EPP's in-flight count bounds it: the batch (learned, or the most seen running)
    plus the allowance of 6 waiting requests; Sheddable (`dispatch: saturation`) and the
    `shed` policy are as before."""
    h = _headroom()
    for age in (0.2, 0.1):  # pod1 learned full at 2 slots
        h.fits([state(1, running=2, waiting=2, inflight=4, updated_at=NOW - age)], STANDARD, NOW)
    stale = NOW - 10.0

    def at(i: int, inflight: int) -> EndpointState:
        running = 2 if i == 1 else 0  # pod2 never seen running
        return state(i, running=running, waiting=1, inflight=inflight, updated_at=stale)

    full, roomy = at(1, 8), at(2, 5)  # pod1: 2 + 6 in flight; pod2: 0 + 5 < 6
    assert h.room([full, roomy], STANDARD, NOW, contended=False) == [roomy]
    assert list(h.within([full, roomy], STANDARD, NOW, contended=False)) == [roomy]
    assert h.room([full, at(2, 6)], STANDARD, NOW, contended=False) is None
    assert h.room([at(1, 7), at(2, 6)], STANDARD, NOW, contended=False) == [at(1, 7)]
    # Sheddable's saturation dispatch fails open as before; `shed` holds as before.
    assert h.room([full], SHEDDABLE, NOW) == [full]
    assert _headroom(allStalePolicy="shed").room([at(2, 0)], STANDARD, NOW) is None
    # A server whose queue holds adapter-deferred requests: the EPP's requests there for
    # adapters without a slot hold no batch slot (`slots.holding`): 25 for b leave room,
    # 30 for a do not (2 seen running plus the allowance of 6).
    lora = state(
        5, running=2, waiting=9, active=("a",), queued_adapters=("a", "b"), inflight=30,
        updated_at=stale,
    )  # fmt: skip
    deferring = replace(lora, inflight_models={"b": 25, "a": 5})
    assert h.room([full, deferring], STANDARD, NOW, contended=False) == [deferring]
    busy = replace(lora, inflight_models={"a": 30})
    assert h.room([full, busy], STANDARD, NOW, contended=False) is None
    # Before the first scrape anywhere (a new pool), admission's fail-open as before.
    never = state(4, inflight=50, updated_at=0.0)
    assert h.room([never], STANDARD, NOW, contended=False) == [never]
    # A fresh gauge anywhere: the saturation limit judges, the in-flight bound does not.
    fresh = state(3, running=2, waiting=0, inflight=9)
    assert h.room([full, fresh], STANDARD, NOW, contended=False) == [full, fresh]


def test_a_queue_of_deferred_adapter_requests_never_teaches_a_full_batch() -> None:
    """vLLM reports which adapters wait, not how many requests each: a queue that holds any
    adapter without a slot says nothing about the batch (a multi-LoRA server running 94 of
    256 looked full, and the EPP held its work)."""
    h = _headroom()
    for age in (0.2, 0.1):  # two scrapes with a mixed queue and no more running
        mixed = state(
            1, running=94, waiting=40, active=("lora-a",), queued_adapters=("lora-a", "lora-b"),
            inflight=134, updated_at=NOW - age,
        )  # fmt: skip
        h.room([mixed], STANDARD, NOW, "lora-a")
    assert h.slots.slots(state(1)) is None  # not a full batch at 94
    assert h.slots.deferring(mixed)


def test_flows_sharing_a_band_contend_where_the_servers_queue() -> None:
    """Issue 35: flows that share a band while nothing waits in the EPP (a closed population
    that fits the servers' own queues) contend there once a server shows a queue: slot
    dispatch applies. With no server queue, or one flow, the saturation limit decides."""
    h = _headroom()
    for age in (0.2, 0.1):
        h.fits([state(1, running=2, waiting=2, inflight=4, updated_at=NOW - age)], STANDARD, NOW)
    queued = state(1, running=2, waiting=2, inflight=4)
    assert h.queueing([queued])
    assert h.room([queued], STANDARD, NOW, contended=False) == [queued]  # one flow
    assert h.room([queued], STANDARD, NOW, contended=False, sharing=True) is None
    calm = state(2, running=1, waiting=0, inflight=1)
    assert not h.queueing([calm])
    assert h.room([calm], STANDARD, NOW, contended=False, sharing=True) == [calm]


def test_a_held_place_is_one_in_a_server_queue_never_an_idle_batch_slot() -> None:
    """The dispatcher's `kept` places (a freed place held for a returning closed-loop flow)
    block others only from the servers' short queues: a free batch slot is always used."""
    h = _headroom()
    for age in (0.2, 0.1):  # pod1 learned full at 2 slots (in flight at most 3)
        h.fits([state(1, running=2, waiting=1, inflight=3, updated_at=NOW - age)], STANDARD, NOW)
    queue_place = state(1, running=2, waiting=0, inflight=2)  # the queued one started
    assert h.room([queue_place], STANDARD, NOW, keep=1) is None  # the place is held
    assert h.room([queue_place], STANDARD, NOW, keep=0) == [queue_place]
    batch_slot = state(1, running=2, waiting=0, inflight=1)  # a batch slot is free
    assert h.room([batch_slot], STANDARD, NOW, keep=1) == [batch_slot]


def test_a_band_with_avoid_prefill_tokens_is_placed_away_from_a_long_prompt_just_sent() -> None:
    # Critical (`avoidPrefillTokens: 256`): a server sent 2,000 prompt tokens since its last
    # scrape is likely still prefilling them; a request sent there waits for that step.
    prefilling, quiet, short = state(1, unseen_tokens=2000), state(2), state(3, unseen_tokens=90)
    critical = BANDS.critical
    assert critical.avoid_prefill_tokens == 256
    h = _headroom()
    assert h.spread([prefilling, quiet, short], critical) == [quiet, short]
    assert h.spread([prefilling], critical) == [prefilling]  # never none
    assert h.spread([prefilling, state(4, unseen_tokens=300)], critical) == [
        prefilling, state(4, unseen_tokens=300)]  # fmt: skip
    # Standard has it only where 8 or more endpoints are clear (`avoidPrefillMinClear`),
    # Sheddable not at all; a queueing band set with it gets it in `room` and `within` too.
    assert (STANDARD.avoid_prefill_tokens, STANDARD.avoid_prefill_min_clear) == (256, 8)
    assert h.room([prefilling, quiet], STANDARD, NOW) == [prefilling, quiet]
    avoiding = BandConfig.model_validate({"dispatch": "saturation", "avoidPrefillTokens": 256})
    assert h.room([prefilling, quiet], avoiding, NOW) == [quiet]
    assert h.within([prefilling, quiet], avoiding, NOW) == [quiet]


def test_avoid_prefill_tokens_never_moves_a_lora_request_off_every_server_running_its_adapter() -> (
    None
):
    # One adapter slot per server, each running another adapter: a Critical request for
    # lora-c belongs on the one server running it even just after a long prompt went there;
    # elsewhere it would wait for an adapter slot behind that server's whole batch.
    holder = state(1, active=("lora-c",), max_adapters=1, unseen_tokens=2000)
    others = [
        state(2, active=("lora-a",), max_adapters=1),
        state(3, active=("lora-b",), max_adapters=1),
    ]
    critical = BANDS.critical
    h = _headroom()
    assert h.spread([holder, *others], critical, "lora-c") == [holder, *others]
    # With another holder clear of a prefill, the narrowing keeps that one.
    clear_holder = state(4, active=("lora-c",), max_adapters=1)
    assert h.spread([holder, clear_holder, *others], critical, "lora-c") == [clear_holder, *others]
    # A base-model request (no server runs it as an adapter) is narrowed as before.
    assert h.spread([holder, *others], critical, "base") == others
    assert h.within([holder, *others], critical, NOW, adapter="lora-c") == [holder, *others]
