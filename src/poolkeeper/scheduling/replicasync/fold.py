"""The fold: one scheduler's state fed with the other replicas' sends, and its own sends told.

`bind_scheduler(sync, scheduler)` finds, among the built scheduler's plugins, the
`prefill-backlog-scorer`(s) (`PrefillBacklog`) and the prefix-cache scorer they read (its
approximate index and, with `kvEvents`, the exact index's pending chain heads), and returns a
`SchedulerFold` that is both ends:

- own events (`SendTap`, set as each backlog scorer's `sync`): the scorer's PostCycle, first
  byte and end (`PrefillBacklogScorer.post_cycle` / `observe_first_token` / `request_ended`,
  driven by the scheduler's PostCycle and by the Director's first byte and end) publish `Sent`
  (with the prefix scorer's block hashes of the prompt, at most `MAX_BLOCKS`, and the engine
  hash of its first block when the scorer keeps an exact index), `Answered` and `Ended` to the
  hub. A first byte or end is told only for a send told and not yet closed (`ownopen.py`: a
  first byte of a request never sent is not, nor an end after its first byte), whatever the
  backlog still holds. Every event names the send by `LLMRequest.key` (the Director's
  `id#seq`: client ids repeat, and one send's first byte must not close another's, here or at
  a peer);
- peers' events (`PeerSink`, bound to the hub): `Sent` counts the request in every backlog under
  `(origin, request_id)` (so in the scorer's costs and busy share, in flow control's
  `holdNewPrefixes` and in the cold-placement filter's band, which read that backlog through
  `scheduling/prefillfacts.py` and `ColdPlacementFilter.backlogs`), inserts its blocks into the
  prefix scorer's approximate index for that endpoint, and adds its head as a pending head of
  the exact index (`ExactPrefixIndex.sent(own=False)`: not this EPP's send, so the engine's report
  still shows another router); `Answered` clears it as a first byte (a drain-rate sample of
  that endpoint, stamped at delivery, one per endpoint per delivery instant), `Ended` as an
  end; a peer gone (`ReplicaSync.expire`) drops its entries;
- own open sends (`open_digests`, bound as the hub's statement source): the own sends published
  and not yet answered or ended (`ownopen.py`, kept here, not read from the backlog, which may
  drop an own entry without telling anyone), which the hub states to peers so they drop entries
  whose `Answered` or `Ended` was lost (`openset.py`). Each send is stamped with its decision's
  `now` (the scheduler's clock), so the statement ages them on that clock too: `bind_scheduler`'s
  `clock`, the one the scheduler's decisions get (without it no statement source is bound).

Options (measured in docs/notes/2026-12-07-replica-sync.md): `index` (peers' blocks into the
approximate index), `drain` (peers' first bytes as drain-rate samples), `heads` (peers' heads
as pending heads); `claim_s` (`claimGraceMs`, docs/notes/2026-12-07-release-claim.md): a
peer's first byte leaves the room it opened claimed for that long, in flow control's hold's
view (`scheduling/releaseclaims.py`).

Bounded: a peer's entries live in the backlog under its caps (`max_entries`, `max_age_s`), its
blocks in the index's per-endpoint LRU. With a `pool` (the server seeds it from the datastore
and `forget_endpoints` replaces it), a peer's send to an endpoint outside it is ignored and
counted (`ignored`): peers cannot grow state for addresses this replica does not route to; when
the pool shrinks, peers' backlog entries for the endpoints that left are dropped
(`PrefillBacklog.forget_peer_endpoints`). This replica's own state there (own entries, drain
rates, the prefix indexes) is the scheduler's own forgetter's (`server/forgetting.py`, with its
grace for a readiness flap), not the fold's: peers' blocks and pending heads cannot be told
from own ones in the indexes, so they stay until that forgetter drops the endpoint (bounded by
the indexes' own caps meanwhile, and no new ones come: the sends are ignored). Without a pool
(the benches, tests) the endpoints peers name are at most `max_endpoints`.

Which scorers: peers' sends go to the backlog scorers the profiles run (the ones whose PostCycle
records own sends); the first of each profile tells own events (a second one in the same
profile would tell each first byte and end twice). With several profiles own sends reach only
the primary profile's scorers while peers' reach all of them (the primary is chosen per
request); the presets have one profile.

Without a bound hub nothing here runs: the scorers' `sync` is None and they route as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.interfaces import CycleState
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.replicasync.events import MAX_BLOCKS, Answered, Ended, Sent, SyncEvent
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.replicasync.ownopen import OwnOpen
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.tokens import CHARS_PER_TOKEN

MAX_ENDPOINTS = 10_000  # distinct endpoints peers may name (a pool of thousands fits)
_TOLD = "replicasync.told"  # the cycle state's mark: this decision's send is published


class SchedulerFold:
    """One scheduler's end of cross-replica sync (the module docstring)."""

    __slots__ = (
        "_endpoints", "_pool", "_sampled", "_sampled_at", "backlogs", "claim_s", "drain",
        "heads", "ignored", "index", "max_endpoints", "own", "prefix", "sync",
    )  # fmt: skip

    def __init__(
        self,
        sync: ReplicaSync,
        backlogs: Sequence[PrefillBacklogScorer],
        prefix: PrefixCacheScorer | None,
        *,
        index: bool = True,
        drain: bool = True,
        heads: bool = True,
        max_endpoints: int = MAX_ENDPOINTS,
        pool: set[str] | None = None,
        claim_s: float = 0.0,
    ) -> None:
        if not backlogs:
            raise ValueError(
                "cross-replica sync needs a prefill-backlog-scorer: it publishes the sends that "
                "scorer records and folds the peers' into its backlog"
            )
        if max_endpoints < 1 or claim_s < 0:
            raise ValueError("max_endpoints must be >= 1 and claim_s >= 0")
        self.sync = sync
        self.backlogs = tuple(backlogs)
        self.prefix = prefix
        self.index = index
        self.drain = drain
        self.heads = heads
        self.max_endpoints = max_endpoints
        self.claim_s = claim_s
        self._endpoints: set[str] = set()  # endpoints peers named
        self._pool: frozenset[str] | None = None if pool is None else frozenset(pool)
        # A batch's first bytes all carry its delivery time: one drain sample per endpoint
        # per delivery instant (the others, over 0 s, would overstate the rate).
        self._sampled_at: float | None = None
        self._sampled: set[tuple[int, str]] = set()
        self.ignored = 0  # peers' sends to an endpoint outside the pool or past `max_endpoints`
        first = self.backlogs[0].backlog  # the open set ages and caps like the backlog
        self.own = OwnOpen(max_open=first.max_entries, max_age_s=first.max_age_s)

    # -- own events (SendTap) ---------------------------------------------------------------

    def sent(self, cycle: CycleState, request: LLMRequest, endpoint: str, tokens: int) -> None:
        # Marked in the decision's own state: a scorer instance shared by two profiles, or a
        # retry of one request id, must neither tell one decision twice nor skip a new one.
        if cycle.get(_TOLD) is not None:
            return
        cycle.put(_TOLD, True)
        blocks: tuple[int, ...] = ()
        head: int | None = None
        prefix = self.prefix
        if prefix is not None:
            blocks = tuple(prefix.hashes(cycle, request)[:MAX_BLOCKS])
            exact = prefix.exact
            if exact is not None:
                chunk = exact.block_size * CHARS_PER_TOKEN
                first = engine_block_hashes(
                    request.target_model, request.prompt[:chunk], exact.block_size
                )
                head = first[0] if first else None
        self.own.sent(request.key, cycle.now)
        self.sync.publish(Sent(request.key, endpoint, tokens, request.stream, blocks, head))

    def answered(self, request_id: str) -> None:
        if self.own.closed(request_id):
            self.sync.publish(Answered(request_id))

    def ended(self, request_id: str) -> None:
        if self.own.closed(request_id):
            self.sync.publish(Ended(request_id))

    def open_digests(self, now: float) -> list[int]:
        """The digests of the own sends published and still open at `now`, on the scheduler's
        clock (the statement source)."""
        return self.own.digests(now)

    # -- peers' events (PeerSink) -----------------------------------------------------------

    def fold(self, origin: str, event: SyncEvent, now: float) -> None:
        key = (origin, event.request_id)
        if isinstance(event, Sent):
            self._fold_sent(key, event, now)
        elif isinstance(event, Answered):
            for scorer in self.backlogs:
                sample = self._sample_at(scorer, key, now)
                if self.claim_s > 0:
                    scorer.backlog.first_token(key, sample, claim_until=now + self.claim_s)
                else:
                    scorer.backlog.first_token(key, sample)
        else:
            for scorer in self.backlogs:
                scorer.backlog.ended(key)

    def _sample_at(
        self, scorer: PrefillBacklogScorer, key: tuple[str, str], now: float
    ) -> float | None:
        """`now` if this first byte may be a drain sample (the first at `now` for its endpoint)."""
        if not self.drain:
            return None
        endpoint = scorer.backlog.endpoint_of(key)
        if endpoint is None:
            return None
        if now != self._sampled_at:
            self._sampled_at = now
            self._sampled.clear()
        tag = (id(scorer), endpoint)
        if tag in self._sampled:
            return None
        self._sampled.add(tag)
        return now

    def _fold_sent(self, key: tuple[str, str], event: Sent, now: float) -> None:
        endpoint = event.endpoint
        pool = self._pool
        if pool is not None:
            if endpoint not in pool:
                self.ignored += 1
                return
        elif endpoint not in self._endpoints:
            if len(self._endpoints) >= self.max_endpoints:
                self.ignored += 1
                return
            self._endpoints.add(endpoint)
        for scorer in self.backlogs:
            scorer.backlog.sent(key, endpoint, event.tokens, now, seen=event.seen)
        prefix = self.prefix
        if prefix is None:
            return
        if self.index and event.blocks:
            prefix.index.insert(endpoint, event.blocks[: prefix.params.max_prefix_blocks])
        if self.heads and event.head is not None and prefix.exact is not None:
            prefix.exact.sent(endpoint, event.head, now, own=False)

    def peer_gone(self, origin: str) -> None:
        for scorer in self.backlogs:
            scorer.backlog.drop_origin(origin)

    @property
    def pool(self) -> frozenset[str] | None:
        """The endpoints peers' sends may name (None: any, up to `max_endpoints`)."""
        return self._pool

    def forget_endpoints(self, keep: set[str]) -> None:
        """The pool is now `keep`: peers' sends elsewhere are ignored from now on, and their
        backlog entries for the endpoints that left are dropped. Nothing of this replica's
        own (the module docstring: the scheduler's forgetter decides, with its grace)."""
        before = self._pool if self._pool is not None else frozenset(self._endpoints)
        self._pool = frozenset(keep)
        self._endpoints &= keep
        if before <= self._pool:
            return
        for scorer in self.backlogs:
            scorer.backlog.forget_peer_endpoints(keep)

    def unbind(self) -> None:
        """Stop telling own events (peers' batches still reach the hub's other sinks)."""
        for scorer in self.backlogs:
            if scorer.sync is self:
                scorer.sync = None


