"""Reference policies of the virtual-time benchmarks: what more information would buy.

Not routers anyone could deploy as they are, and never counted as a baseline (`is_baseline`):
points of comparison that show how much of a p90 gap is reachable at all, and with what
knowledge. From least to most informed:

- `ref-pending-prefill`: only what a router observes itself. Per endpoint, the prompt tokens
  it sent that have not had their first token yet (the prefill still ahead of a new request
  there), then the requests it sent that are decoding. Picks the least pending prefill, then
  the fewest decoding, ties at random. No scraped metric at all.
- `ref-size-lanes`: size-interval task assignment (SITA) on `ref-pending-prefill`: prompts of
  `long_prompt_tokens` (384) or more go only to a long lane (the first quarter of the endpoints, at
  least one), shorter ones only to the rest, each by least pending prefill. Tests whether
  keeping long prefills away from short requests buys p90 (it does not: the p90 is the long
  prompts' own prefill; docs/notes/2026-12-07-size-aware-placement.md).
- `ref-first-byte-phase`: the phase of each server's step estimated from only the step ends a
  router already sees today, the first bytes and the ends of its own requests there (the
  first-byte report and the access log), nothing per token: steps are taken to follow back
  to back since the last one seen, the phase being the time since modulo the step length
  that `ref-observed-phase` (below) models. `kv_event_phase.py` adds the ends of the steps
  that publish KV events (`ref-kv-phase-*`).
- `ref-observed-phase-2ms`, `-5ms`, `-20ms`: `ref-observed-phase` (below) with its signal
  reaching the router 2, 5 or 20 ms late, as an asynchronous report would: every step end up
  to that horizon is known, none after it. The step after the last known end ends at its
  modelled length (or just after the horizon, if it overran); steps follow back to back
  after that.
- `ref-observed-phase`: `ref-step-phase` (below) with the end of the current step
  *estimated* from what a router in the response path could see: the end of each server's
  last step (the time of the last token it streamed) plus the length the step-time model
  gives for what the router has outstanding there (its pending prefill and decoding
  requests); a step running past its estimate counts as about to end. It still reads the
  engine's step-time coefficients (a real router would learn them) and treats every step as
  ending with a token (a step that only advances a chunked prefill streams none), so it is an
  upper bound on that signal, not a design.
- `ref-step-phase`: `ref-pending-prefill` plus the exact end of each server's current forward
  pass, read from the simulator's engine (a router could only estimate it, from the timing of
  each server's token stream). Score: time left in the current step + the next step's length
  from the engine's step-time model (overhead + prefill and decode tokens ahead).
- `ref-oracle`: for every server, a copy of its engine is handed the request and run to the
  request's first token (`EngineModel.first_token_if_submitted`); picks the earliest. Perfect
  information about the present, none about later arrivals (myopic, not a lower bound).
  Costly: eight engine copies per request at 8 servers, minutes per load point.

Those that read engines get the fleet through `bind` before the run (`simrun.replay`); all
but `ref-oracle` turn off decode-step fusing there (same results, step by step, so that the
current step's end is the next event and the last one's end is the last token).
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


class SizeLanes(PendingPrefill):
    """`ref-size-lanes` (see the module docstring)."""

    name = "ref-size-lanes"
    long_prompt_tokens = 384  # ~the 94th percentile of heavy-tail's ShareGPT-like prompts

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        lane = max(1, len(endpoints) // 4)
        if len(endpoints) > lane:
            long = request.prompt_tokens >= self.long_prompt_tokens
            endpoints = endpoints[:lane] if long else endpoints[lane:]
        return super().pick(request, endpoints, now)


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

    def next_step_s(self, endpoint: str) -> float:
        """The step-time model's length of the next step for what the router has there."""
        c = self.engines[endpoint].config
        step = c.step_overhead_s + c.prefill_token_s * self.pending.get(endpoint, 0)
        step += c.decode_token_s * self.decoding.get(endpoint, 0)
        return step * c.time_scale

    def score(self, endpoint: str, now: float) -> tuple[float, ...]:
        end = self.engines[endpoint].next_event_time()
        left = 0.0 if end is None else max(0.0, end - now)
        return (left + self.next_step_s(endpoint),)


class ObservedPhase(StepPhase):
    """`ref-observed-phase` (see the module docstring)."""

    name = "ref-observed-phase"

    def busy(self, endpoint: str) -> bool:
        """The router has work there, so a step is (probably) running."""
        return bool(self.pending.get(endpoint, 0) or self.decoding.get(endpoint, 0))

    def score(self, endpoint: str, now: float) -> tuple[float, ...]:
        step = self.next_step_s(endpoint)
        left = 0.0
        if self.busy(endpoint):
            left = max(0.0, self.engines[endpoint].last_step_end + step - now)
        return (left + step,)


class LateObservedPhase(ObservedPhase):
    """`ref-observed-phase-2ms`, `-5ms` and `-20ms` (see the module docstring)."""

    name = "ref-observed-phase-late"
    report_delay_s = 0.0

    def score(self, endpoint: str, now: float) -> tuple[float, ...]:
        step = self.next_step_s(endpoint)
        if not self.busy(endpoint):
            return (step,)
        horizon = now - self.report_delay_s  # every step end up to here is known
        known = self.engines[endpoint].step_end_before(horizon)
        if known == float("-inf"):
            return (step / 2 + step,)
        # The step after the last known end had not ended by the horizon (else it would be
        # known): it ends at its modelled length, or just after the horizon if it overran;
        # after that, steps follow back to back.
        end = max(known + step, horizon)
        if end < now:
            end += step * (1 + (now - end) // step)
        return (max(0.0, end - now) + step,)


class LateObservedPhase2ms(LateObservedPhase):
    name = "ref-observed-phase-2ms"
    report_delay_s = 0.002


class LateObservedPhase5ms(LateObservedPhase):
    name = "ref-observed-phase-5ms"
    report_delay_s = 0.005


class LateObservedPhase20ms(LateObservedPhase):
    name = "ref-observed-phase-20ms"
    report_delay_s = 0.020


class FirstBytePhase(ObservedPhase):
    """`ref-first-byte-phase` (see the module docstring)."""

    name = "ref-first-byte-phase"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.seen_step_end: dict[str, float] = {}  # endpoint -> last first byte or end seen there

    def _saw_step_end(self, request_id: str, now: float) -> None:
        where = self._where.get(request_id)
        if where is not None:
            key = where[0]
            self.seen_step_end[key] = max(self.seen_step_end.get(key, now), now)

    def on_first_token(self, request_id: str, now: float) -> None:
        self._saw_step_end(request_id, now)
        super().on_first_token(request_id, now)

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        self._saw_step_end(request_id, now)
        super().on_finish(request_id, server, now)

    def known_step_end(self, endpoint: str, now: float) -> float | None:
        del now
        return self.seen_step_end.get(endpoint)

    def score(self, endpoint: str, now: float) -> tuple[float, ...]:
        step = self.next_step_s(endpoint)
        left = 0.0
        if self.busy(endpoint):  # half a step left while no end is known there
            known = self.known_step_end(endpoint, now)
            left = step / 2 if known is None else step - max(0.0, now - known) % step
        return (left + step,)


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
    SizeLanes.name: SizeLanes,
    StepPhase.name: StepPhase,
    ObservedPhase.name: ObservedPhase,
    LateObservedPhase2ms.name: LateObservedPhase2ms,
    LateObservedPhase5ms.name: LateObservedPhase5ms,
    LateObservedPhase20ms.name: LateObservedPhase20ms,
    FirstBytePhase.name: FirstBytePhase,
    Oracle.name: Oracle,
}
