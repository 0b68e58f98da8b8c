"""Placement away from a prefill just sent: a band's `avoidPrefillTokens`, and its
prefix-aware form `avoidPrefillUnlessCached`.

`avoid_prefills` narrows a request's candidate endpoints to those sent fewer than
`avoidPrefillTokens` prompt tokens since their last scrape (the router's exact
`unseen_tokens`), unless that leaves none: a long prompt just sent there is likely still in its
prefill step, which a request arriving there waits for and then shares. Under a 3x Sheddable
flood (8 servers, 30 s, seeds 1-3) Critical's p99 TTFT went from 1.47 / 1.34 / 1.50x of idle to
1.20 / 1.15 / 1.22x with 256: most of its tail above the idle p99 was waits behind another
request's prefill of 1,000-4,000 tokens.

Applied as it is to a band whose requests share prefixes (Standard on shared-prefix chat), it
sends a request away from the server holding its prefix whenever that server was just sent a
prompt, which there is nearly always: 8 servers, 0.7x, p90 TTFT 0.63 s against 0.13 s. With
`avoidPrefillUnlessCached` (tokens), an endpoint just sent a long prompt stays a candidate
when it caches at least that many more of the request's prompt than the best endpoint that was
not: the cached prefix saves more prefill than the wait costs, and the scheduler's prefix
affinity decides among what is left. A request no endpoint caches (unique prompts: ShareGPT
chat, mixed criticality) is placed as with `avoidPrefillTokens` alone. The per-endpoint match
comes from the caller (`cached`: the scheduler's prefix index, `scheduling.prefillfacts`),
asked only when some candidates were just sent a long prompt and some were not.

With `avoidPrefillSlowdown` (a factor), an endpoint just sent a long prompt is avoided only in
favour of one about as fast: while some endpoint not just sent one has an observed seconds per
output token (the router's own) within that factor of the busy one's. On a fleet of mixed
speeds (8 servers at time scales 0.5 / 1 / 2) the fast servers are sent the most prompts, so
they are the ones just sent one: the plain narrowing moved Standard onto servers twice as slow
(0.7x, seed 1: 621 requests served on the slowest against 491, p90 TTFT 1.07x the default's).
On identical servers some clear server is nearly always as fast, so it narrows there as the
plain rule does. Where speeds cannot be compared (an endpoint not observed yet, servers
running LoRA adapters: a request there waits for an adapter slot, which speeds do not show)
nothing is narrowed. With `avoidPrefillMinClear`, nothing is narrowed while fewer candidates
than that are clear: narrowing to a few piles the band onto them (8 servers: at most 7 clear;
64 servers at 1.1x: 16-64, mostly over 40). Measured:
docs/notes/2026-12-07-standard-placement-speed.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.bandconfig import BandConfig

# ip:port -> the request's prompt tokens that endpoint (probably) caches; asked lazily.
CachedTokens = Callable[[], Mapping[str, int]]


def avoid_prefills(
    states: Sequence[EndpointState],
    band: BandConfig,
    adapter: str | None = None,
    cached: CachedTokens | None = None,
) -> Sequence[EndpointState]:
    """`states` narrowed by the band's `avoidPrefillTokens` (see the module docstring), in
    their order; `states` itself when nothing is narrowed. `adapter`: the request's target
    model (a LoRA adapter stays where it runs). `cached`: the request's prefix match per
    endpoint, read for `avoidPrefillUnlessCached` (None: no facts, avoided whatever is
    cached)."""
    limit = band.avoid_prefill_tokens
    if limit is None or len(states) < 2:
        return states
    clear = [s for s in states if s.unseen_tokens < limit]
    if not clear or len(clear) == len(states):
        return states
    if len(clear) < (band.avoid_prefill_min_clear or 0):
        return states  # too few to spread the band over (`avoidPrefillMinClear`)
    if adapter is not None:
        runs = any(adapter in s.metrics.active_adapters for s in states)
        if runs and not any(adapter in s.metrics.active_adapters for s in clear):
            # Only servers running the request's LoRA adapter were just sent a long prompt:
            # a prefill step is shorter than loading the adapter elsewhere, or than waiting
            # there for an adapter slot behind the batch (a slot-bound fleet).
            return states
    keep: set[str] = set()
    slowdown = band.avoid_prefill_slowdown
    if slowdown is not None:  # first: where it narrows nothing, the prefix match is not asked
        as_fast = as_fast_as_clear(states, limit, slowdown)
        if as_fast is None:
            return states
        keep.update(as_fast)
    margin = band.avoid_prefill_unless_cached
    if margin is not None and cached is not None:
        found = cached()
        best = max((found.get(s.endpoint.hostport, 0) for s in clear), default=0)
        keep.update(k for k, n in found.items() if n >= best + margin)
    if not keep:
        return clear
    return [s for s in states if s.unseen_tokens < limit or s.endpoint.hostport in keep]


def as_fast_as_clear(
    states: Sequence[EndpointState], limit: int, slowdown: float
) -> set[str] | None:
    """`avoidPrefillSlowdown` (module docstring): the endpoints just sent `limit` or more
    tokens that no endpoint not just sent is as fast as, within `slowdown` (observed seconds
    per output token at most `slowdown` x theirs): they stay. None where the speeds cannot be
    compared (the caller narrows nothing): some endpoint not observed yet, or some server
    running a LoRA adapter (a request there waits for an adapter slot, not a prefill)."""
    speeds: list[float] = []
    for s in states:
        speed = s.seconds_per_output_token
        if speed is None or speed <= 0.0 or s.metrics.active_adapters:
            return None
        speeds.append(speed)
    fastest_clear = min(v for s, v in zip(states, speeds, strict=True) if s.unseen_tokens < limit)
    return {
        s.endpoint.hostport
        for s, v in zip(states, speeds, strict=True)
        if s.unseen_tokens >= limit and fastest_clear > v * slowdown
    }
