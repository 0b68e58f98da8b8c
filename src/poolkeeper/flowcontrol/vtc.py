"""The Virtual Token Counter of one band (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024): fair sharing of token throughput between flows.

Each flow (a modelName, or a fairness id) has a counter of the service it received: weighted
prompt tokens when a request is dispatched, weighted output tokens (the flow's expected answer
at dispatch, settled at the end: `answers.py`), divided by the flow's weight. The next request
comes from the backlogged flow with the smallest counter. A flow that becomes backlogged again
after being idle (nothing waiting and nothing in service: the dispatcher calls `activate` only
then) is lifted to the smallest counter of the flows already waiting (or, when none waits, to
the counter of the last flow that stopped waiting),
so an idle flow cannot bank credit and then starve the others.

Pure and synchronous; no clock. Memory is bounded by the flows that have requests waiting or
in flight plus those above the floor (a counter at or below the floor is forgotten: the lift
would restore it anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class VirtualTokenCounter:
    __slots__ = ("_counters", "_floor", "_weight", "input_weight", "output_weight")

    def __init__(
        self,
        *,
        weight: Callable[[str], float] = lambda _flow: 1.0,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
    ) -> None:
        self._weight = weight
        self.input_weight = input_weight
        self.output_weight = output_weight
        self._counters: dict[str, float] = {}
        self._floor = 0.0  # counter of the last flow that stopped waiting

    def counter(self, flow: str) -> float:
        return self._counters.get(flow, self._floor)

    def activate(self, flow: str, waiting: Iterable[str]) -> None:
        """`flow` has a request waiting again and none before: lift its counter."""
        lowest = min((self.counter(f) for f in waiting if f != flow), default=self._floor)
        self._counters[flow] = max(self.counter(flow), lowest)

    def deactivate(self, flow: str, waiting: Iterable[str]) -> None:
        """`flow` has nothing waiting any more (`waiting`: the flows that still do)."""
        self._floor = max(self._floor, self.counter(flow))
        if len(self._counters) > 64:  # cheap most of the time; bounded memory always
            keep = set(waiting)
            floor = self._floor
            for f in [f for f, c in self._counters.items() if c <= floor and f not in keep]:
                del self._counters[f]

    def charge_input(self, flow: str, tokens: int) -> None:
        self._charge(flow, tokens * self.input_weight)

    def charge_output(self, flow: str, tokens: int) -> None:
        self._charge(flow, tokens * self.output_weight)

    def pick(self, flows: Iterable[str], tie: Callable[[str], int]) -> str | None:
        """The flow to serve next: smallest counter, ties by `tie` (e.g. its head's arrival)."""
        best: str | None = None
        best_key = (0.0, 0)
        for flow in flows:
            key = (self.counter(flow), tie(flow))
            if best is None or key < best_key:
                best, best_key = flow, key
        return best

    def _charge(self, flow: str, cost: float) -> None:
        if cost:  # negative: a refund of an answer charged ahead (`answers.py`)
            self._counters[flow] = self.counter(flow) + cost / self._weight(flow)

    def __len__(self) -> int:
        return len(self._counters)
