"""The Virtual Token Counter: least-served flow first, weights, no banked credit, bounded."""

from __future__ import annotations

from poolkeeper.flowcontrol.vtc import VirtualTokenCounter


def _first(flows: list[str]) -> int:
    return 0


def test_the_least_served_flow_goes_first_and_output_costs_more() -> None:
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=2.0)
    vtc.charge_input("a", 100)
    vtc.charge_output("b", 60)  # 120 virtual tokens
    assert vtc.pick(["a", "b"], lambda f: 0) == "a"
    vtc.charge_input("a", 30)  # 130
    assert vtc.pick(["a", "b"], lambda f: 0) == "b"


def test_ties_go_to_the_earlier_head() -> None:
    vtc = VirtualTokenCounter()
    order = {"a": 7, "b": 3}
    assert vtc.pick(["a", "b"], order.__getitem__) == "b"


def test_weights_divide_the_charge() -> None:
    vtc = VirtualTokenCounter(weight=lambda f: 2.0 if f == "gold" else 1.0)
    vtc.charge_input("gold", 200)
    vtc.charge_input("plain", 100)
    assert vtc.counter("gold") == vtc.counter("plain") == 100


def test_an_idle_flow_cannot_bank_credit() -> None:
    """A flow that comes back is lifted to the least-served waiting flow, not left far below."""
    vtc = VirtualTokenCounter()
    vtc.activate("busy", [])
    vtc.charge_input("busy", 10_000)
    vtc.activate("idle", ["busy"])
    assert vtc.counter("idle") == vtc.counter("busy")
    # Nobody waiting: lifted to the last flow that stopped waiting.
    vtc.deactivate("busy", [])
    vtc.deactivate("idle", [])
    vtc.activate("new", [])
    assert vtc.counter("new") == 10_000


def test_a_flow_above_the_others_keeps_its_counter() -> None:
    vtc = VirtualTokenCounter()
    vtc.charge_input("heavy", 500)
    vtc.activate("heavy", ["light"])
    assert vtc.counter("heavy") == 500


def test_memory_is_bounded_by_live_flows() -> None:
    vtc = VirtualTokenCounter()
    for i in range(1000):
        flow = f"tenant-{i}"
        vtc.activate(flow, [])
        vtc.charge_input(flow, 1)
        vtc.deactivate(flow, [])
    assert len(vtc) <= 65
