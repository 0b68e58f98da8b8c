"""`holdNewPrefixes` in the EPP: the Director asks the scheduler's facts through `Job.prefill`
and `FlowGate` holds a request that would open a new long prefill while every endpoint is
prefill-backlogged; a first byte, an end or the cap releases it; a placed prefix goes at once;
only `queue` bands are held; a client gone while held leaves nothing behind. The real
Datastore, scheduler (the `prefill-backlog` preset: prefix index and backlog), in-flight
tracker and gate; the clock is the test's."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import NoReadyEndpoint, QueueFull
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.flowcontrol.saturation import SaturationDetector
from poolkeeper.requestcontrol.director import Director
from poolkeeper.requestcontrol.flowgate import FlowGate
from poolkeeper.requestcontrol.heldrequests import HOLD_ASKS_PER_PUMP
from poolkeeper.requestcontrol.ports import Job
from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.server.wiring import build_director
from tests.requestcontrol.test_rc_director import NOW, _chat, _model, _store
from tests.support.waiting import settled

STANDARD = Criticality.STANDARD
MODELS = (_model("std"), _model("chat", criticality="Critical"))
LONG = 2000  # words: 12,000 characters, 3,000 prompt tokens


def _text(word: str) -> str:
    return f"{word} " * LONG


class Observed:
    """The gate's metrics hook, recorded."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, float]] = []
        self.holds: list[tuple[str, float]] = []

    def flow_outcome(self, *, outcome: str, waited_s: float, **_: Any) -> None:
        self.outcomes.append((outcome, waited_s))

    def flow_held(self, *, pool: str, band: Criticality, outcome: str, held_s: float) -> None:
        assert band is STANDARD
        assert pool
        self.holds.append((outcome, held_s))


def _director(
    clock: list[float], hold: dict[str, Any] | None = None, **flow: Any
) -> tuple[Director, FlowGate, Observed]:
    store = _store(endpoints=[(1, "sim"), (2, "sim")], models=MODELS)
    spec = {
        "flowControl": {"holdNewPrefixes": hold or {}, **flow},
        "scheduling": {"preset": "prefill-backlog"},
        "scraping": {"stalenessMs": 60_000},  # moving the clock tests the hold, not staleness
    }
    observed = Observed()
    director = build_director(
        GatewayConfig.model_validate({"spec": spec}),
        store,
        rng=random.Random(1),
        clock=lambda: clock[0],
        flow_observer=observed,
    )
    assert director.flow is not None
    return director, director.flow, observed


def _one(events: list[tuple[str, float]]) -> tuple[str, float]:
    """The one event, its seconds rounded (the clock is the test's: sums of floats)."""
    ((what, seconds),) = events
    return what, round(seconds, 6)


async def _backlog_both(director: Director) -> tuple[RoutingDecision, RoutingDecision]:
    """Two new long prompts, one per endpoint: every endpoint has a 3,000-token backlog."""
    a = await director.route(_chat("std", rid="a", stream=True, text=_text("alpha")))
    b = await director.route(_chat("std", rid="b", stream=True, text=_text("bravo")))
    assert {a.endpoints[0], b.endpoints[0]} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    return a, b


async def test_a_new_prefix_waits_a_placed_one_goes_and_a_first_byte_releases_it() -> None:
    clock = [NOW]
    director, gate, observed = _director(clock)
    a, _b = await _backlog_both(director)
    held = asyncio.create_task(
        director.route(_chat("std", rid="c", stream=True, text=_text("charlie")))
    )
    await settled(lambda: gate.held() == 1)
    assert not held.done()
    assert gate.waiting() == 0  # held in front of the queue, not in it
    assert gate._timer is None  # no polling while only held requests wait
    assert gate._hold_timer is not None  # only the cap's timer

    # A request whose long prefix is placed (a's) is not held: it goes at once, past c.
    placed = await director.route(
        _chat("std", rid="d", stream=True, text=_text("alpha") + "and one more question")
    )
    assert placed.endpoints[0] == a.endpoints[0]
    assert not held.done()

    # a's first byte: its endpoint's backlog falls below 2,048 tokens, c asks again and goes.
    clock[0] += 0.3
    director.first_byte(a)
    decision = await asyncio.wait_for(held, timeout=5)
    assert decision.endpoints
    assert gate.held() == 0
    assert gate.totals[(STANDARD, "held")] == 1
    assert gate.totals[(STANDARD, "held_released")] == 1
    assert _one(observed.holds) == ("released", 0.3)
    # Its time held counts as its wait in flow control.
    assert _one(observed.outcomes[-1:]) == ("Dispatched", 0.3)


