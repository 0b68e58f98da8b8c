"""Reference policies of the virtual-time benchmarks: what more information would buy.

Not routers anyone could deploy as they are, and never counted as a baseline (`is_baseline`):
points of comparison that show how much of a p90 gap is reachable at all, and with what
knowledge. From least to most informed:

- `ref-pending-prefill`: only what a router observes itself. Per endpoint, the prompt tokens
  it sent that have not had their first token yet (the prefill still ahead of a new request
  there), then the requests it sent that are decoding. Picks the least pending prefill, then
  the fewest decoding, ties at random. No scraped metric at all.
- `ref-step-phase`: the same, plus the exact end of each server's current forward pass, read
  from the simulator's engine (a router could only estimate it, from the timing of each
  server's token stream). Score: time left in the current step + the next step's length from
  the engine's step-time model (overhead + prefill and decode tokens ahead).
- `ref-oracle`: for every server, a copy of its engine is handed the request and run to the
  request's first token (`EngineModel.first_token_if_submitted`); picks the earliest. Perfect
  information about the present, none about later arrivals (myopic, not a lower bound).
  Costly: eight engine copies per request at 8 servers, minutes per load point.

The two that read engines get the fleet through `bind` before the run (`simrun.replay`);
`ref-step-phase` turns off decode-step fusing there (same results, step by step, so that the
current step's end is the next event).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.engine import EngineModel
from poolkeeper.sim.virtual import VirtualFleet

REFERENCE_PREFIX = "ref-"


def is_reference(name: str) -> bool:
    return name.startswith(REFERENCE_PREFIX)


def is_ours(name: str) -> bool:
    return name.startswith("poolkeeper")


def is_baseline(name: str) -> bool:
    """A peer router's rule: what the acceptance targets compare against."""
    return not is_ours(name) and not is_reference(name)


class PendingPrefill:
    """`ref-pending-prefill` (see the module docstring)."""

    name = "ref-pending-prefill"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pending: dict[str, int] = {}  # endpoint -> prompt tokens before their first token
        self.decoding: dict[str, int] = {}  # endpoint -> requests past their first token
        self._where: dict[str, tuple[str, int, bool]] = {}  # request -> (endpoint, tokens, pending)

    def score(self, endpoint: str, now: float) -> tuple[float, ...]:
        del now
        return (self.pending.get(endpoint, 0), self.decoding.get(endpoint, 0))

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        scored = [(self.score(e.key, now), self.rng.random(), i) for i, e in enumerate(endpoints)]
        chosen = endpoints[min(scored)[2]]
        key, tokens = chosen.key, request.prompt_tokens
        self.pending[key] = self.pending.get(key, 0) + tokens
        self._where[request.request_id] = (key, tokens, True)
        return chosen

    def on_first_token(self, request_id: str, now: float) -> None:
        where = self._where.get(request_id)
        if where is None or not where[2]:
            return
        key, tokens, _ = where
        self.pending[key] -= tokens
        self.decoding[key] = self.decoding.get(key, 0) + 1
        self._where[request_id] = (key, tokens, False)

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        where = self._where.pop(request_id, None)
        if where is None:
            return
        key, tokens, pending = where
        if pending:
            self.pending[key] -= tokens
        else:
            self.decoding[key] -= 1


class StepPhase(PendingPrefill):
    """`ref-step-phase` (see the module docstring)."""

    name = "ref-step-phase"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.engines: dict[str, EngineModel] = {}

    def bind(self, fleet: VirtualFleet) -> None:
        for endpoint, engine in zip(fleet.endpoints, fleet.engines, strict=True):
            engine.max_fused_steps = 1  # the next event is then the end of the current step
            self.engines[endpoint.hostport] = engine

    def score(self, endpoint: str, now: float) -> tuple[float, ...]:
        engine = self.engines[endpoint]
        end = engine.next_event_time()
        left = 0.0 if end is None else max(0.0, end - now)
        c = engine.config
        ahead = c.step_overhead_s + c.prefill_token_s * self.pending.get(endpoint, 0)
        ahead += c.decode_token_s * self.decoding.get(endpoint, 0)
        return (left + ahead * c.time_scale,)


class Oracle:
    """`ref-oracle` (see the module docstring)."""

    name = "ref-oracle"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.engines: dict[str, EngineModel] = {}

    def bind(self, fleet: VirtualFleet) -> None:
        self.engines = {e.hostport: g for e, g in zip(fleet.endpoints, fleet.engines, strict=True)}

    def first_token(self, request: LLMRequest, endpoint: str, now: float) -> float:
        when = self.engines[endpoint].first_token_if_submitted(
            request.request_id, request.target_model, request.prompt, now,
            max_tokens=request.max_tokens, prompt_tokens=request.prompt_tokens,
        )  # fmt: skip
        return float("inf") if when is None else when

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        scored = [
            (self.first_token(request, e.key, now), self.rng.random(), i)
            for i, e in enumerate(endpoints)
        ]
        return endpoints[min(scored)[2]]

    def on_first_token(self, request_id: str, now: float) -> None:
        pass

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        pass


REFERENCE_POLICIES: dict[str, type[PendingPrefill] | type[Oracle]] = {
    PendingPrefill.name: PendingPrefill,
    StepPhase.name: StepPhase,
    Oracle.name: Oracle,
}
