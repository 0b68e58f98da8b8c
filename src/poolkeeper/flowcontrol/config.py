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
`shed`), or goes anyway (mode `send`, today's Critical behaviour).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final, Self

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel

from poolkeeper.api.criticality import Criticality
from poolkeeper.schema import CamelModel


class BandMode(StrEnum):
    SEND = "send"  # never held: dispatched at once whatever the load (today's Critical)
    QUEUE = "queue"  # wait in the EPP for headroom, bounded by the limits and the TTL
    SHED = "shed"  # no queue: 429 at once when no endpoint has headroom


class Dispatch(StrEnum):
    SLOT = "slot"  # only while the server can start it: a free batch slot (flowcontrol/slots.py)
    SATURATION = "saturation"  # while below the saturation limit: servers may queue it


class Placement(StrEnum):
    SCHEDULER = "scheduler"  # any candidate endpoint; the scheduler decides
    HEADROOM = "headroom"  # only endpoints below the band's saturation limit (fails open)


class BandConfig(CamelModel, use_attribute_docstrings=True):
    """One criticality band."""

    mode: BandMode = BandMode.QUEUE
    """`queue` (wait for headroom), `shed` (429 when there is none) or `send` (never held)."""
    saturation_limit: float = Field(default=1.0, gt=0)
    """Dispatch while some candidate endpoint's saturation is below this (1.0 = at the
    `spec.admission` thresholds: `queueDepthThreshold` waiting or `kvCacheUtilThreshold`)."""
    queue_depth_threshold: float | None = Field(default=None, gt=0)
    """This band's waiting-requests threshold in the saturation formula (null: the one of
    `spec.admission`, 5). Sheddable uses 1: a server with any request waiting (or sent since
    its last scrape) has no room for Sheddable work, while its KV cache may still fill."""
    kv_cache_util_threshold: float | None = Field(default=None, gt=0, le=1)
    """This band's KV-cache threshold in the saturation formula (null: `spec.admission`'s)."""
    max_requests: int = Field(default=1000, ge=1, le=1_000_000)
    """Most requests waiting in this band per pool. One more is refused with 429 queue_full,
    unless its flow has fewer waiting than the longest flow, whose newest request is then
    pushed out (429) instead: one busy model cannot lock the others out."""
    max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    """Most request-body bytes waiting in this band per pool; over it: 429 queue_full."""
    ttl_ms: int = Field(default=30_000, ge=1, le=3_600_000)
    """Longest wait in the queue; then 429 queue_timeout
    (`x-llm-d-request-dropped-reason: rejected-ttl-expired`, as llm-d-router)."""
    lifo_after_ms: int | None = Field(default=None, ge=1, le=3_600_000)
    """Adaptive LIFO: while a flow's oldest waiting request has waited longer than this, the
    flow's newest goes first, and a full band pushes out the oldest (null: first come first
    served always). In sustained overload a FIFO queue makes every request wait the whole
    queue, so every answer is late; newest-first serves those that can still be on time and
    lets the oldest run out at their TTL. Standard and Sheddable: 200 (docs/flowcontrol.md);
    with `onlyWhileGrowing`, only for a flow whose requests keep growing in number."""
    shortest_first: bool = False
    """Off by default (opt-in). While the overload rules apply to a flow (with
    `onlyWhileGrowing`: its requests keep growing in number, and any queue in its first
    second of growth), its waiting request with the fewest prompt tokens goes first instead
    of first come first served or, past `lifoAfterMs`, newest first (among equals that order
    still holds); the oldest is still the one pushed out of a full band. In virtual time it
    passed the default-switch rule (1.1x goodput +0.4 %), but it is not a default: prompt
    tokens count a prompt's text only (images and tools not), so within a flow a client can
    rank itself short; a long prompt waits until its TTL while shorter ones keep arriving;
    each dispatch scans the flow's queue (~85 us at 2,000 waiting). Live it was level (8
    batch slots: p99 0.55 s against 0.69). docs/notes/2026-12-07-size-aware-placement.md."""
    overload_ttl_ms: int | None = Field(default=None, ge=1, le=3_600_000)
    """Longest wait in sustained overload (null: `ttlMs` always). Once a flow (a model) has had
    requests waiting in this band without a break for `overloadAfterMs`, its requests queued
    from then on wait at most this long, then 429 queue_timeout (CoDel's rule, per flow as in
    FQ-CoDel; Facebook's servers pair it with adaptive LIFO). A light flow that drains between
    its requests keeps `ttlMs`. A queue that never empties adds waiting to every answer and no
    throughput: the servers are busy either way, so it only decides who is late. A burst still
    waits up to `overloadAfterMs`. Standard: 300 (docs/flowcontrol.md); with
    `onlyWhileGrowing`, only for a flow whose requests keep growing in number."""
    overload_after_ms: int = Field(default=3000, ge=1, le=3_600_000)
    """How long a flow must have had requests waiting in this band, without a moment empty, to
    count as in sustained overload (only read with `overloadTtlMs`)."""
    drain_within_ms: int | None = Field(default=None, ge=1, le=3_600_000)
    """Off by default (null). Set: while the pool's whole queue drains within this long at the
    measured drain rate (the fleet's service rate, `drainrate.DrainRate`), the overload rules
    give nothing away: adaptive LIFO serves a request aged `rescueAfterMs` to
    `rescueBeforeMs` before the newest (an aging bound), and the overload TTL refuses nothing
    (the plain `ttlMs` still does) until it has had to refuse once in the flow's busy period
    (the queue outgrew the bound); from then until the flow's queue empties it applies as
    without the option. Such a queue is a passing one the servers clear in time; refused or
    passed over, its requests are answered late or not at all (issue 38: goodput at 1.1x).
    Unknown rate (under a second of backlog measured): as without it. Measured, not a
    default: docs/notes/2026-12-07-flow-control-drain-bound.md."""
    rescue_after_ms: int = Field(default=1200, ge=0, le=3_600_000)
    """With `drainWithinMs`, while the queue drains within it: the age from which adaptive
    LIFO serves a passed-over request first (the oldest one younger than `rescueBeforeMs`)."""
    rescue_before_ms: int = Field(default=1800, ge=1, le=3_600_000)
    """With `drainWithinMs`: a request older than this is past rescuing (it would be late
    anyway), so it stays behind the newer ones and ends at its TTL or when the queue empties."""
    only_while_growing: bool = True
    """The overload rules (`lifoAfterMs`, `overloadTtlMs`) apply to a flow only while its
    requests in the system (waiting here and dispatched, not yet answered) grow in number,
    and the overload TTL from then until the flow's queue empties. A closed population of
    clients (each sends its next request on an answer: batch jobs, agent fleets) cannot grow:
    its queue is bounded by the clients and every request is served within `ttlMs`, so it is
    exempt (issue 35: the rules refused 58 % of such a model's requests and starved the
    oldest). Open-loop overload keeps growing and keeps them (docs/flowcontrol.md). False:
    the rules apply whenever their thresholds are passed."""
    dispatch: Dispatch = Dispatch.SLOT
    """`slot`: send a request to a server only while it can start it (a free batch slot,
    learned per server from the gauges and the EPP's in-flight count: `flowcontrol/slots.py`),
    so the contended queue stays in the EPP, where the fair order applies, whatever the
    servers' batch size; the saturation limit still applies on top. `saturation`: while some
    endpoint is below `saturationLimit`, so with few batch slots most of the waiting happens in
    the servers' own first-come-first-served queues (poolkeeper before issue 35)."""
    placement: Placement = Placement.SCHEDULER
    """Where a dispatched request may go: `scheduler` (any candidate; the scheduler's prefix
    and adapter affinity decide) or `headroom` (only the endpoints below `saturationLimit`,
    so the band's work never lands on a server past its limit). Sheddable uses `headroom`:
    it is meant to fill spare capacity only. For Standard, narrowing was measured to cost
    far more than it saves (shared-prefix chat at 0.5x capacity: p90 TTFT 2.28 s instead of
    0.12 s; docs/flowcontrol.md): it sends a request away from the server holding its prefix
    exactly when that server is busy, and the cold prefill elsewhere makes everyone busier."""

    avoid_prefill_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    """Place the band's requests on the candidate endpoints that were sent fewer than this
    many prompt tokens since their last scrape (the router's own `unseen_tokens`), while
    some are and some are not (null: no narrowing). A long prompt just sent to a server is
    likely still in its prefill step (about 45 us per token on an H100 with Llama-3.1-8B),
    and a request that arrives there waits for that step and shares the next: under a 3x
    Sheddable flood most of Critical's tail above its idle p99 was such waits behind long
    prompts (docs/flowcontrol.md). Critical and Standard: 256."""
    avoid_prefill_unless_cached: int | None = Field(default=None, ge=1, le=1_000_000)
    """Off by default (null). With `avoidPrefillTokens`: an endpoint just sent a long prompt
    stays a candidate when it caches at least this many more of the request's prompt tokens
    than every endpoint that was not (the scheduler's prefix index), so the narrowing never
    sends a request away from a cached prefix worth more than the wait; a request no endpoint
    caches is narrowed as without it. Set for Standard with `avoidPrefillTokens`, it moves
    Standard off the servers Critical's avoidance leaves it without breaking shared-prefix
    affinity (docs/notes/2026-12-07-standard-placement.md). Standard: 256."""
    avoid_prefill_slowdown: float | None = Field(default=None, ge=1.0, le=100.0)
    """Null: no speed check. With `avoidPrefillTokens`: an endpoint just sent a long prompt
    is avoided only while some endpoint that was not is at least as fast: its observed seconds
    per output token (the router's own, `EndpointState.seconds_per_output_token`) at most
    this many times the busy one's. Where none is, the busy endpoint stays a candidate: on a
    fleet of mixed speeds the fast servers are sent the most prompts, so they are the ones
    just sent one, and the plain narrowing moved requests to servers twice as slow
    (docs/notes/2026-12-07-standard-placement-speed.md). Nothing is narrowed while some
    endpoint has no observation yet, or on servers running LoRA adapters (a request there
    waits for an adapter slot, which the speeds do not show). The speed is send-to-finish
    time per output token, so it carries each endpoint's queueing and prompt mix too.
    Standard: 1."""

    avoid_prefill_min_clear: int | None = Field(default=None, ge=1, le=100_000)
    """Null: no minimum. With `avoidPrefillTokens`: narrow only while at least this many
    candidates were not just sent a long prompt (Standard: 8, so a band of 8 or fewer
    candidates is never narrowed). Narrowing a band to a few endpoints piles
    its requests onto them: on 8 servers, where at most 7 are clear, Standard's narrowing
    cost up to 7 % p90 TTFT on mixed speeds and 0.3-0.6 % goodput at 1.1x, while on 64 servers,
    where 16-64 are clear, it is what puts Standard under round-robin on mixed criticality
    (docs/notes/2026-12-07-standard-placement-speed.md)."""

    @property
    def lifo_after_s(self) -> float | None:
        return None if self.lifo_after_ms is None else self.lifo_after_ms / 1000.0

    def without_avoidance(self) -> BandConfig:
        """This band without its `avoidPrefill*` narrowing: for a new long prefix that
        `holdNewPrefixes` released with `placeUnderBacklog`, which goes where the backlog has
        room (`PrefixHold.room`). Why: the hold let it go because some endpoint is under its
        backlog limit, and that is often the one just sent a long prompt, which the avoidance
        would take away; the prefix then went to an endpoint far over (64 servers,
        shared-prefix 1.1x, seed 1: goodput 0.56 % lower;
        docs/notes/2026-12-07-place-under-backlog.md)."""
        if self.avoid_prefill_tokens is None:
            return self
        return self.model_copy(
            update={
                "avoid_prefill_tokens": None,
                "avoid_prefill_unless_cached": None,
                "avoid_prefill_slowdown": None,
                "avoid_prefill_min_clear": None,
            }
        )

    @model_validator(mode="after")
    def _avoidance(self) -> Self:
        if self.avoid_prefill_unless_cached is not None and self.avoid_prefill_tokens is None:
            raise ValueError(
                f"avoidPrefillUnlessCached ({self.avoid_prefill_unless_cached}) takes effect "
                "only with avoidPrefillTokens (unset for this band: it would be ignored)"
            )
        if self.avoid_prefill_slowdown is not None and self.avoid_prefill_tokens is None:
            raise ValueError(
                f"avoidPrefillSlowdown ({self.avoid_prefill_slowdown:g}) takes effect "
                "only with avoidPrefillTokens (unset for this band: it would be ignored)"
            )
        if self.avoid_prefill_min_clear is not None and self.avoid_prefill_tokens is None:
            raise ValueError(
                f"avoidPrefillMinClear ({self.avoid_prefill_min_clear}) takes effect "
                "only with avoidPrefillTokens (unset for this band: it would be ignored)"
            )
        return self

    @model_validator(mode="after")
    def _rescue_window(self) -> Self:
        fields = type(self).model_fields
        window = (self.rescue_after_ms, self.rescue_before_ms)
        defaults = (fields["rescue_after_ms"].default, fields["rescue_before_ms"].default)
        if window != defaults and self.drain_within_ms is None:
            raise ValueError(
                "rescueAfterMs and rescueBeforeMs take effect only with drainWithinMs (unset: "
                "they would be ignored)"
            )
        if self.rescue_after_ms >= self.rescue_before_ms:
            raise ValueError(
                f"rescueAfterMs ({self.rescue_after_ms}) must be below rescueBeforeMs "
                f"({self.rescue_before_ms})"
            )
        return self

    def deadline(self, now: float, busy_since: float) -> float:
        """When a request queued at `now` in this band times out, its flow having had requests
        waiting without a break since `busy_since` (<= now). It stays right while the request
        waits: the flow's queue cannot empty while it holds the request."""
        limit = now + self.ttl_ms / 1000.0
        if self.overload_ttl_ms is None:
            return limit
        calm_until = busy_since + self.overload_after_ms / 1000.0
        return min(limit, max(now + self.overload_ttl_ms / 1000.0, calm_until))


# Each band's own defaults, as a document. A band the user configures is validated from these
# with the user's keys on top, so `sheddable: {ttlMs: 3000}` keeps Sheddable's own
# `queueDepthThreshold: 1` instead of silently falling back to the generic band defaults.
BAND_DEFAULTS: Final[Mapping[str, Mapping[str, object]]] = MappingProxyType(
    {
        "critical": MappingProxyType(
            {"mode": "send", "saturationLimit": 2.0, "ttlMs": 60_000, "avoidPrefillTokens": 256}
        ),
        "standard": MappingProxyType(
            {
                "saturationLimit": 1.2,
                "maxRequests": 2000,
                "ttlMs": 30_000,
                "lifoAfterMs": 200,
                "overloadTtlMs": 300,
                # Away from a prompt just sent, as Critical, where 8 or more servers are
                # clear, not away from a cached prefix or to a slower server: on 64 servers
                # Critical's avoidance otherwise leaves Standard the busy ones (mixed
                # criticality: 1.02x / 1.06x round-robin's p90 at 0.9x / 1.1x).
                "avoidPrefillTokens": 256,
                "avoidPrefillUnlessCached": 256,
                "avoidPrefillSlowdown": 1.0,
                "avoidPrefillMinClear": 8,
            }
        ),
        "sheddable": MappingProxyType(
            {
                "queueDepthThreshold": 1,
                "lifoAfterMs": 200,
                "maxRequests": 1000,
                "ttlMs": 1_500,
                "placement": "headroom",
                # Its rule already sends only to a server with nothing waiting or sent since
                # the last scrape: no queue at the servers, so Critical requests start fast.
                "dispatch": "saturation",
                # Work meant to fill spare capacity: newest first whenever it is late (a
                # Sheddable population is not promised its share of a saturated pool).
                "onlyWhileGrowing": False,
            }
        ),
    }
)


# Keys that refine `avoidPrefillTokens` (each an error without it).
_AVOIDANCE_REFINEMENTS: Final = (
    "avoidPrefillUnlessCached",
    "avoidPrefillSlowdown",
    "avoidPrefillMinClear",
)


def _band(name: str) -> BandConfig:
    return BandConfig.model_validate(dict(BAND_DEFAULTS[name]))


class Bands(CamelModel, use_attribute_docstrings=True):
    """The three bands, by criticality. Keys set for a band override that band's defaults."""

    critical: BandConfig = Field(default_factory=lambda: _band("critical"))
    """Default `send`: Critical requests are never held nor shed, as before flow control,
    and go, where there is a choice, to a server not just sent a long prompt
    (`avoidPrefillTokens: 256`). With `queue` they wait ahead of every other band (and share
    fairly among themselves)."""
    standard: BandConfig = Field(default_factory=lambda: _band("standard"))
    """Default: queue while no endpoint can start the request (`dispatch: slot`) or is below
    1.2 (6 waiting requests); 30 s TTL; refused early when the queue ahead cannot drain within
    the TTL; for a flow whose requests keep growing (open-loop overload, `onlyWhileGrowing`),
    newest first after 200 ms and 300 ms once it has waited 3 s without a break; placed
    away from a server just sent a long prompt (`avoidPrefillTokens: 256`) while 8 or more
    are clear (`avoidPrefillMinClear`), unless that server caches 256 more of the prompt
    (`avoidPrefillUnlessCached`) or no clear one is as fast (`avoidPrefillSlowdown: 1`)."""
    sheddable: BandConfig = Field(default_factory=lambda: _band("sheddable"))
    """Default: queue while every endpoint has a request waiting (or sent since its last
    scrape) or KV at 80%: servers keep no queue of Sheddable work, so Critical requests sent
    to them start fast; 1.5 s TTL: answered quickly either way (docs/flowcontrol.md)."""

    @model_validator(mode="before")
    @classmethod
    def _over_band_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, defaults in BAND_DEFAULTS.items():
            given = data.get(name)
            if isinstance(given, dict):
                # Field names are accepted as well as aliases: name them as the defaults
                # do, so a user's `ttl_ms` replaces the default `ttlMs` instead of
                # standing beside it (and failing as a duplicate). Other keys pass as given.
                given = {to_camel(k) if isinstance(k, str) else k: v for k, v in given.items()}
                band = {**defaults, **given}
                if "avoidPrefillTokens" in given and given["avoidPrefillTokens"] is None:
                    # The avoidance off takes the refinements it defaults with along; one the
                    # user sets stays, and its error says it would be ignored.
                    for key in _AVOIDANCE_REFINEMENTS:
                        if key not in given:
                            band.pop(key, None)
                merged[name] = band
        return merged

    def of(self, criticality: Criticality) -> BandConfig:
        if criticality is Criticality.CRITICAL:
            return self.critical
        if criticality is Criticality.STANDARD:
            return self.standard
        return self.sheddable


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
