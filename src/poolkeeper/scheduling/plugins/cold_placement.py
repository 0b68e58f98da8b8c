"""The `cold-placement-filter`: a new long prefix goes to one endpoint every EPP replica agrees on.

Reads the match of a `prefix-cache-scorer` (named by `prefixScorer`: its approximate index and,
with `kvEvents`, its exact one) and its consistent-hash ring (`scheduling/hashring.py`). A
prompt is *cold* when it has at least `minBlocks` of the scorer's blocks and no candidate is
known to cache that many of them. For a cold prompt the filter keeps exactly one candidate:
the first clockwise from the hash of those leading blocks on the ring of endpoints, among the
candidates *in the load band* (not out of balance with the least loaded:

    load - least > loadBandAbs  and  load > loadBandRel * least

puts an endpoint out). Any other prompt passes untouched, so warm prompts are left to the
scorers.

Why a hard pick and not a score (the scorer's `coldAffinity`): with several replicas, each
places a new prefix before any engine has reported it (engines report blocks when they
schedule a request). A score push is weighed against load scorers whose inputs differ per
replica (each one's own in-flight requests and observed speeds, scrapes read at different
instants), so some replicas follow it and some do not, and the group's next requests land on a
second server that prefills the prefix again (live, 4 replicas: 0.7-2.1 such splits per cold
start). Here the only inputs are the ring (the same in every replica that knows the same
endpoints), the prompt, the scraped load (the same up to the scrape instant) through a wide band,
and optionally the engines' reports: replicas agree unless an endpoint sits at the band's edge.
Load still overrides: an endpoint out of the band never gets the new prefix.

`countUnseen` (default false) adds this EPP's requests sent since the last scrape to the load:
more accurate, less shared. `balance` (>= 1, needs `kvEvents`): among the band, the first on the
ring whose chain heads (prompt beginnings its engine reported) number fewer than
balance x (all band candidates' heads + 1) / band size (bounded-load consistent hashing), so a
burst of new prefixes does not stack on one server once its reports arrive; `pendingHeads` also
counts the new prefixes this EPP sent that are not reported yet (sooner, but each replica counts
only its own, so replicas can disagree: the trade measured in
docs/notes/2026-12-07-cold-placement-replicas.md). With cross-replica sync
(`scheduling/replicasync/`) every replica counts every replica's sends, and `pendingHeads` is
what keeps a burst of new prefixes off a server whose engine has not reported yet
(docs/notes/2026-12-07-replica-sync.md).

`backlogScorer` (the name of a `prefill-backlog-scorer`): an endpoint with `backlogTokens` or
more of this EPP's prompt tokens sent there without a first byte back is out of the band while
some band candidate is under. Why: flow control's `holdNewPrefixes` releases a new prefix when
some endpoint's backlog is under that, and the plain band (scraped running + waiting, wide) then
sent it to a ring owner busy prefilling, which cost 4 replicas of the new default 0.99-1.16x of
one replica's p90 (8 servers, six seeds; with it 0.93-1.07x). The input is per replica, so
replicas can disagree exactly while an owner is busy
(docs/notes/2026-12-07-replicas-new-default.md).

`scrapedWaiting` (needs `backlogScorer`): an endpoint whose last scrape shows a waiting request
counts as having at least `backlogTokens` of backlog, in the band and in flow control's
`holdNewPrefixes` (which reads it through `scheduling/prefillfacts.py`). Why: with N replicas
each backlog holds only this EPP's sends, so in a cold start each replica releases and places
new prefixes as if the others sent nothing, and N of them start on one engine at once; the
engine's waiting queue holds every replica's requests. Measured: replicas sharing one true
backlog (an oracle) would take 4 replicas from 1.55x of one replica's p90 to 0.92x in the
live-like cold start; the scraped waiting count, one scrape late, recovers part of it
(docs/notes/2026-12-07-replicas-agreement.md). With cross-replica sync leave it off: the backlog
then holds the others' sends already, and the scrape would count them twice and make every
replica change its verdict at the same instant (docs/notes/2026-12-07-replica-sync.md).

`ownPlacements: false` (needs `kvEvents`): the cold test reads, for endpoints whose event feed
is fresh, only the engines' reports, not this EPP's approximate index. Why: the replica that
placed a new prefix otherwise sees it warm at once and lets its scorers move the group's next
requests (its own load view), while the others still see it cold and send theirs to the ring
owner; with reports only, every replica sends the group to the owner until the engine reports
it, and then every replica sees the same report.

Trade-off: a cold request has no fallback endpoint (the picker sees one candidate). List it
first, before a `stale-metrics-filter`: after it, an owner whose scrape is late is gone in
some replicas and not in others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from pydantic import Field, model_validator

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.interfaces import CycleState, PostCycle, TypedName
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.tokens import CHARS_PER_TOKEN


class ColdPlacementParams(PluginParams):
    prefix_scorer: str = Field(
        default="prefix-cache-scorer",
        description="Name of the prefix-cache-scorer instance whose indexes say whether a "
        "prompt is cold and whose hash ring places it (default prefix-cache-scorer).",
    )
    min_blocks: int = Field(
        default=32,
        ge=1,
        description="Leading blocks of the prefix scorer that key the placement; shorter "
        "prompts, and prompts of which some candidate caches this many, pass untouched "
        "(default 32: 512 tokens at 64-character blocks).",
    )
    load_band_abs: float = Field(
        default=8,
        ge=0,
        description="An endpoint is out of the load band when it has more than this many "
        "requests more than the least loaded candidate (default 8) ...",
    )
    load_band_rel: float = Field(
        default=1.5,
        ge=1.0,
        description="... and more than this many times as many (default 1.5).",
    )
    count_unseen: bool = Field(
        default=False,
        description="Load includes this EPP's requests sent since the last scrape (default "
        "false: scraped running + waiting only, the same in every replica).",
    )
    backlog_scorer: str = Field(
        default="",
        description="Name of a prefill-backlog-scorer instance: an endpoint whose prefill "
        "backlog (as that scorer counts it) is `backlogTokens` or more is out of the band "
        "while some band candidate's is under (default empty: off).",
    )
    backlog_tokens: int = Field(
        default=2048,
        ge=1,
        description="With backlogScorer: the backlog (the uncached prompt tokens of streamed "
        "requests sent there without a first byte back) that puts an endpoint out of the "
        "band (default 2,048: flow control's holdNewPrefixes default, which holds a new "
        "prefix while every endpoint is over it).",
    )
    scraped_waiting: bool = Field(
        default=False,
        description="With backlogScorer: an endpoint whose last scrape shows a waiting request "
        "counts as having at least backlogTokens of backlog, in the band and in flow control's "
        "holdNewPrefixes (default false: this EPP's own sends only). For several replicas: the "
        "engine's queue holds every replica's requests.",
    )
    balance: float = Field(
        default=0.0,
        ge=0.0,
        description="Bounded load on the ring (needs the prefix scorer's kvEvents): the first "
        "band candidate whose engine-reported chain heads are below this x (the band's heads "
        "+ 1) / band size (default 0: off, the plain ring). Must be 0 or >= 1.",
    )
    own_placements: bool = Field(
        default=True,
        description="A prompt this EPP already placed counts as held (its approximate index) "
        "before the engine reports it (default true). False: for endpoints whose KV-event "
        "feed is fresh only the engine's reports count, so every replica treats a new prefix "
        "alike (its ring owner) until its engine reports it; stale endpoints keep the "
        "approximate index.",
    )
    pending_heads: bool = Field(
        default=False,
        description="With balance, also count the new prefixes this EPP sent that the engine "
        "has not reported yet (default false: only the reports, which every replica shares).",
    )

    @model_validator(mode="after")
    def _balance_range(self) -> ColdPlacementParams:
        if 0 < self.balance < 1:
            raise ValueError("balance must be 0 (off) or >= 1")
        if "backlog_tokens" in self.model_fields_set and not self.backlog_scorer:
            raise ValueError("backlogTokens needs backlogScorer (without it nothing reads it)")
        if self.scraped_waiting and not self.backlog_scorer:
            raise ValueError("scrapedWaiting needs backlogScorer (it raises that backlog)")
        return self


def with_waiting(
    backlog: Mapping[str, int], candidates: Sequence[EndpointState], floor: int
) -> dict[str, int]:
    """`backlog` (endpoint -> this EPP's prefill backlog in tokens) for `candidates`, each
    endpoint whose last scrape shows a waiting request raised to at least `floor`: the
    engine's queue counts every replica's requests, this EPP's backlog only its own. Only a
    scrape that succeeded counts: a failed one keeps its last values (`reachable` is false),
    and an endpoint gone dead would otherwise stay busy while its sends fail. The queue is the
    whole server's, deferred LoRA requests included (a limit of the signal)."""
    out = {}
    for s in candidates:
        k = s.endpoint.hostport
        own = backlog.get(k, 0)
        m = s.metrics
        out[k] = max(own, floor) if m.waiting > 0 and m.reachable else own
    return out


def under_backlog(band: set[str], backlog: Mapping[str, int], tokens: int) -> set[str]:
    """The band's endpoints whose prefill backlog is under `tokens`; the whole band if none
    is (then the backlog cannot choose, and the ring does as without it)."""
    under = {k for k in band if backlog.get(k, 0) < tokens}
    return under or band


class ColdPlacementFilter(NamedPlugin):
    """Filter keeping, for a cold long prompt, only its ring owner within the load band."""

    __slots__ = ("backlog", "params", "prefix")

    def __init__(
        self,
        typed_name: TypedName,
        params: ColdPlacementParams,
        prefix: PrefixCacheScorer,
        backlog: PrefillBacklogScorer | None = None,
    ) -> None:
        super().__init__(typed_name)
        self.params = params
        self.prefix = prefix
        self.backlog = backlog

    def post_cycles_read(self) -> Sequence[tuple[str, PostCycle]]:
        # The backlog fills in the scorer's PostCycle, which runs only in its profiles.
        return [("backlogScorer", self.backlog)] if self.backlog is not None else []

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        if len(candidates) < 2:
            return candidates
        key = self.cold_key(cycle, request, candidates)
        if key is None:
            return candidates
        owner = self.owner(key, candidates, cycle.now)
        return [s for s in candidates if s.endpoint.hostport == owner]

    def cold_key(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> int | None:
        """The ring key of a cold prompt (the chained hash of its first `minBlocks` blocks),
        or None when the prompt is short or some endpoint is known to cache that much."""
        prefix, blocks = self.prefix, self.params.min_blocks
        hashes = prefix.hashes(cycle, request)
        if len(hashes) < blocks:
            return None
        need = blocks * prefix.params.block_size
        if self.params.own_placements or prefix.exact is None:
            held = max(prefix.matched(cycle, request).values(), default=0)
        else:
            held = self._reported(cycle.now, request, hashes[:blocks], need, candidates)
        return None if held >= need else hashes[blocks - 1]

    def _reported(
        self,
        now: float,
        request: LLMRequest,
        hashes: list[int],
        upto: int,
        candidates: Sequence[EndpointState],
    ) -> int:
        """The most of the prompt's first `upto` characters any candidate holds, by its
        engine's reports where its feed is fresh, else by the approximate index."""
        prefix, exact = self.prefix, self.prefix.exact
        assert exact is not None
        size = prefix.params.block_size
        approx = prefix.index.match(hashes)
        chunk = exact.block_size * CHARS_PER_TOKEN
        reported = exact.match(
            engine_block_hashes(request.target_model, request.prompt[:upto], exact.block_size)
        )
        most = 0
        for s in candidates:
            k = s.endpoint.hostport
            held = reported.get(k, 0) * chunk if exact.fresh(k, now) else approx.get(k, 0) * size
            most = max(most, held)
        return most

    def owner(self, key: int, candidates: Sequence[EndpointState], now: float) -> str:
        """ip:port of the first candidate clockwise from `key` within the load band (and,
        with `balance`, under its share of chain heads; the first in the band if none is)."""
        p = self.params
        keys = [s.endpoint.hostport for s in candidates]
        loads = [self._load(s) for s in candidates]
        least = min(loads)
        band = {
            k
            for k, load in zip(keys, loads, strict=True)
            if not (load - least > p.load_band_abs and load > p.load_band_rel * least)
        }
        if self.backlog is not None:
            band = under_backlog(band, self.backlogs(candidates), p.backlog_tokens)
        ring = self.prefix.hashring
        fits = self._fits(band, now)
        if fits is not None:
            owner = ring.owner(key, keys, fits)
            if owner in band and fits(owner):
                return owner
        return ring.owner(key, keys, band.__contains__)

    def backlogs(self, candidates: Sequence[EndpointState]) -> Mapping[str, int]:
        """The backlog scorer's prefill backlog per endpoint (streamed requests only), with
        `scrapedWaiting` raised where the scrape shows a queue (`with_waiting`)."""
        assert self.backlog is not None
        snap = self.backlog.backlog.seen_snapshot()
        if not self.params.scraped_waiting:
            return snap
        return with_waiting(snap, candidates, self.params.backlog_tokens)

    def _fits(self, band: set[str], now: float) -> Callable[[str], bool] | None:
        """`balance`'s test over the band (None: off or no exact index)."""
        exact = self.prefix.exact
        if not self.params.balance or exact is None:
            return None
        pending = self.params.pending_heads
        heads = {k: exact.heads(k, now, pending=pending) for k in band}
        bound = math.ceil(self.params.balance * (sum(heads.values()) + 1) / len(band))
        return lambda k: k in band and heads[k] < bound

    def _load(self, s: EndpointState) -> int:
        m = s.metrics
        load = m.running + m.waiting
        return load + s.unseen_requests if self.params.count_unseen else load
