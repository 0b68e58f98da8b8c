"""Fairness between flows: which flow of a band is served next (a policy seam).

A flow is a modelName, or the operator-trusted `x-gateway-inference-fairness-id`. The
dispatcher keeps one `FairnessPolicy` per band of a pool and tells it what happens to the
band's flows: a flow starts having requests waiting after being idle, or stops having requests
waiting (`activate`, `deactivate`), a request of a flow is dispatched with its prompt tokens
(`charge_input`) and its expected answer, and ends with its output tokens less that advance
(`charge_output`); it asks which waiting flow goes next (`pick`). A new policy is a class
with these methods and a factory (`FairnessFactory`: the flow-control section and the
band), handed to the dispatcher in `FlowPolicies` (`dispatcher.py`); `dispatcher.py` itself
does not change. Policies are pure and synchronous, with no clock: the dispatcher calls them
in its own order, so the same policy runs in the EPP and in the virtual-time fleet.

Today's policy is the Virtual Token Counter (`vtc.py`, `VirtualTokenCounter`, built per band
by `vtc_fairness` from `inputTokenWeight`, `outputTokenWeight` and `modelWeights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.vtc import VirtualTokenCounter


class FairnessPolicy(Protocol):
    """Fair sharing between the flows of one band (see the module docstring)."""

    def activate(self, flow: str, waiting: Iterable[str]) -> None:
        """`flow` has a request waiting and had none before, waiting or in service (a flow
        whose queue empties while its requests still run is not idle; `waiting`: the flows
        that already had requests waiting; `flow` may be among them)."""
        ...

    def deactivate(self, flow: str, waiting: Iterable[str]) -> None:
        """`flow` has nothing waiting any more (`waiting`: the flows that still do)."""
        ...

    def charge_input(self, flow: str, tokens: int) -> None:
        """A request of `flow` was dispatched with `tokens` prompt tokens."""
        ...

    def charge_output(self, flow: str, tokens: int) -> None:
        """Output tokens of `flow`: its expected answer when a request is dispatched, and at
        the request's end what it generated less what was charged ahead for it (negative: a
        refund; `answers.py`)."""
        ...

    def pick(self, flows: Iterable[str], tie: Callable[[str], int]) -> str | None:
        """The waiting flow to serve next (None: `flows` is empty); `tie(flow)` is the arrival
        sequence number of its oldest waiting request, for a deterministic tie-break."""
        ...

    def counter(self, flow: str) -> float:
        """The service `flow` has received, in the policy's own units (introspection)."""
        ...


FairnessFactory = Callable[[FlowControlConfig, Criticality], FairnessPolicy]


def vtc_fairness(config: FlowControlConfig, band: Criticality) -> FairnessPolicy:
    """Today's policy: one Virtual Token Counter per band, weighted as the section says."""
    del band  # every band weighs tokens and flows alike
    return VirtualTokenCounter(
        weight=config.weight,
        input_weight=config.input_token_weight,
        output_weight=config.output_token_weight,
    )
