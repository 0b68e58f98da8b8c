"""FlowDispatcher with an injected clock: fast path, bands, fairness, bounds, TTL, cancel;
hypothesis properties: dispatch never inverts priority and never exceeds the bounds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings, strategies as st

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.band import PRESENT_S
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import BANDS, FlowItem, Submitted

C, S, X = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE


def _config(**bands: dict[str, Any]) -> FlowControlConfig:
    return FlowControlConfig.model_validate({"bands": bands})


def _item(name: str, band: Criticality = S, flow: str = "m", tokens: int = 10, size: int = 100):
    return FlowItem(name, band, flow, tokens, size)


def never(_item: FlowItem[str]) -> bool:
    return False


def always(_item: FlowItem[str]) -> bool:
    return True


def _budget(
    n: int,
) -> tuple[Callable[[FlowItem[str]], bool], Callable[[FlowItem[str]], None], list[str]]:
    sent: list[str] = []

    def fits(_item: FlowItem[str]) -> bool:
        return len(sent) < n

    def go(item: FlowItem[str]) -> None:
        sent.append(item.payload)

    return fits, go, sent


def test_fast_path_dispatches_at_once_when_nothing_waits_and_there_is_room() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    assert d.submit(_item("a"), 0.0, always) is Submitted.DISPATCH
    assert d.waiting() == 0


def test_no_room_queues_and_the_pump_dispatches_in_arrival_order() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    for name in "abc":
        assert d.submit(_item(name), 0.0, never) is Submitted.QUEUED
    # Room again: a newcomer must not overtake the waiting requests of its band.
    assert d.submit(_item("d"), 0.1, always) is Submitted.QUEUED
    fits, go, sent = _budget(2)
    assert d.pump(0.1, fits, go) == 2
    assert sent == ["a", "b"]
    assert d.waiting() == 2


def test_critical_is_sent_by_default_and_a_shed_band_refuses() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(_config(sheddable={"mode": "shed"}))
    assert d.submit(_item("c", C), 0.0, never) is Submitted.DISPATCH
    assert d.submit(_item("s", X), 0.0, never) is Submitted.SHED
    assert d.submit(_item("s2", X), 0.0, always) is Submitted.DISPATCH


def test_strict_priority_and_head_of_line_blocking() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(_config(critical={"mode": "queue"}))
    d.submit(_item("low", X), 0.0, never)
    d.submit(_item("std", S), 0.0, never)
    d.submit(_item("crit", C), 0.0, never)
    # Only Sheddable fits (e.g. different candidates): nothing may pass the blocked Critical.
    sent: list[str] = []
    assert d.pump(0.0, lambda i: i.band is X, lambda i: sent.append(i.payload)) == 0
    fits, go, sent = _budget(3)
    d.pump(0.1, fits, go)
    assert sent == ["crit", "std", "low"]


def test_fair_share_between_flows_by_tokens() -> None:
    """A heavy flow with many waiting requests and a light one: served alternately by tokens."""
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    for i in range(10):
        d.submit(_item(f"h{i}", flow="heavy", tokens=100), 0.0, never)
    for i in range(3):
        d.submit(_item(f"l{i}", flow="light", tokens=100), 0.0, never)
    fits, go, sent = _budget(6)
    d.pump(0.1, fits, go)
    assert sorted(sent) == ["h0", "h1", "h2", "l0", "l1", "l2"]
    # Output tokens count too (weight 2): a flow whose answers were long waits its turn.
    d.completed("heavy", S, 1000)
    fits, go, sent = _budget(2)
    d.pump(0.1, fits, go)
    assert sent == ["h3", "h4"]  # light has nothing left; heavy is alone


def test_weights_share_in_proportion() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig(model_weights={"gold": 3}))
    for i in range(20):
        d.submit(_item(f"g{i}", flow="gold"), 0.0, never)
        d.submit(_item(f"p{i}", flow="plain"), 0.0, never)
    fits, go, sent = _budget(12)
    d.pump(0.1, fits, go)
    gold = sum(1 for name in sent if name.startswith("g"))
    assert gold == 9  # 3:1


def test_bounds_refuse_with_full() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(_config(standard={"maxRequests": 2, "maxBytes": 1024}))
    assert d.submit(_item("a", size=500), 0.0, never) is Submitted.QUEUED
    assert d.submit(_item("b", size=600), 0.0, never) is Submitted.FULL  # bytes
    assert d.submit(_item("c", size=100), 0.0, never) is Submitted.QUEUED
    assert d.submit(_item("d", size=1), 0.0, never) is Submitted.FULL  # requests
    assert (d.waiting(S), d.waiting_bytes(S)) == (2, 600)


def test_ttl_expires_in_order_and_cancel_removes_at_once() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(_config(standard={"ttlMs": 1000}))
    a, b, c = _item("a"), _item("b", flow="other"), _item("c")
    d.submit(a, 0.0, never)
    d.submit(b, 0.5, never)
    d.submit(c, 0.9, never)
    assert d.cancel(b) is True
    assert d.cancel(b) is False
    assert d.expire(0.99) == []
    assert [i.payload for i in d.expire(1.0)] == ["a"]
    assert [i.payload for i in d.expire(5.0)] == ["c"]
    assert (d.waiting(), d.waiting_bytes(S)) == (0, 0)
    assert d.next_deadline() == float("inf")


# -- properties -------------------------------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(BANDS), st.sampled_from(["a", "b", "c"]),
              st.integers(1, 500), st.integers(1, 400), st.booleans()),
    # budget, and the bands that fit (candidates differ per request, e.g. subset hints)
    st.tuples(st.just("pump"), st.integers(0, 5), st.sets(st.sampled_from(BANDS))),
    st.tuples(st.just("tick"), st.floats(0.0, 2.0)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("done"), st.sampled_from(BANDS), st.sampled_from(["a", "b", "c"]),
              st.integers(0, 500)),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(_op, max_size=60),
    queue_critical=st.booleans(),
    lifo=st.booleans(),
    overload=st.booleans(),
)
@example(  # a lower band that fits while a higher one waits: it must not go first
    ops=[("submit", S, "a", 1, 1, False), ("submit", X, "a", 1, 1, False), ("pump", 3, {X})],
    queue_critical=False,
    lifo=False,
    overload=False,
)
def test_dispatch_never_inverts_priority_and_never_exceeds_bounds(
    ops: list[tuple[Any, ...]], queue_critical: bool, lifo: bool, overload: bool
) -> None:
    # With `lifo`, every band goes newest-first once a flow's oldest waited 0.5 s; with
    # `overload`, a band waiting without a break for 0.7 s gives newcomers a 0.2 s TTL.
    limits: dict[str, Any] = {
        "maxRequests": 4,
        "maxBytes": 1024,
        "ttlMs": 1000,
        "lifoAfterMs": 500 if lifo else None,
        "overloadTtlMs": 200 if overload else None,
        "overloadAfterMs": 700,
        "onlyWhileGrowing": False,
    }
    config = _config(
        critical={**limits, "mode": "queue" if queue_critical else "send"},
        standard=limits,
        sheddable=limits,
    )
    d: FlowDispatcher[str] = FlowDispatcher(config)
    now = 0.0
    items: list[FlowItem[str]] = []

    def check_go(item: FlowItem[str]) -> None:
        for band in BANDS:
            if band.rank > item.band.rank:
                assert d.waiting(band) == 0, "a lower band overtook a waiting higher one"
        rest = [i for i in d.items(item.band) if i.flow == item.flow]
        if any(i.seq < item.seq for i in rest):  # not the flow's oldest: only as adaptive LIFO
            assert lifo, "FCFS within a flow broken"
            assert all(i.seq < item.seq for i in rest), "neither the oldest nor the newest"
            assert now - min(i.arrived for i in rest) > 0.5, "LIFO before the flow was late"

    for op in ops:
        if op[0] == "submit":
            _, band, flow, tokens, size, room = op
            item = FlowItem(f"r{len(items)}", band, flow, tokens, size)
            items.append(item)
            above = any(d.waiting(b) for b in BANDS if b.rank >= band.rank)
            verdict = d.submit(item, now, always if room else never)
            if verdict is Submitted.QUEUED:  # never longer than the TTL, never below both limits
                assert item.deadline - now <= 1.0 + 1e-9
                assert item.deadline - now >= (0.2 if overload else 1.0) - 1e-9
            if verdict is Submitted.DISPATCH:
                assert config.bands.of(band).mode.value == "send" or (room and not above)
                d.dispatched(item)
        elif op[0] == "pump":
            budget, go, _sent = _budget(op[1])

            def fits(item: FlowItem[str], budget: Any = budget, bands: Any = op[2]) -> bool:
                return bool(budget(item)) and item.band in bands

            def checked(item: FlowItem[str], go: Callable[[FlowItem[str]], None] = go) -> None:
                check_go(item)
                go(item)

            d.pump(now, fits, checked)
        elif op[0] == "tick":
            now += op[1]
            for item in d.expire(now):
                assert item.deadline <= now
            for band in BANDS:  # nothing past its deadline is left behind (per-flow order)
                assert all(i.deadline > now for i in d.items(band))
        elif op[0] == "cancel" and items:
            d.cancel(items[op[1] % len(items)])
        elif op[0] == "done":
            d.completed(op[2], op[1], op[3])
        for band in BANDS:
            assert d.waiting(band) <= 4
            assert d.waiting_bytes(band) <= 1024
            assert d.waiting_bytes(band) == sum(i.size for i in d.items(band))
    # No starvation: everything waiting ends by its TTL.
    d.expire(now + 1.0)
    assert d.waiting() == 0


def test_a_full_band_pushes_out_the_longest_flow_not_the_light_one() -> None:
    """One busy flow must not fill the band and lock the others out."""
    d: FlowDispatcher[str] = FlowDispatcher(_config(standard={"maxRequests": 3}))
    for name in ("h0", "h1", "h2"):
        assert d.submit(_item(name, flow="heavy"), 0.0, never) is Submitted.QUEUED
    assert d.submit(_item("h3", flow="heavy"), 0.0, never) is Submitted.FULL
    assert d.submit(_item("l0", flow="light"), 0.0, never) is Submitted.QUEUED
    assert [i.payload for i in d.take_pushed_out()] == ["h2"]  # the newest of the longest
    assert d.take_pushed_out() == []
    assert (
        d.submit(_item("l1", flow="light"), 0.0, never) is Submitted.FULL
    )  # heavy 2, light 1: no longer
    assert sorted(i.payload for i in d.items(S)) == ["h0", "h1", "l0"]


def test_adaptive_lifo_serves_the_newest_once_the_oldest_is_late() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(
        _config(standard={"lifoAfterMs": 1000, "onlyWhileGrowing": False})
    )
    for t, name in enumerate("abcd"):
        d.submit(_item(name), 10.0 + t * 0.2, never)  # a at 10.0 ... d at 10.6
    head, late = d.head(S, now=10.9), d.head(S, now=11.1)
    assert head is not None
    assert head.payload == "a"
    assert late is not None
    assert late.payload == "d"  # what the pump would take at 11.1
    fits, go, sent = _budget(1)
    d.pump(10.9, fits, go)  # the oldest waited 0.9 s: still first come, first served
    assert sent == ["a"]
    fits, go, sent = _budget(2)
    d.pump(11.3, fits, go)  # b waited 1.1 s: the flow is late, the newest go first
    assert sent == ["d", "c"]
    fifo = FlowDispatcher[str](_config(standard={"lifoAfterMs": None}))
    for t, name in enumerate("abcd"):
        fifo.submit(_item(name), t * 0.2, never)
    fits, go, sent = _budget(2)
    fifo.pump(5.0, fits, go)
    assert sent == ["a", "b"]


def test_a_full_late_band_pushes_out_its_oldest_for_a_newcomer() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(
        _config(standard={"maxRequests": 2, "lifoAfterMs": 1000, "onlyWhileGrowing": False})
    )
    d.submit(_item("a"), 10.0, never)
    d.submit(_item("b"), 10.1, never)
    # Not late yet: a newcomer of the same flow is refused (longest-queue drop spares it).
    assert d.submit(_item("c"), 10.5, never) is Submitted.FULL
    # Late (a waited 1.2 s): the oldest cannot be on time any more; the newcomer can.
    assert d.submit(_item("e"), 11.2, never) is Submitted.QUEUED
    pushed = d.take_pushed_out()
    assert [i.payload for i in pushed] == ["a"]
    assert not pushed[0].queued
    assert sorted(i.payload for i in d.items(S)) == ["b", "e"]


def test_byte_bounds_and_the_longest_queue_drop_boundary() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(_config(standard={"maxBytes": 1024}))
    assert d.submit(_item("huge", size=2048), 0.0, never) is Submitted.FULL  # never fits
    whole = _item("whole", size=1024)
    assert d.submit(whole, 0.0, never) is Submitted.QUEUED  # exactly the band's bytes
    assert d.cancel(whole)
    assert d.submit(_item("a", size=512), 0.0, never) is Submitted.QUEUED
    assert d.submit(_item("b", size=512), 0.0, never) is Submitted.QUEUED  # exactly the limit
    assert d.waiting_bytes(S) == 1024
    # Another flow with nothing waiting pushes out the busy flow's newest only while the busy
    # flow is longer by two or more (its one-request lead is fair).
    assert d.submit(_item("x", flow="other", size=512), 0.1, never) is Submitted.QUEUED
    assert [i.payload for i in d.take_pushed_out()] == ["b"]
    assert d.submit(_item("y", flow="other", size=512), 0.2, never) is Submitted.FULL
    assert d.take_pushed_out() == []


def test_removal_from_the_middle_of_a_flow_removes_that_request_only() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    items = [_item(name) for name in "abcd"]
    for t, item in enumerate(items):
        d.submit(item, float(t), never)
    assert d.cancel(items[1])
    assert not d.cancel(items[1])  # not waiting any more
    assert [i.payload for i in d.items(S)] == ["a", "c", "d"]
    # a's: Standard's TTL (30 s; its overload TTL only for a flow that keeps growing).
    assert d.next_deadline() == pytest.approx(30.0)


def test_token_weights_and_completions_charge_the_flow() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(
        FlowControlConfig.model_validate({"inputTokenWeight": 3, "outputTokenWeight": 5})
    )
    item = _item("a", tokens=10)
    d.submit(item, 0.0, always)
    d.dispatched(item)
    assert d.counter(S, "m") == pytest.approx(30.0)
    d.completed("m", S, 4)
    assert d.counter(S, "m") == pytest.approx(50.0)


def test_a_standing_queue_gives_newcomers_the_short_overload_ttl() -> None:
    """CoDel's rule per flow: a burst may wait out `overloadAfterMs`; once a flow has been
    waiting without a break that long, each of its requests queued waits at most
    `overloadTtlMs`. Another flow that just started waiting keeps the long allowance."""
    d: FlowDispatcher[str] = FlowDispatcher(
        _config(
            standard={
                "ttlMs": 30_000,
                "overloadTtlMs": 300,
                "overloadAfterMs": 3000,
                "onlyWhileGrowing": False,
            }
        )
    )
    a, b, c = _item("a"), _item("b"), _item("c")
    light = _item("light", flow="light")
    d.submit(a, 10.0, never)  # the flow was not waiting: calm until 13.0
    d.submit(b, 12.9, never)
    d.submit(c, 20.0, never)  # the flow never emptied: a standing queue
    d.submit(light, 20.0, never)  # a flow that was not waiting: calm until 23.0
    assert [i.deadline for i in (a, b, c, light)] == pytest.approx([13.0, 13.2, 20.3, 23.0])
    assert d.next_deadline() == pytest.approx(13.0)
    assert [i.payload for i in d.expire(13.0)] == ["a"]
    assert [i.payload for i in d.expire(13.25)] == ["b"]
    assert [i.payload for i in d.expire(20.3)] == ["c"]
    late = _item("late")
    d.submit(late, 25.0, never)  # its flow emptied: a new burst gets the calm allowance
    assert late.deadline == pytest.approx(28.0)
    short = FlowDispatcher[str](_config(standard={"ttlMs": 1000, "overloadTtlMs": 300}))
    first = _item("first")
    short.submit(first, 0.0, never)
    assert first.deadline == pytest.approx(1.0)  # the band's TTL still bounds every wait
    plain = FlowDispatcher[str](_config(standard={"ttlMs": 5000, "overloadTtlMs": None}))
    for t in range(10):
        plain.submit(_item(f"p{t}"), float(t), never)
    assert plain.next_deadline() == pytest.approx(5.0)
    assert [i.deadline for i in plain.items(S)][-1] == pytest.approx(14.0)  # no overload rule


def test_a_request_is_refused_early_only_when_the_queue_ahead_cannot_drain_in_its_ttl() -> None:
    """Issue 35: the queue drains at 2 requests/s (measured while something waits); with a
    5 s TTL, a flow's 11th waiting request cannot be served in time and is refused at once,
    while another flow's newcomer, which fair sharing serves after at most one of the busy
    flow's requests, still queues. Before the rate is measured nothing is refused early."""
    d: FlowDispatcher[str] = FlowDispatcher(_config(standard={"ttlMs": 5000}))
    assert d.drain.rate() is None
    for n in range(40):
        assert d.submit(_item(f"h{n}", flow="heavy"), 0.0, never) is Submitted.QUEUED
    for step in range(1, 11):  # 10 s of backlog, one dispatch every 0.5 s
        fits, go, _sent = _budget(1)
        assert d.pump(step * 0.5, fits, go) == 1
    assert d.drain.rate() == pytest.approx(2.0)
    assert d.submit(_item("late", flow="heavy"), 5.0, never) is Submitted.SATURATED
    light = _item("light", flow="light")
    assert d.expected_wait(light) == pytest.approx(1.0)  # heavy's head, then light's own
    assert d.submit(light, 5.0, never) is Submitted.QUEUED
    # Idle time does not count: the rate is the fleet's, not the arrivals'.
    for item in d.items(S):
        d.cancel(item)
    assert d.submit(_item("again", flow="heavy"), 100.0, never) is Submitted.QUEUED
    fits, go, _sent = _budget(1)
    d.pump(100.5, fits, go)
    assert d.drain.rate() == pytest.approx(2.0, rel=0.1)