async def test_an_end_releases_it_too() -> None:
    """A request that ends without a first byte reported (not streamed) ends its backlog."""
    clock = [NOW]
    director, gate, _observed = _director(clock)
    _a, b = await _backlog_both(director)
    held = asyncio.create_task(director.route(_chat("std", rid="c", text=_text("charlie"))))
    await settled(lambda: gate.held() == 1)
    director.complete(b, status=200, usage=Usage(prompt_tokens=3000, completion_tokens=5))
    decision = await asyncio.wait_for(held, timeout=5)
    assert decision.endpoints[0] == b.endpoints[0]  # where the backlog fell
    assert gate.totals[(STANDARD, "held_released")] == 1


async def test_the_cap_releases_a_request_the_rule_still_holds() -> None:
    clock = [NOW]
    director, gate, observed = _director(clock, {"maxHoldMs": 1500})
    await _backlog_both(director)
    held = asyncio.create_task(director.route(_chat("std", rid="c", text=_text("charlie"))))
    await settled(lambda: gate.held() == 1)
    clock[0] += 1.4
    gate.pump()
    assert gate.held() == 1  # the rule still holds it, the cap is not reached
    clock[0] += 0.1
    gate.pump()  # what the cap's timer runs
    decision = await asyncio.wait_for(held, timeout=5)
    assert decision.endpoints
    assert gate.totals[(STANDARD, "held_capped")] == 1
    assert _one(observed.holds) == ("capped", 1.5)


async def test_a_held_request_refused_at_its_release_counts_a_flow_outcome() -> None:
    """Its pool lost every endpoint while it was held: released at its cap, it gets the
    scheduler's 503, and flow control records RejectedOther with its time held (it recorded
    only `held_capped`, no outcome, unlike a queued request)."""
    clock = [NOW]
    director, gate, observed = _director(clock, {"maxHoldMs": 1500})
    await _backlog_both(director)
    held = asyncio.create_task(director.route(_chat("std", rid="c", text=_text("charlie"))))
    await settled(lambda: gate.held() == 1)
    store = director._datastore
    assert isinstance(store, Datastore)
    store.set_endpoints([])
    clock[0] += 1.5
    gate.pump()  # what the cap's timer runs
    with pytest.raises(NoReadyEndpoint):
        await asyncio.wait_for(held, timeout=5)
    assert gate.held() == 0
    assert gate.totals[(STANDARD, "held_capped")] == 1
    assert gate.totals[(STANDARD, "RejectedOther")] == 1
    assert _one(observed.outcomes[2:]) == ("RejectedOther", 1.5)  # after a's and b's


async def test_a_client_gone_while_held_leaves_nothing_behind() -> None:
    clock = [NOW]
    director, gate, observed = _director(clock)
    await _backlog_both(director)
    held = asyncio.create_task(director.route(_chat("std", rid="c", text=_text("charlie"))))
    await settled(lambda: gate.held() == 1)
    clock[0] += 0.2
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert gate.held() == 0
    assert gate.waiting() == 0
    assert gate.totals[(STANDARD, "EvictedContextCancelled")] == 1
    assert _one(observed.holds) == ("cancelled", 0.2)
    gate.pump()  # nothing left to release
    assert gate.totals[(STANDARD, "Dispatched")] == 2  # a and b only
    # A synchronous caller cannot wait: a request that would be held is refused, not kept.
    with pytest.raises(QueueFull):
        director.route_now(_chat("std", rid="f", text=_text("foxtrot")))
    assert gate.held() == 0


async def test_only_queue_bands_are_held() -> None:
    clock = [NOW]
    director, gate, _observed = _director(clock)
    await _backlog_both(director)
    # Critical's band mode is `send`: it goes at once, new prefix or not.
    critical = await director.route(_chat("chat", rid="c", text=_text("charlie")))
    assert critical.endpoints
    assert gate.held() == 0
    assert gate.totals[(Criticality.CRITICAL, "held")] == 0


async def test_without_the_option_the_director_asks_nothing() -> None:
    store = _store(endpoints=[(1, "sim"), (2, "sim")], models=MODELS)
    spec = {"scheduling": {"preset": "prefill-backlog"}, "flowControl": {"holdNewPrefixes": None}}
    director = build_director(GatewayConfig.model_validate({"spec": spec}), store,
                              rng=random.Random(1), clock=lambda: NOW)  # fmt: skip
    gate = director.flow
    assert gate is not None
    jobs: list[Job] = []
    submit = gate.submit

    def spy(job: Job) -> RoutingDecision | FlowItem[Job]:
        jobs.append(job)
        return submit(job)

    gate.submit = spy  # type: ignore[method-assign]
    for rid, word in (("a", "alpha"), ("b", "bravo"), ("c", "charlie")):
        await director.route(_chat("std", rid=rid, text=_text(word)))
    assert [job.prefill for job in jobs] == [None, None, None]
    assert gate.held() == 0