def bind_scheduler(
    sync: ReplicaSync,
    scheduler: Scheduler,
    *,
    index: bool = True,
    drain: bool = True,
    heads: bool = True,
    pool: set[str] | None = None,
    clock: Callable[[], float] | None = None,
    claim_s: float = 0.0,
) -> SchedulerFold:
    """Bind `sync` to `scheduler`'s backlog and prefix scorers (the module docstring): its own
    sends are published to `sync`, the peers' batches `sync` accepts are folded in. The prefix
    scorer is the one the (first) backlog scorer reads, else the scheduler's only one. `pool`:
    the endpoints peers' sends may name (None: any, up to `MAX_ENDPOINTS`). `clock`: the
    scheduler's clock (the `now` its decisions get, which stamps the own open sends): with it
    the own open sends are `sync`'s statement source, aged on that clock; without it (the
    benches, which state nothing) `sync` makes no statement. `claim_s`: `claimGraceMs` in
    seconds (0: off; the module docstring)."""
    plugins = list(scheduler.plugins.values())
    # The backlog scorers some profile runs (their PostCycle records own sends): peers' sends
    # go to them; the first of each profile tells own events (two in one profile would tell
    # each request twice).
    backlogs: list[PrefillBacklogScorer] = []
    tellers: list[PrefillBacklogScorer] = []
    for profile in scheduler.profiles.values():
        members = [p for p in profile.post_cycles if isinstance(p, PrefillBacklogScorer)]
        tellers += members[:1]
        backlogs += [m for m in members if all(m is not b for b in backlogs)]
    prefix = next((b.prefix for b in backlogs if b.prefix is not None), None)
    if prefix is None:
        prefixes = [p for p in plugins if isinstance(p, PrefixCacheScorer)]
        prefix = prefixes[0] if len(prefixes) == 1 else None
    fold = SchedulerFold(
        sync, backlogs, prefix, index=index, drain=drain, heads=heads, pool=pool, claim_s=claim_s
    )
    for scorer in tellers:
        scorer.sync = fold
    sync.bind(fold)
    if clock is not None:
        scheduler_clock = clock  # (narrowed for the closure)
        sync.bind_open(lambda: fold.open_digests(scheduler_clock()))
    return fold