def test_a_slot_freed_by_an_under_served_flow_is_kept_for_it_a_moment() -> None:
    """A closed-loop client of a light flow sends its next request on its answer; the slot its
    answer freed is kept for it (`kept` tells `fits` to leave it) for HOLD_S, not taken by the
    heavy flow's waiting head. A flow that is not the next in fair order keeps nothing."""
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    d.submit(_item("h1", flow="heavy", tokens=1000), 0.0, never)
    d.dispatched(_item("h0", flow="heavy", tokens=1000))  # heavy has been served more
    d.completed("light", S, 10, now=1.0)
    heavy_head = d.head(S)
    assert heavy_head is not None
    assert d.kept(heavy_head, 1.0) == 1  # heavy's head must leave one slot
    one_slot = lambda item: d.kept(item, 1.0) < 1  # noqa: E731 (a fleet with one free slot)
    sent: list[str] = []
    assert d.pump(1.0, one_slot, lambda i: sent.append(i.payload)) == 0
    assert d.submit(_item("l1", flow="light"), 1.0, one_slot) is Submitted.DISPATCH
    assert d.kept(heavy_head, 1.0) == 0
    d.completed("light", S, 10, now=2.0)
    assert d.kept(heavy_head, 2.0 + 0.01) == 1
    assert d.kept(heavy_head, 2.0 + 1.0) == 0  # expired: the slot goes to the queue
    d.completed("heavy", S, 10, now=3.0)  # heavy has a request waiting: nothing kept
    assert d.kept(heavy_head, 3.0) == 0