# -- the seam alone: FlowGate with dataclass jobs, no Director ----------------------------------


def _job(rid: str, facts: list[tuple[int, list[int]]], sent: list[str]) -> Job:
    def run(_candidates: list[EndpointState] | None, _now: float | None) -> RoutingDecision:
        sent.append(rid)
        return RoutingDecision(request_id=rid, endpoints=("10.0.0.1:8000",), pool="p")

    return Job(
        rid, "p", "m", "m", STANDARD, "m", 3000, 100,
        states=list, run=run, abandon=lambda _d: None,
        prefill=lambda _states: facts[-1],
    )  # fmt: skip


def test_the_gate_holds_on_the_jobs_answer_and_releases_when_it_changes() -> None:
    config = FlowControlConfig.model_validate({"holdNewPrefixes": {"backlogTokens": 100}})
    clock = [0.0]
    gate = FlowGate(config, Headroom(SaturationDetector()), clock=lambda: clock[0])
    facts = [(3000, [500, 800])]  # every (here: no) candidate backlogged, a long new prefill
    sent: list[str] = []
    held = gate.submit(_job("x", facts, sent))
    assert isinstance(held, FlowItem)
    assert gate.held("p") == 1
    assert sent == []
    facts.append((3000, [0, 800]))  # one backlog drained
    gate.pump()
    assert sent == ["x"]  # dispatched (no endpoints: the empty pool fails open)
    assert gate.held() == 0
    facts.append((200, [500, 800]))  # a placed prefix: only 200 tokens uncached
    assert isinstance(gate.submit(_job("y", facts, sent)), RoutingDecision)


def test_held_requests_count_against_the_bands_bounds() -> None:
    """Held requests wait too: with `maxRequests` 2, a third new prefix is not held but goes to
    the dispatcher (here it dispatches it: an empty pool fails open), and a body over what
    `maxBytes` leaves is not held either. So a flood of new prefixes holds at most what the
    queue itself may hold."""
    config = FlowControlConfig.model_validate(
        {
            "holdNewPrefixes": {"backlogTokens": 100},
            "bands": {"standard": {"maxRequests": 2, "maxBytes": 8192}},
        }
    )
    gate = FlowGate(config, Headroom(SaturationDetector()), clock=lambda: 0.0)
    facts = [(3000, [500, 800])]
    sent: list[str] = []
    for rid in ("a", "b"):
        assert isinstance(gate.submit(_job(rid, facts, sent)), FlowItem)
    assert gate.held("p") == 2
    third = gate.submit(_job("c", facts, sent))  # no room to hold: the dispatcher decides
    assert isinstance(third, RoutingDecision)
    assert (gate.held("p"), sent) == (2, ["c"])
    gate = FlowGate(config, Headroom(SaturationDetector()), clock=lambda: 0.0)
    big = _job("d", facts, sent)
    big.size = 8192  # with nothing held, exactly the band's bytes: holdable
    assert isinstance(gate.submit(big), FlowItem)
    assert gate.held("p") == 1
    bigger = _job("e", facts, sent)
    bigger.size = 1  # the held 8,192 bytes leave no room for one more byte
    assert isinstance(gate.submit(bigger), RoutingDecision)
    assert (gate.held("p"), sent) == (1, ["c", "e"])


def test_a_pump_asks_a_bounded_number_of_held_requests() -> None:
    """With many held and the backlog unchanged, one pump asks the scheduler at most
    `HOLD_ASKS_PER_PUMP` questions (asking all 200 at every first byte, end and metrics write
    blocked the event loop); those asked stay held, the rest wait unasked (without
    `placeUnderBacklog`, whose placements count too: the next test)."""
    config = FlowControlConfig.model_validate(
        {"holdNewPrefixes": {"backlogTokens": 100, "placeUnderBacklog": False}}
    )
    gate = FlowGate(config, Headroom(SaturationDetector()), clock=lambda: 0.0)
    asks: list[str] = []
    sent: list[str] = []

    def job(rid: str) -> Job:
        j = _job(rid, [(3000, [500, 800])], sent)
        facts = j.prefill
        assert facts is not None

        def counted(states: list[EndpointState]) -> tuple[Callable[[], int] | int, list[int]]:
            asks.append(rid)
            return facts(states)

        j.prefill = counted
        return j

    for i in range(200):
        assert isinstance(gate.submit(job(f"r{i}")), FlowItem)
    asks.clear()
    gate.pump()
    assert asks == [f"r{i}" for i in range(HOLD_ASKS_PER_PUMP)]
    assert gate.held("p") == 200
    assert sent == []


