"""The saturation filter's cost-of-a-miss gate: a prefix holder with a full batch stays while its
queue costs less than a miss elsewhere, and goes when it costs more; nothing is dropped from the
holder before both costs are measured."""

from __future__ import annotations

from typing import Any

import pytest

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult
from poolkeeper.scheduling.plugins.missgate import GatedSaturationFilter, MissCosts
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from tests.scheduling.sched_factories import NOW, key, request, scheduler, state

SYSTEM = "s" * 4096  # 64 blocks of 64 characters: a shared system prompt (1,024 tokens)
GATE = {
    "queueDepthThreshold": 1,
    "kvCacheUtilThreshold": 1.0,
    "headroom": 1,
    "maxNumSeqs": 8,
    "missGate": True,
    "prefixScorer": "prefix-cache-scorer",
}


def _doc(**params: Any) -> dict[str, Any]:
    return {
        "plugins": [
            {"type": "saturation-filter", "parameters": {**GATE, **params}},
            {"type": "prefix-cache-scorer"},
            {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 1}},
        ],
        "schedulingProfiles": [
            {
                "name": "p",
                "plugins": [
                    {"pluginRef": "saturation-filter"},
                    {"pluginRef": "prefix-cache-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


# pod1 holds SYSTEM and runs a full batch of 8 with 3 waiting; pod2 has free slots.
POOL = [state(1, running=8, waiting=3), state(2, running=2)]


def _gate(
    prefill_s_per_token: float | None, hold_s: float | None, **params: Any
) -> GatedSaturationFilter:
    """The gate of a scheduler whose index has pod1 holding SYSTEM, with the measured costs
    set through its own hooks (a 1,000-token miss on idle pod2; a request held by pod1)."""
    sched = scheduler(_doc(**params))
    prefix, gate = sched.plugins["prefix-cache-scorer"], sched.plugins["saturation-filter"]
    assert isinstance(prefix, PrefixCacheScorer)
    assert isinstance(gate, GatedSaturationFilter)
    at = CycleState(NOW - 10.0)
    prefix.post_cycle(at, request(prompt=SYSTEM), ProfileResult("p", (POOL[0],)))
    if prefill_s_per_token is not None:
        miss = request(prompt="m" * 4000, request_id="miss")  # 1,000 tokens, cached nowhere
        gate.post_cycle(at, miss, ProfileResult("p", (state(2),)))
        gate.observe_first_token("miss", None, at.now + 1000 * prefill_s_per_token)
    if hold_s is not None:
        gate.post_cycle(at, request(request_id="held"), ProfileResult("p", (POOL[0],)))
        gate.observe_first_token("held", None, NOW - 5.0)
        gate.costs.tick(NOW - 5.0 + hold_s - 0.01)
        gate.request_ended("held")
        gate.costs.tick(NOW - 5.0 + hold_s + 0.01)  # stamped halfway: hold_s after the first
    return gate


def _kept(gate: GatedSaturationFilter, pool: list[Any] = POOL) -> list[str]:
    return [s.key for s in gate.filter(CycleState(NOW), request(prompt=SYSTEM + "q" * 400), pool)]


# The request: SYSTEM plus a question, 1,124 tokens, none of them cached on pod2.


def test_a_holder_whose_queue_costs_more_than_a_miss_is_dropped() -> None:
    """8 slots held 1 s each: pod1's queue of 3 costs 4 x 1.0 / 8 = 0.5 s; the miss on pod2
    0.112 s of prefill (100 us a token), which its own first token waits and, as it stalls
    pod2's batch, 8 x 0.112 / 1.0 = 0.9 requests' service: 0.112 x 1.9 = 0.21 s."""
    gate = _gate(prefill_s_per_token=100e-6, hold_s=1.0)
    assert gate.costs.hold_s(key(1)) == pytest.approx(1.0)
    assert _kept(gate) == [key(2)]
    assert (gate.rescued, gate.moved) == (0, 1)


def test_a_holder_whose_queue_costs_less_than_a_miss_stays() -> None:
    # slots held 0.2 s: the queue costs 4 x 0.2 / 8 = 0.1 s; the miss 0.112 x (1 + 4.5)
    gate = _gate(prefill_s_per_token=100e-6, hold_s=0.2)
    assert _kept(gate) == [key(1), key(2)]
    assert (gate.rescued, gate.moved) == (1, 0)


def test_on_a_large_busy_batch_the_holder_keeps_a_long_queue() -> None:
    """256 slots held 5 s (overload in virtual time): a queue of 14 costs 15 x 5 / 256 =
    0.29 s, less than the miss: its stall takes 256 x 0.112 / 5 = 5.8 requests' service from
    pod2, whose free slots are few (0.112 x 6.8 = 0.76 s)."""
    gate = _gate(prefill_s_per_token=100e-6, hold_s=5.0, maxNumSeqs=256)
    pool = [state(1, running=256, waiting=14), state(2, running=230)]
    assert _kept(gate, pool) == [key(1), key(2)]


def test_the_alternatives_own_queue_counts_against_the_miss() -> None:
    gate = _gate(prefill_s_per_token=60e-6, hold_s=1.0)
    # pod2 full too, 1 waiting (below the limit, kept): 2 x 1.0 / 8 = 0.25 s of queue plus a
    # miss of 0.067 s that it, its queued request and 0.54 requests' service wait: 0.421 s in
    # all; pod1's queue of 3 costs 0.5 s plus its 100-token question's 0.006 s x 4.05 (goes),
    # a queue of 2 0.375 + 0.018 s (stays)
    busy = [state(1, running=8, waiting=3), state(2, running=8, waiting=1)]
    assert _kept(gate, busy) == [key(2)]
    busy = [state(1, running=8, waiting=2), state(2, running=8, waiting=1)]
    assert _kept(gate, busy) == [key(1), key(2)]


def test_before_either_cost_is_measured_the_holder_stays() -> None:
    assert _kept(_gate(prefill_s_per_token=None, hold_s=1.0)) == [key(1), key(2)]
    assert _kept(_gate(prefill_s_per_token=100e-6, hold_s=None)) == [key(1), key(2)]


def test_an_endpoint_that_does_not_hold_the_prompt_stays() -> None:
    """The gate drops prefix holders only (the pull it counters is the prefix scorer's):
    pod1 does not hold this prompt, and the load scorers weigh its queue like any other."""
    gate = _gate(prefill_s_per_token=100e-6, hold_s=1.0)
    other = [s.key for s in gate.filter(CycleState(NOW), request(prompt="x" * 4096), POOL)]
    assert other == [key(1), key(2)]
    assert (gate.rescued, gate.moved) == (1, 0)


def test_a_holder_stays_where_the_others_cost_more() -> None:
    """pod2 has free slots but 6 waiting (0.75 s at 8 slots held 1 s, and its queue waits for
    the miss too: 0.112 x (1 + 6 + 0.9)), pod1's full batch with 2 waiting 0.375 s: pod1
    stays. On a fleet whose batches all run nearly full (256 slots in overload) the filter
    otherwise dropped whichever one was confirmed full, often the one with the shorter queue."""
    gate = _gate(prefill_s_per_token=100e-6, hold_s=1.0)
    assert _kept(gate, [state(1, running=8, waiting=2), state(2, running=5, waiting=6)]) == [
        key(1),
        key(2),
    ]
    assert (gate.rescued, gate.moved) == (1, 0)


def test_a_queued_endpoint_goes_only_where_it_costs_more_than_every_kept_one() -> None:
    """Slots held 1 s: pod1 (the holder) costs 0.5 s, pod2's miss 0.21 s; pod3 is full with
    one waiting (kept: below the limit) and holds nothing: 2 x 1.0 / 8 + 0.112 x (1 + 1 +
    0.9) = 0.58 s. The scorers may pick pod3, dearer than pod1: pod1 stays."""
    gate = _gate(prefill_s_per_token=100e-6, hold_s=1.0)
    assert _kept(gate, [*POOL, state(3, running=8, waiting=1)]) == [key(1), key(2), key(3)]
    assert _kept(gate) == [key(2)]  # without pod3 it goes (first test)


def test_with_the_learned_batch_the_gate_prices_the_confirmed_full_batch() -> None:
    """`learnMaxNumSeqs` instead of `maxNumSeqs`: pod1's queue counts once two scrapes show 8
    running and a shorter queue, and the gate prices it at the learned 8 slots; pod2's miss
    at the 6 it was seen running. Slots held 1 s: pod1's queue of 3 costs 4 x 1.0 / 8 = 0.5 s,
    more than the miss on pod2 (0.112 x (1 + 6 x 0.112 / 1.0) = 0.19 s): the holder goes.
    Held 0.2 s: 0.1 s against 0.49 s: it stays."""
    learned = {"maxNumSeqs": None, "learnMaxNumSeqs": True}
    slow, fast = _gate(100e-6, hold_s=1.0, **learned), _gate(100e-6, hold_s=0.2, **learned)
    for gate in (slow, fast):
        # the next scrape's queue is longer: not confirmed full, the queue does not count
        at = NOW - 0.03
        pool = [state(1, running=8, waiting=5, updated_at=at), state(2, running=6, updated_at=at)]
        assert _kept(gate, pool) == [key(1), key(2)]
        assert gate.batches is not None
        assert gate.batches.most(key(1)) == 8
    at = NOW - 0.02
    pool = [state(1, running=8, waiting=3, updated_at=at), state(2, running=6, updated_at=at)]
    assert _kept(slow, pool) == [key(2)]
    assert _kept(fast, pool) == [key(1), key(2)]
    assert (slow.moved, fast.rescued) == (1, 1)


def test_costs_learn_only_from_clear_long_misses_and_close_ends() -> None:
    costs = MissCosts()
    costs.sent("short", "a", 0.0, uncached=100, clear=True)  # too short to time a prefill
    costs.sent("queued", "a", 0.0, uncached=2000, clear=False)  # waited behind a queue
    costs.first_token("short", 0.05)
    costs.first_token("queued", 1.0)
    assert costs.prefill_s("a") is None
    costs.sent("miss", "a", 0.0, uncached=2000, clear=True)
    costs.first_token("miss", 0.1)
    assert costs.prefill_s("a") == pytest.approx(50e-6)
    # per endpoint (a mixed fleet's slow server prefills slower), the pool's mean elsewhere
    costs.sent("slow-miss", "s", 0.0, uncached=2000, clear=True)
    costs.first_token("slow-miss", 0.4)
    assert costs.prefill_s("s") == pytest.approx(200e-6)
    assert costs.prefill_s("a") == pytest.approx(50e-6)
    assert costs.prefill_s("new") == pytest.approx(65e-6)
    # ends between decisions 2 s apart carry no time: no sample
    costs.ended("short")
    costs.tick(10.0)
    costs.tick(12.0)
    assert costs.hold_s("a") is None
    costs.ended("queued")
    costs.tick(12.1)  # stamped at 12.05, first byte at 1.0
    assert costs.hold_s("a") == pytest.approx(11.05)
    assert costs.hold_s("b") == pytest.approx(11.05)  # the pool's mean until b has its own
    costs.forget_endpoints({"b"})
    assert costs.hold_s("a") is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"prefixScorer": ""}, "missGate needs prefixScorer"),
        ({"maxNumSeqs": None}, "missGate needs maxNumSeqs or learnMaxNumSeqs"),
        ({"prefixScorer": "max-score-picker"}, "is not a prefix-cache-scorer"),
    ],
)
def test_the_gate_needs_a_batch_and_a_prefix_index(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        scheduler(_doc(**params))


def test_forgetting_an_endpoint_drops_its_measured_prefill_speed() -> None:
    """An endpoint that left the pool takes its own prefill speed along (a new endpoint at its
    address starts from the pool's), and its slot hold too; the kept endpoint keeps its own."""
    gate = _gate(prefill_s_per_token=100e-6, hold_s=1.0)  # pod2's miss; pod1's hold
    at = CycleState(NOW - 1.0)
    slow = request(prompt="s" * 4000, request_id="slow")  # 1,000 tokens on idle pod3
    gate.post_cycle(at, slow, ProfileResult("p", (state(3),)))
    gate.observe_first_token("slow", None, at.now + 1000 * 300e-6)
    pool = 0.9 * 100e-6 + 0.1 * 300e-6
    assert gate.costs.prefill_s(key(3)) == pytest.approx(300e-6)
    assert gate.costs.hold_s(key(1)) == pytest.approx(1.0)
    gate.forget_endpoints({key(2)})  # pod1 and pod3 left
    assert gate.costs.prefill_s(key(3)) == pytest.approx(pool)  # the pool's, no longer its own
    assert gate.costs.prefill_s(key(2)) == pytest.approx(100e-6)
    assert gate.costs.hold_s(key(1)) is None  # no hold measured anywhere now