def test_a_closed_loop_that_returns_late_keeps_its_slot_until_it_returns() -> None:
    """Issue 35, live: on a loaded machine a closed-loop client's round trip was 80 ms at the
    median and up to 0.9 s; the freed place is kept for the flow until it returns, at most
    HOLD_S (a place in a server's queue, never an idle batch slot: `Headroom.room`)."""
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    d.submit(_item("h1", flow="heavy", tokens=1000), 0.0, never)
    d.dispatched(_item("h0", flow="heavy", tokens=10_000))
    heavy_head = d.head(S)
    assert heavy_head is not None
    t = 1.0
    for n in range(8):  # the light client returns 5 ms after each answer
        d.completed("light", S, 10, now=t)
        assert d.submit(_item(f"l{n}", flow="light"), t + 0.005, always) is Submitted.DISPATCH
        t += 1.0
    d.completed("light", S, 10, now=t)
    assert d.kept(heavy_head, t + 0.2) == 1  # still kept after 0.2 s (HOLD_S is 0.05)
    assert d.submit(_item("late", flow="light"), t + 0.2, always) is Submitted.DISPATCH
    assert d.kept(heavy_head, t + 0.2) == 0


def test_a_flow_whose_last_request_just_ended_still_shares_the_band() -> None:
    """Issue 35, live: the light model's clients were all between an answer and their next
    request for a moment; the band must not look uncontended then (the saturation limit
    would send the busier model's whole queue into the servers' own queues at once)."""
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    d.submit(_item("h1", flow="heavy"), 0.0, never)
    d.dispatched(_item("l0", flow="light"))
    assert d.contended(S, 1.0)
    d.completed("light", S, 10, now=1.0)
    assert d.contended(S, 1.2)
    assert d.sharing(S, 1.2)
    assert d.contended(S, 1.0 + PRESENT_S)
    assert not d.contended(S, 1.1 + PRESENT_S)  # gone longer than a closed loop's round trip
    assert not d.contended(S)  # without a time: only what waits or runs counts