def test_with_place_under_backlog_a_pumps_placements_count_against_its_asks() -> None:
    """`placeUnderBacklog`: each request a pump releases asks the facts once more when it is
    dispatched (its placement); those questions count, so one pump asks at most
    `HOLD_ASKS_PER_PUMP` in all (it asked twice that: the rule's and the placements')."""
    config = FlowControlConfig.model_validate(
        {"holdNewPrefixes": {"backlogTokens": 100, "placeUnderBacklog": True}}
    )
    gate = FlowGate(config, Headroom(SaturationDetector()), clock=lambda: 0.0)
    facts = [(3000, [500, 800])]  # every backlog over: held
    asks: list[str] = []
    sent: list[str] = []

    def job(rid: str) -> Job:
        j = _job(rid, facts, sent)

        def counted(_states: list[EndpointState]) -> tuple[Callable[[], int] | int, list[int]]:
            asks.append(rid)
            return facts[-1]

        j.prefill = counted
        return j

    for i in range(200):
        assert isinstance(gate.submit(job(f"r{i}")), FlowItem)
    asks.clear()
    facts.append((3000, [0, 800]))  # one endpoint under: the rule releases whoever it asks
    gate.pump()
    half = HOLD_ASKS_PER_PUMP // 2
    assert sent == [f"r{i}" for i in range(half)]
    assert asks == [f"r{i}" for i in range(half) for _ in range(2)]  # the rule's, the placement's
    assert gate.held("p") == 200 - half


async def test_the_held_question_and_the_scheduler_get_one_and_the_same_request() -> None:
    """The Director builds a request's LLMRequest once: what `holdNewPrefixes` asks the
    prefill facts about is the very object the scheduler then decides on."""
    clock = [NOW]
    director, _gate, _observed = _director(clock)
    facts = director._facts
    assert facts is not None
    asked: list[object] = []
    scheduled: list[object] = []

    class Facts:  # every backlog long (so the prefix match is asked), the prompt placed
        def uncached_tokens(self, request: Any, now: float) -> int:
            asked.append(request)
            return 0

        def backlogs(self, endpoints: Any, now: float | None = None) -> list[int]:
            return [10**9 for _ in endpoints]

        def cached_tokens(self, request: Any, now: float) -> dict[str, int]:
            return {}

    real = director.scheduler

    class Spy:
        def schedule(self, request: Any, candidates: Any, *, now: float) -> Any:
            scheduled.append(request)
            return real.schedule(request, candidates, now=now)

    director._facts = Facts()
    director._scheduler = Spy()
    await director.route(_chat("std", rid="a", stream=True, text=_text("alpha")))
    assert asked
    assert scheduled
    assert all(request is scheduled[0] for request in asked)


async def test_place_under_backlog_sends_a_released_prefix_only_where_the_backlog_is_under() -> (
    None
):
    """`placeUnderBacklog`: c, held while both endpoints were backlogged, is released by a's
    first byte and scheduled on a's endpoint alone (no other candidate); without the option
    the scheduler sees both endpoints. A new prefix that was never held (d, arriving while
    a's endpoint is under) is placed as without the option."""
    seen: dict[bool, list[str]] = {}
    unheld: dict[bool, list[str]] = {}
    under: dict[bool, str] = {}
    for on in (True, False):
        clock = [NOW]
        director, gate, _observed = _director(clock, {"placeUnderBacklog": on})
        a, _b = await _backlog_both(director)
        held = asyncio.create_task(
            director.route(_chat("std", rid="c", stream=True, text=_text("charlie")))
        )
        await settled(lambda gate=gate: gate.held() == 1)
        clock[0] += 0.3
        director.first_byte(a)
        c = await asyncio.wait_for(held, timeout=5)
        director.first_byte(c)
        d = await director.route(_chat("std", rid="d", stream=True, text=_text("delta")))
        seen[on], unheld[on], under[on] = list(c.endpoints), list(d.endpoints), a.endpoints[0]
    assert seen[True] == [under[True]]
    assert len(seen[False]) == 2
    assert len(unheld[True]) == len(unheld[False]) == 2
