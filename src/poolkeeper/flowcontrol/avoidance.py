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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.config import BandConfig

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
    if adapter is not None:
        runs = any(adapter in s.metrics.active_adapters for s in states)
        if runs and not any(adapter in s.metrics.active_adapters for s in clear):
            # Only servers running the request's LoRA adapter were just sent a long prompt:
            # a prefill step is shorter than loading the adapter elsewhere, or than waiting
            # there for an adapter slot behind the batch (a slot-bound fleet).
            return states
    margin = band.avoid_prefill_unless_cached
    if margin is None or cached is None:
        return clear
    found = cached()
    best = max((found.get(s.endpoint.hostport, 0) for s in clear), default=0)
    return [
        s
        for s in states
        if s.unseen_tokens < limit or found.get(s.endpoint.hostport, 0) >= best + margin
    ]