def test_a_flow_with_requests_in_service_keeps_its_counter_when_it_queues_again() -> None:
    """VTC lifts a flow that becomes backlogged again after being idle (no banked credit); a
    flow whose requests still run is not idle: lifted each time its queue emptied for a
    moment, a closed loop of few clients lost a request's worth of service each time."""
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    d.submit(_item("h1", flow="heavy"), 0.0, never)
    d.dispatched(_item("h0", flow="heavy", tokens=500))  # heavy: 500 served
    d.dispatched(_item("l0", flow="light", tokens=100))  # light: 100 served, still running
    d.submit(_item("l1", flow="light"), 1.0, never)
    assert d.counter(S, "light") == pytest.approx(100)  # not lifted to heavy's 500
    d.completed("light", S, 0)
    for item in d.items(S):
        if item.flow == "light":
            d.cancel(item)  # light idle now: nothing waiting, nothing running
    d.submit(_item("l2", flow="light"), 2.0, never)
    assert d.counter(S, "light") == pytest.approx(500)  # lifted: no banked credit
    # A flow whose last request ended a moment ago is on its way back: not lifted either.
    d.dispatched(_item("r0", flow="returning", tokens=100))
    d.completed("returning", S, 0, now=3.0)
    before = d.counter(S, "returning")
    assert before < d.counter(S, "heavy")
    d.submit(_item("r1", flow="returning"), 3.0 + PRESENT_S / 2, never)
    assert d.counter(S, "returning") == before


