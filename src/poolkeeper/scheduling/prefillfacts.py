"""`PrefillFacts`: what flow control's `holdNewPrefixes` (and a band's
`avoidPrefillUnlessCached`: `cached_tokens`, the prefix scorer's match per endpoint) asks the
scheduler before dispatch.

Two facts for the hold, each read from its one home in the scheduler's plugins (nothing
recomputed here):

- `uncached_tokens(request, now)`: the request's prompt tokens less the longest prefix some
  endpoint (probably) caches, from the prefix-cache scorer's index (`PrefixCacheScorer.matched`,
  the match the scorers use; none configured: nothing is cached). A prompt longer than the
  index's window (`maxPrefixBlocks` x `blockSize` characters, 16 KiB by default) whose whole
  window some endpoint holds counts as placed (0): the index cannot see past the window, and
  such a request shares at least 4,096 tokens with a placed one (a 6,000-token prompt with a
  placed 4,096-token window otherwise counted 1,900 uncached, and was held behind the new
  prefixes it should pass). The limit this leaves: a much longer prompt sharing only a placed
  16 KiB window (a common system prompt) may still open a long prefill, and is not held;
- `backlogs(endpoints)`: per candidate endpoint, the prompt tokens sent there without a first
  byte back, in streamed requests (a non-streamed one's first byte is never seen, so its entry
  lasts its whole answer), from the prefill-backlog scorer (`PrefillBacklog`). That is not the
  endpoint's `unseen_tokens` (tokens sent since its last scrape, which a scrape clears while the
  prefill may still wait), so a profile without the backlog scorer falls back to it as the nearest
  fact the router has. Where a `cold-placement-filter` with `scrapedWaiting` reads the same
  backlog scorer, its view (each endpoint whose scrape shows a queue at least `backlogTokens`):
  the hold then counts the other EPP replicas' queued requests as the filter's band does.
  With `now`, the room peers' first bytes opened stays counted while claimed
  (`claimGraceMs`, `scheduling/releaseclaims.py`): the hold and its `placeUnderBacklog` read
  these backlogs, the scorers and the filter's band do not.
"""

from __future__ import annotations

from collections.abc import Sequence

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import CycleState
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.cold_placement import ColdPlacementFilter
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import LLMRequest


class PrefillFacts:
    """The facts for one scheduler (see the module docstring)."""

    __slots__ = ("backlog", "cold", "prefix")

    def __init__(self, scheduler: Scheduler) -> None:
        plugins = list(scheduler.plugins.values())
        self.backlog = next((p for p in plugins if isinstance(p, PrefillBacklogScorer)), None)
        prefix = self.backlog.prefix if self.backlog is not None else None
        if prefix is None:
            prefix = next((p for p in plugins if isinstance(p, PrefixCacheScorer)), None)
        self.prefix = prefix
        # A filter that widens this backlog with the scraped queues (`scrapedWaiting`).
        self.cold = next(
            (
                p
                for p in plugins
                if isinstance(p, ColdPlacementFilter)
                and p.params.scraped_waiting
                and p.backlog is self.backlog
            ),
            None,
        )

    def uncached_tokens(self, request: LLMRequest, now: float) -> int:
        if self.prefix is None:
            return request.prompt_tokens
        prefix, cycle = self.prefix, CycleState(now)
        cached = prefix.cached_tokens(cycle, request)  # the one conversion
        hashes = prefix.hashes(cycle, request)  # computed once per cycle: read again, not redone
        if len(hashes) >= prefix.params.max_prefix_blocks:
            window = len(hashes) * prefix.params.block_size
            if max(prefix.matched(cycle, request).values(), default=0) >= window:
                return 0  # the whole window is placed: not a new prefix (module docstring)
        return request.prompt_tokens - max(cached.values(), default=0)

    def cached_tokens(self, request: LLMRequest, now: float) -> dict[str, int]:
        """ip:port -> the request's prompt tokens that endpoint probably caches (the prefix
        scorer's `cached_tokens`; none configured: nothing cached), for a band's
        `avoidPrefillUnlessCached` (`flowcontrol/avoidance.py`)."""
        if self.prefix is None:
            return {}
        return self.prefix.cached_tokens(CycleState(now), request)

    def backlogs(self, endpoints: Sequence[EndpointState], now: float | None = None) -> list[int]:
        if self.backlog is None:
            return [s.unseen_tokens for s in endpoints]
        backlog = self.backlog.backlog
        # First bytes it will see only: a non-streamed request's entry outlives its prefill.
        snap = backlog.seen_snapshot() if self.cold is None else self.cold.backlogs(endpoints)
        out = [snap.get(s.endpoint.hostport, 0) for s in endpoints]
        if now is not None and backlog.claims:
            claimed = backlog.claims.tokens(now)
            keys = [s.endpoint.hostport for s in endpoints]
            out = [n + claimed.get(k, 0) for n, k in zip(out, keys, strict=True)]
        return out
