"""One flow-control band's settings (`spec.flowControl.bands.<criticality>`): `BandConfig`.

What a band does with a request it cannot dispatch (`BandMode`: send, queue, shed), when it may
dispatch (`Dispatch`: a free batch slot, or below the saturation limit), where (`Placement`;
the `avoidPrefill*` narrowing), its bounds and TTL, newest-first once late (`lifoAfterMs`,
`onlyWhileGrowing`), the overload TTL and the drain bound. Each band's defaults and the three
bands together: `flowcontrol/bands.py`; the whole section: `flowcontrol/config.py`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from pydantic import Field, model_validator

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