def _growth_case(only_while_growing: bool, clients: int | None) -> tuple[int, int]:
    """One Standard flow on a pool that dispatches 10 requests/s for 12 s: a closed population
    of `clients` (each sends again when its request is answered 2 s after dispatch) or, with
    `clients` None, an open loop of 15 arrivals/s. Returns (expired, dispatched)."""
    d: FlowDispatcher[str] = FlowDispatcher(
        _config(standard={"onlyWhileGrowing": only_while_growing})
    )
    expired = sent = 0
    answers: list[float] = []  # when dispatched requests are answered (closed loop)
    n = 0
    t = 0.0
    if clients is not None:
        for _ in range(clients):
            d.submit(_item(f"c{n}"), 0.0, never)
            n += 1
    while t < 12.0:
        t = round(t + 0.1, 1)
        if clients is None:
            for _ in range(3 if int(t * 10) % 2 else 1):  # 2 per 0.1 s on average: 20/s
                d.submit(_item(f"o{n}"), t, never)
                n += 1
        for at in [a for a in answers if a <= t]:  # an answer: the client sends again
            answers.remove(at)
            d.completed("m", S, 10)
            d.submit(_item(f"c{n}"), t, never)
            n += 1
        expired += len(d.expire(t))
        fits, go, got = _budget(1)
        d.pump(t, fits, go)
        for _name in got:
            sent += 1
            answers.append(t + 2.0)
            if clients is None:
                d.completed("m", S, 10)
    return expired, sent


