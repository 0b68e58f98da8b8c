"""The `poolkeeper` benchmark policy with flow control: the EPP's dispatcher on the virtual fleet.

`FlowPolicy` puts the pure `flowcontrol.FlowDispatcher` (the object the EPP's Director drives)
in front of a `SchedulerPolicy` (the real scheduler). An arrival is offered: it is dispatched
at once when its band and the bands above have nothing waiting and some endpoint has headroom
(`flowcontrol.Headroom`, admission's saturation signal); otherwise it is held, refused (429)
or, for a `send` band, sent anyway. The fleet then calls `release` after completions and at
every scrape tick: expired requests are rejected (503), and heads are scheduled one by one on
the fleet's live states, each counted before the next headroom check (late binding).

With `holdNewPrefixes` set (`flowcontrol.prefixhold`), an arrival that would open a new long
prefill while every endpoint is prefill-backlogged is held in front of the dispatcher (facts from
the scheduler: `scheduling.prefillfacts`) and offered to it at a later release, as the EPP would.

Per-request facts for the reports: `waited` (router queue time of dispatched requests) and
`ends` (request id -> outcome: dispatched / queue_full / saturated / shed / expired).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from poolkeeper.bench.policies.schedpolicy import SchedulerPolicy, scheduler_policy
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import QueueFull, RequestShed
from poolkeeper.flowcontrol.bandconfig import BandMode
from poolkeeper.flowcontrol.config import FlowControlConfig, HoldNewPrefixes
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import FlowItem, Submitted
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.flowcontrol.prefixhold import Held, PrefixHold
from poolkeeper.flowcontrol.saturation import SaturationDetector
from poolkeeper.scheduling.prefillfacts import PrefillFacts
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.virtual import VirtualFleet

SendFn = Callable[[str, EndpointState | None, str | None], None]

# Candidates that are another candidate's preset with flow control's `holdNewPrefixes` on
# (issue 38, seventh round's screen: 2,048 / 1,024 tokens).
HOLD_POLICIES: dict[str, HoldNewPrefixes] = {
    "poolkeeper-fade-early-hold": HoldNewPrefixes(),
}
# ... and those that stand for a configuration without it (the default before issue 38's
# switch), unless `--flow-control` sets it.
NO_HOLD_POLICIES: frozenset[str] = frozenset({"poolkeeper-classic"})


@dataclass(slots=True)
class _Held:
    request: LLMRequest


class FlowPolicy:
    """A SchedulerPolicy behind flow control (see the module docstring)."""

    def __init__(self, name: str, inner: SchedulerPolicy, config: FlowControlConfig) -> None:
        self.name = name
        self.inner = inner
        self.config = config
        self.headroom = Headroom(SaturationDetector())
        self.dispatcher: FlowDispatcher[_Held] = FlowDispatcher(config)
        self.waited: dict[str, float] = {}
        self.ends: dict[str, str] = {}
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.max_waiting = 0
        self._flows: dict[str, tuple[str, FlowItem[_Held]]] = {}
        self._states: Sequence[EndpointState] = ()
        self._now = 0.0
        self._pushed: list[str] = []  # pushed out of a full band, to reject at the next release
        hold = config.hold_new_prefixes
        self.hold: PrefixHold[LLMRequest] | None = None if hold is None else PrefixHold(hold)
        self.facts = PrefillFacts(inner.scheduler) if config.asks_prefill_facts else None
        self._held_for: dict[str, float] = {}  # request id -> seconds held before the queue

    def bind(self, fleet: VirtualFleet) -> None:
        self.inner.bind(fleet)

    def _fits(self, item: FlowItem[_Held]) -> bool:
        band = self.config.bands.of(item.band)
        keep = self.dispatcher.kept(item, self._now)
        contended = self.dispatcher.contended(item.band, self._now)
        sharing = not contended and self.dispatcher.sharing(item.band, self._now)
        room = self.headroom.room(
            self._states, band, self._now, item.payload.request.target_model, keep, contended,
            sharing,
        )  # fmt: skip
        return room is not None

    def offer(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState | None:
        """The endpoint, or None when the request is held; raises RequestShed to refuse it."""
        self._states, self._now = endpoints, now
        if self._holds(request, endpoints, now):
            assert self.hold is not None
            self.hold.hold(request, now)
            return None
        return self._submit(request, endpoints, now)

    def _holds(self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float) -> bool:
        """`holdNewPrefixes` holds `request` now: only a `queue` band's (a `send` band's goes at
        once, a `shed` band's gets its 429 at once, not after a hold)."""
        if self.hold is None or self.facts is None:
            return False
        if self.config.bands.of(request.criticality).mode is not BandMode.QUEUE:
            return False
        facts = self.facts
        return self.hold.holds(
            lambda: facts.uncached_tokens(request, now), facts.backlogs(endpoints, now)
        )

    def _submit(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState | None:
        item = FlowItem(
            _Held(request), request.criticality, request.model, request.prompt_tokens,
            len(request.prompt), bound=request.max_tokens or 0,
        )  # fmt: skip
        verdict = self.dispatcher.submit(item, now, self._fits)
        band = str(request.criticality)
        for victim in self.dispatcher.take_pushed_out():
            rid = victim.payload.request.request_id
            self._held_for.pop(rid, None)
            self._end(rid, band, "queue_full")
            self._pushed.append(rid)
        if verdict is Submitted.DISPATCH:
            self.dispatcher.dispatched(item)
            self._end(request.request_id, band, "dispatched")
            released = request.request_id in self._held_for
            self.waited[request.request_id] = self._held_for.pop(request.request_id, 0.0)
            return self._pick(item, endpoints, now, released)
        if verdict is Submitted.QUEUED:
            self.outcomes[(band, "queued")] += 1
            self.max_waiting = max(self.max_waiting, self.dispatcher.waiting())
            return None
        end = {Submitted.FULL: "queue_full", Submitted.SATURATED: "saturated"}.get(verdict, "shed")
        self._end(request.request_id, band, end)
        if verdict is Submitted.FULL:
            raise QueueFull(f"{band} queue full")
        if verdict is Submitted.SATURATED:
            raise RequestShed(f"{band}: the queue ahead cannot drain within the TTL")
        raise RequestShed(f"{band}: no endpoint has headroom")

    def release(self, endpoints: Sequence[EndpointState], now: float, send: SendFn) -> None:
        self._states, self._now = endpoints, now
        for rid in self._pushed:
            send(rid, None, "queue_full")
        self._pushed.clear()
        for item in self.dispatcher.expire(now):
            self._held_for.pop(item.payload.request.request_id, None)
            self._end(item.payload.request.request_id, str(item.band), "expired")
            send(item.payload.request.request_id, None, "expired")

        def go(item: FlowItem[_Held]) -> None:
            rid = item.payload.request.request_id
            self._end(rid, str(item.band), "dispatched")
            released = rid in self._held_for
            self.waited[rid] = now - item.arrived + self._held_for.pop(rid, 0.0)
            send(rid, self._pick(item, endpoints, now, released), None)  # updates `endpoints`

        self.dispatcher.pump(now, self._fits, go)
        if self.hold is not None and self.hold.waiting():
            self._release_held(endpoints, now, send)

    def _release_held(self, endpoints: Sequence[EndpointState], now: float, send: SendFn) -> None:
        """Offer the held requests the rule no longer holds (or held past the cap) to the
        dispatcher, in arrival order, each placed before the next is asked."""
        assert self.hold is not None

        def go(entry: Held[LLMRequest]) -> None:
            request = entry.payload
            rid = request.request_id
            self._held_for[rid] = now - entry.since
            self._states, self._now = endpoints, now
            try:
                chosen = self._submit(request, endpoints, now)
            except (QueueFull, RequestShed):
                self._held_for.pop(rid, None)
                send(rid, None, self.ends[rid])
                return
            for pushed in self._pushed:
                send(pushed, None, "queue_full")
            self._pushed.clear()
            if chosen is not None:
                send(rid, chosen, None)

        self.hold.release(now, lambda r: self._holds(r, endpoints, now), go)

    def _pick(
        self,
        item: FlowItem[_Held],
        endpoints: Sequence[EndpointState],
        now: float,
        released: bool = False,
    ) -> EndpointState:
        """The scheduler's pick among the endpoints flow control allows; `released`: the
        request comes from a `holdNewPrefixes` hold (`placeUnderBacklog` narrows only those)."""
        request = item.payload.request
        self._flows[request.request_id] = (request.model, item)
        band = self.config.bands.of(item.band)
        hold = self.hold
        placing = hold is not None and hold.config.place_under_backlog and released
        if placing:  # placed by the backlog's room below, not by the avoidance
            band = band.without_avoidance()
        facts = self.facts
        cached = None if facts is None else (lambda: facts.cached_tokens(request, now))
        if band.avoid_prefill_slowdown is not None and len(self.inner.speed):
            # The EPP's states carry the observed speed (the in-flight tracker's); here the
            # inner policy applies it at `pick`, after this narrowing: apply it first.
            endpoints = self.inner.speed.apply(endpoints)
        if band.mode is not BandMode.SEND:  # where the headroom is, as the Director does
            contended = self.dispatcher.contended(item.band, now)
            sharing = not contended and self.dispatcher.sharing(item.band, now)
            endpoints = self.headroom.within(
                endpoints, band, now, contended, request.target_model, sharing, cached
            )
        else:  # sent at once: only away from a prefill just sent (`avoidPrefillTokens`)
            endpoints = self.headroom.spread(endpoints, band, cached=cached)
        if hold is not None and placing and facts is not None:
            # `placeUnderBacklog`: a held new long prefix goes where its release found room.
            backlogs = facts.backlogs(endpoints, now)
            room = hold.room(lambda: facts.uncached_tokens(request, now), backlogs)
            if room is not None:
                endpoints = [endpoints[i] for i in room]
        return self.inner.pick(request, endpoints, now)

    def _end(self, request_id: str, band: str, outcome: str) -> None:
        self.ends[request_id] = outcome
        self.outcomes[(band, outcome)] += 1

    @property
    def observes_first_tokens(self) -> bool:
        return self.inner.observes_first_tokens

    @property
    def wakes_on_first_token(self) -> bool:
        """Whether the fleet releases after a first token too, as the EPP's Director wakes the
        pump on each first byte while `holdNewPrefixes` is on (a prefill ended: a held request
        may go); without it, held requests wait for a completion or the next scrape tick."""
        return self.hold is not None

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        chosen = self.offer(request, endpoints, now)
        if chosen is None:
            raise RuntimeError("FlowPolicy.pick cannot hold a request; use offer/release")
        return chosen

    def on_first_token(self, request_id: str, now: float) -> None:
        self.inner.on_first_token(request_id, now)

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        self.inner.on_finish(request_id, server, now)
        found = self._flows.pop(request_id, None)
        if found is not None:
            flow, item = found
            output = item.payload.request.max_tokens or 0  # the simulator serves max_tokens
            self.dispatcher.completed(flow, item.band, output, now)

    def summary(self) -> dict[str, object]:
        by_band: dict[str, dict[str, int]] = {}
        for (band, outcome), n in sorted(self.outcomes.items()):
            by_band.setdefault(band, {})[outcome] = n
        out: dict[str, object] = {"outcomes": by_band, "max_waiting": self.max_waiting,
                                  "left_waiting": self.dispatcher.waiting()}  # fmt: skip
        if self.hold is not None:
            out["held"] = self.hold.total
            out["held_capped"] = self.hold.capped
            out["left_held"] = self.hold.waiting()
        return out


def flow_policy(
    name: str,
    rng: random.Random,
    config: FlowControlConfig | None = None,
    document: dict[str, Any] | None = None,
) -> FlowPolicy | SchedulerPolicy:
    """`poolkeeper` (the default scheduling preset), `poolkeeper-ttft` (`predicted-ttft`),
    `poolkeeper-backlog` (`prefill-backlog`) or a candidate (`schedpolicy.CANDIDATE_PRESETS`)
    behind flow control with the given (default)
    `spec.flowControl`: admission's shedding is replaced by the bands, as in the EPP. With
    `enabled: false` the EPP has no bands and admission sheds instead; so does this policy
    (under the same name). `document`: a scheduling document to run instead of the preset's
    (a variant of it, e.g. with a `cold-placement-filter`)."""
    inner = scheduler_policy(f"{name}-shed", rng, document)
    config = config if config is not None else FlowControlConfig()
    hold = HOLD_POLICIES.get(name)
    if hold is not None and config.hold_new_prefixes is None:
        if not config.enabled:  # the policy's name promises a hold that would not run
            raise ValueError(f"{name} holds in flow control's queue: it needs enabled: true")
        config = config.model_copy(update={"hold_new_prefixes": hold})
    if name in NO_HOLD_POLICIES and "hold_new_prefixes" not in config.model_fields_set:
        config = config.model_copy(update={"hold_new_prefixes": None})
    if not config.enabled:
        inner.name = name
        return inner
    inner.admission = None
    return FlowPolicy(name, inner, config)
