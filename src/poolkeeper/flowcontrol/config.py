"""`FlowControlConfig`: the flow-control section of a GatewayConfig (`spec.flowControl`).

    flowControl:
      enabled: true
      inputTokenWeight: 1            # VTC cost of one prompt token
      outputTokenWeight: 2.5         # VTC cost of one output token (the VTC paper's: 2)
      chargeAnswersAhead: true       # expected answer charged at dispatch, settled at the end
      modelWeights: {chat-a: 2}      # fair-share weight per client-facing modelName (default 1)
      bands:
        critical:  {mode: send}                                   # never held, never shed
        standard:  {mode: queue, saturationLimit: 1.2, ttlMs: 30000, maxRequests: 2000,
                    lifoAfterMs: 200, overloadTtlMs: 300, overloadAfterMs: 3000}
        sheddable: {mode: queue, queueDepthThreshold: 1, ttlMs: 1500, maxRequests: 1000,
                    lifoAfterMs: 200, placement: headroom, onlyWhileGrowing: false}

One band per criticality, served in strict priority. A band's head is dispatched while some
candidate endpoint's saturation (`datastore.load.saturations`, thresholds from
`spec.admission` unless the band sets its own) is below the band's `saturationLimit` and,
with `dispatch: slot` (the default), that endpoint can start it now (a free batch slot:
`flowcontrol/slots.py`); otherwise it waits (mode `queue`), is refused with 429 (mode
`shed`), or goes anyway (mode `send`, today's Critical behaviour). One band's settings:
`flowcontrol/bandconfig.py`; the bands and their defaults: `flowcontrol/bands.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import Field, model_validator

from poolkeeper.flowcontrol.bands import Bands
from poolkeeper.schema import CamelModel


class HoldNewPrefixes(CamelModel, use_attribute_docstrings=True):
    """`holdNewPrefixes`: hold a request that would open a new long prefill while every
    endpoint is prefill-backlogged (`flowcontrol/prefixhold.py`, docs/flowcontrol.md)."""

    backlog_tokens: int = Field(default=2048, ge=1, le=10_000_000)
    """Held only while every candidate endpoint has at least this many prompt tokens sent
    without a first byte back (the prefill backlog)."""
    min_prompt_tokens: int = Field(default=1024, ge=1, le=10_000_000)
    """Held only if the request's prompt tokens no endpoint caches (its prefill on the
    endpoint holding most of its prefix) are at least this many; a prompt whose whole prefix
    index window (16 KiB by default) some endpoint holds counts as cached."""
    max_hold_ms: int = Field(default=2000, ge=1, le=10_000)
    """Released to the queue after this long whatever the backlog (never starved; at most
    10 s, so what is held stays a few seconds of arrivals)."""
    place_under_backlog: bool = True
    """A request released from the hold that is still a new long prefix goes only to the
    candidate endpoints under `backlogTokens` (when some are and some are not): the room its
    release waited for. Without it the scheduler may place it on an endpoint far over (64
    servers, cold start: one server took 42 new prefixes in 2.4 s, each released because
    another was under). Requests never held are placed as without it. On by default since the
    64-server screen (docs/notes/2026-12-07-place-under-backlog.md). It overrides the prefix
    scorers' `coldAffinity` for those requests: EPP replicas that rely on `coldAffinity`
    rather than a `cold-placement-filter` lose its gain with it on (set false there)."""


class FlowControlConfig(CamelModel, use_attribute_docstrings=True):
    """Queueing, strict criticality bands and fair sharing (docs/flowcontrol.md)."""

    enabled: bool = True
    """Off: no queue; `spec.admission` sheds by pool saturation as before flow control."""
    input_token_weight: float = Field(default=1.0, ge=0)
    """Virtual-token cost of a prompt token (charged when the request is dispatched)."""
    output_token_weight: float = Field(default=2.5, ge=0)
    """Virtual-token cost of an output token (charged when the request completes, or ahead:
    `chargeAnswersAhead`): decoding costs more than prefill (the VTC paper, Sheng et al.,
    OSDI 2024, uses 2). The exchange rate between flows of short and of long answers:
    docs/flowcontrol.md, "Fair sharing on any fleet"."""
    charge_answers_ahead: bool = True
    """Charge a request's expected answer (its flow's recent answers) when it is dispatched
    and settle the difference when it ends (`flowcontrol/answers.py`); false: only at the
    end, which lets a flow of long answers look cheap while they run."""
    model_weights: dict[str, float] = Field(default_factory=dict)
    """Fair-share weight per flow (the modelName, or the `x-gateway-inference-fairness-id`
    value when `requestHandling.trustedHeaders` lists it); unlisted flows weigh 1. A flow
    of weight 2 gets twice the token throughput of a weight-1 flow while both wait."""
    bands: Bands = Field(default_factory=Bands)
    """Per-criticality settings."""
    hold_new_prefixes: HoldNewPrefixes | None = Field(default_factory=HoldNewPrefixes)
    """On by default (`{}`: the defaults below; `null` turns it off, and it is off with
    `enabled: false`; left at its default it steps aside where the longest queue TTL plus
    `maxHoldMs` would reach `edge.eppTimeoutS`, and the EPP logs that at start): a request of
    a `queue` band that would open a new long prefill waits in front of the queue while every
    endpoint has a prefill backlog, so requests whose prefix is placed go first
    (`flowcontrol/prefixhold.py`). The backlog is the `prefill-backlog-scorer`'s where the
    profile has one (the default profile has; streamed requests only, whose first bytes are
    seen), else the prompt tokens sent since the last scrape. Held requests:
    `poolkeeper_flow_control_held_requests`, `poolkeeper_flow_control_hold_duration_seconds`.
    Setting it with `enabled: false` is an error."""

    @model_validator(mode="before")
    @classmethod
    def _no_default_hold_without_queue(cls, data: Any) -> Any:
        # The hold's default applies only where there is a queue to hold in front of; one
        # the user set with `enabled: false` is still refused below.
        if (
            isinstance(data, Mapping)
            and data.get("enabled") is False
            and not {"holdNewPrefixes", "hold_new_prefixes"} & set(data)
        ):
            return {**data, "holdNewPrefixes": None}
        return data

    @model_validator(mode="after")
    def _weights(self) -> Self:
        bad = sorted(name for name, w in self.model_weights.items() if not w > 0)
        if bad:
            raise ValueError(f"modelWeights must be > 0 (got {', '.join(bad)})")
        if self.hold_new_prefixes is not None and not self.enabled:
            raise ValueError(
                "holdNewPrefixes needs flow control (enabled: true): it holds in the queue"
            )
        return self

    @property
    def asks_prefill_facts(self) -> bool:
        """Whether flow control reads the scheduler's prefix facts before dispatch
        (`scheduling/prefillfacts.py`): for `holdNewPrefixes`, or a band's
        `avoidPrefillUnlessCached`."""
        return self.enabled and (self.hold_new_prefixes is not None or self.prefix_aware)

    @property
    def prefix_aware(self) -> bool:
        """Some band sets `avoidPrefillUnlessCached` (it reads the request's prefix match)."""
        bands = (self.bands.critical, self.bands.standard, self.bands.sheddable)
        return any(b.avoid_prefill_unless_cached is not None for b in bands)

    def weight(self, flow: str) -> float:
        return self.model_weights.get(flow, 1.0)