def test_the_overload_rules_spare_a_closed_population_and_hold_an_open_loop() -> None:
    """Issue 35: a closed population's queue stands (40 clients, 10 served per second) but
    cannot grow, so its requests wait their 30 s TTL and none times out; an open loop past
    capacity keeps growing and gets Standard's 300 ms overload TTL, as before."""
    assert _growth_case(True, clients=40)[0] == 0
    assert _growth_case(False, clients=40)[0] > 0  # the rules as before issue 35
    expired, _sent = _growth_case(True, clients=None)
    assert expired > 50


def test_growth_marks_of_one_off_flows_are_bounded() -> None:
    """Each request under a new fairness id (client-chosen names) must not leave a growth
    mark behind for good: the table keeps live flows and those of the last two windows."""
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig())
    for i in range(5000):
        now = i * 0.01  # 100 new flows per second
        item = _item(f"r{i}", flow=f"tenant-{i}")
        assert d.submit(item, now, always) is Submitted.DISPATCH
        d.dispatched(item)
        d.completed(item.flow, S, 5, now)
    marks = d._bands[S].marks  # the table under test
    assert len(marks) <= 1024
    # A flow still running keeps its mark whatever its age.
    live = _item("live", flow="live")
    d.submit(live, 50.0, always)
    d.dispatched(live)
    for i in range(5000, 7000):
        d.submit(_item(f"r{i}", flow=f"tenant-{i}"), 100.0 + i * 0.01, always)
    assert "live" in d._bands[S].marks
    assert len(d._bands[S].marks) <= 1024 + 1
