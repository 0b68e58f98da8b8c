"""The `cold-placement-filter`'s parameters (`ColdPlacementParams`) and why each option is there
(`cold_placement.py` has the rule).

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

`keepPlaced` (default false): a placed prefix stays on the endpoints known to hold it. Why:
live, every double prefill of 2 and 4 replicas with sync was a *warm* move, a group's request
sent to a second server seconds after the group was placed, while its server was busy and one
replica's own load inputs (its in-flight and unseen counts, speeds observed on its own finished
requests, its scrape instants) outweighed the prefix score; one EPP, drawing on one view, did it
more rarely (3 of 9 rounds). The holders are read from what every replica shares (the synced
approximate index, the engines' reports), so replicas agree; the cost: load no longer moves a
placed group (docs/notes/2026-12-07-cold-start-doubles.md).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from poolkeeper.scheduling.registry import PluginParams


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
        "(with keepPlaced the latter go to the candidates caching them; default 32: 512 "
        "tokens at 64-character blocks).",
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
    keep_placed: bool = Field(
        default=False,
        description="A long prompt some candidate is known to hold (as the cold test reads "
        "it) goes only to the candidates holding it; none of them a candidate: placed as a "
        "cold prompt (default false: the scorers decide among all).",
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
