"""The flow-control policy seams: a dispatcher built with other fairness and ordering
policies uses them, and the defaults are today's (VTC between flows, FCFS within a flow)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.bandconfig import BandConfig
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher, FlowPolicies
from poolkeeper.flowcontrol.fairness import FairnessPolicy
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.flowcontrol.ordering import A, FcfsAdaptiveLifo, OrderingPolicy
from poolkeeper.flowcontrol.vtc import VirtualTokenCounter

S = Criticality.STANDARD


class NewestFirst:
    def head(self, waiting: deque[A], now: float) -> A:
        return waiting[-1]

    def overdue(self, waiting: deque[A], now: float) -> A | None:
        return None


class Alphabetical:
    """Serves the alphabetically first waiting flow; records what it is told."""

    def __init__(self) -> None:
        self.charged: list[tuple[str, int]] = []

    def activate(self, flow: str, waiting: Iterable[str]) -> None: ...

    def deactivate(self, flow: str, waiting: Iterable[str]) -> None: ...

    def charge_input(self, flow: str, tokens: int) -> None:
        self.charged.append((flow, tokens))

    def charge_output(self, flow: str, tokens: int) -> None: ...

    def pick(self, flows: Iterable[str], tie: Callable[[str], int]) -> str | None:
        return min(flows, default=None)

    def counter(self, flow: str) -> float:
        return 0.0


def _never(_item: FlowItem[str]) -> bool:
    return False


def _queue(d: FlowDispatcher[str], *items: tuple[str, str]) -> None:
    for name, flow in items:
        d.submit(FlowItem(name, S, flow, 10, 100), 0.0, _never)


def _drain(d: FlowDispatcher[str]) -> list[str]:
    sent: list[str] = []
    d.pump(0.0, lambda _i: True, lambda i: sent.append(i.payload))
    return sent


def test_an_ordering_policy_given_to_the_dispatcher_orders_each_flow() -> None:
    def ordering(_band: BandConfig) -> OrderingPolicy:
        return NewestFirst()

    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig(), FlowPolicies(ordering=ordering))
    _queue(d, ("a", "m"), ("b", "m"), ("c", "m"))
    assert _drain(d) == ["c", "b", "a"]


def test_a_fairness_policy_given_to_the_dispatcher_picks_the_flow_and_is_charged() -> None:
    policies: list[Alphabetical] = []

    def fairness(_config: FlowControlConfig, _band: Criticality) -> FairnessPolicy:
        policies.append(Alphabetical())
        return policies[-1]

    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig(), FlowPolicies(fairness=fairness))
    _queue(d, ("z1", "zeta"), ("a1", "alpha"), ("z2", "zeta"), ("a2", "alpha"))
    assert _drain(d) == ["a1", "a2", "z1", "z2"]
    assert ("alpha", 10) in [c for p in policies for c in p.charged]


def test_the_default_policies_are_the_vtc_and_fcfs_with_adaptive_lifo() -> None:
    config = FlowControlConfig()
    policies = FlowPolicies()
    assert isinstance(policies.fairness(config, S), VirtualTokenCounter)
    assert isinstance(policies.ordering(config.bands.of(S)), FcfsAdaptiveLifo)
    d: FlowDispatcher[str] = FlowDispatcher(config)
    _queue(d, ("a", "m"), ("b", "m"), ("c", "m"))
    assert _drain(d) == ["a", "b", "c"]
