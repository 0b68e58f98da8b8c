"""The exact prefix index: which endpoint holds which KV block, as its engine reported it.

Fed by the engines' KV-cache events (`kvevents.py`; live through `kvsubscriber.py`, in virtual
time straight from the simulated engines' caches). Keys are the engines' own block hashes, so a
prompt is matched by recomputing them (`engine_block_hashes`). Unlike the approximate index it
knows about requests other EPP replicas routed and about evictions, and it holds no guesses.

Staleness rule (per endpoint), checked at every decision: the exact view of an endpoint is used
only if
- it has delivered at least one event batch,
- no sequence gap was seen in the last `stale_after_s` seconds (a gap drops the endpoint's
  blocks: whatever was lost cannot be trusted), and
- the EPP has not routed a request to it `stale_after_s` ago or earlier with no event batch
  from it since (a server that takes prompts and reports nothing has a broken feed; an
  idle server that reports nothing is fine).
Otherwise the prefix scorer falls back to its approximate index for that endpoint, which it
keeps up to date either way.

Other routers (`foreign_at`): the index also remembers the first engine block of the prompts
this EPP sent (`sent`, the most recent `SENT_HEADS` (endpoint, block) pairs) and notes the time
of any BlockStored that starts a chain (no parent) on an endpoint this EPP never sent that block
to: another router sent it. One router never causes one (an engine stores a chain's first block
only when a request it was sent starts one, and that request came from this EPP; the memory
only needs to span the time from routing to scheduling), nor does a restart (blocks cached
before are not reported again). The prefix scorer's `coldAffinityPeersOnly` reads it.

Chain heads (`heads`): per endpoint, the first blocks of the chains its engine reported (for
shared-prefix traffic, the prefix groups it holds) plus those this EPP (with cross-replica sync,
any replica) sent it in the last `stale_after_s` that are not reported yet; the prefix scorer's
`coldAffinityBalance` bounds them.

Memory bound (`max_blocks_per_endpoint`, the prefix scorer's `kvIndexMaxBlocksPerEndpoint`):
the same structure as the approximate index (one entry per (endpoint, block), about 164 B), and
an honest engine bounds it by its cache, but events are unauthenticated and a publisher that
stores without ever removing would grow it without end; so each endpoint keeps at most this
many blocks, least recently stored out first (`evictions` counts them); within a store the
chain's first block is the most recent, so a chain loses its tail first and matching, which
walks from the head, still finds what is kept. Why store order, although an engine reuses
cached blocks without reporting them again: what the exact index adds to the scorer's
approximate one (it takes the longer match) is what other routers placed lately; a prefix this
EPP keeps routing is in its approximate index anyway (refreshing looked-up blocks lost affinity
in the replicas bench). A continuation whose parent the endpoint does not hold here (evicted,
cleared, or never reported) could never be matched and is not stored (`unanchored`). Why per
endpoint: a misbehaving engine costs its own view only. Measured in
docs/notes/2026-12-08-exact-index-bound.md.

Counters (plain integers, read at scrape time by `kvsubscriber.py`'s `reading` for /metrics,
`telemetry/kv_collector.py`): `admissions` (blocks stored), `removals` (blocks the engines
reported removed), `evictions` and `unanchored` (above), and the scorer's `lookup`s with the
blocks they asked for and the best endpoint's match. Only the loop that owns the index writes
them. `staleness` says why an endpoint's view is not used (the rule above, one reason each).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from poolkeeper.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from poolkeeper.scheduling.kvstats import Staleness
from poolkeeper.scheduling.prefix import PrefixIndex

# Blocks kept per endpoint by default: 31,250 blocks of 16 tokens = 500K tokens, what an H100
# holds for an 8B model (and the approximate index's lruCapacityPerServer); the simulator's
# engines hold 28,000, so there the engines' own evictions always come first.
MAX_BLOCKS_PER_ENDPOINT = 31_250
# Chain heads this EPP sent, most recent first out: enough for 65 s of routing at 1,000 req/s,
# far longer than a request waits at an engine before it is scheduled (when its blocks are
# stored). About 11 MiB when full (tracemalloc, 1,000 endpoints).
SENT_HEADS = 65_536


class ExactPrefixIndex:
    """Engine-reported blocks per endpoint, with a freshness verdict per endpoint."""

    __slots__ = (
        "_distrust_until",
        "_heads",
        "_index",
        "_last_event",
        "_pending",
        "_routed_since",
        "_sent",
        "admissions",
        "block_size",
        "evictions",
        "foreign_at",
        "lookup_blocks",
        "lookup_hits",
        "lookups",
        "removals",
        "stale_after_s",
        "unanchored",
    )

    def __init__(
        self,
        *,
        block_size: int = 16,
        stale_after_s: float = 5.0,
        max_blocks_per_endpoint: int = MAX_BLOCKS_PER_ENDPOINT,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if stale_after_s <= 0:
            raise ValueError("stale_after_s must be > 0")
        if max_blocks_per_endpoint < 1:
            raise ValueError("max_blocks_per_endpoint must be >= 1")
        self.block_size = block_size  # tokens per block; updated from BlockStored events
        self.stale_after_s = stale_after_s
        self._index = PrefixIndex(max_blocks_per_endpoint)
        self.evictions = 0  # blocks dropped by the bound (the engine did not report them gone)
        self.unanchored = 0  # stored blocks ignored: their parent is not held here
        self.admissions = 0  # blocks stored as the engines reported them (anchored)
        self.removals = 0  # blocks the engines reported removed (BlockRemoved)
        self.lookups = 0  # the scorer's `lookup` calls
        self.lookup_blocks = 0  # blocks those lookups asked for
        self.lookup_hits = 0  # per lookup, the leading blocks the best endpoint holds
        self._last_event: dict[str, float] = {}
        self._routed_since: dict[str, float] = {}  # first routing after the last event
        self._distrust_until: dict[str, float] = {}
        self._sent: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._heads: dict[str, set[int]] = {}  # endpoint -> chain heads it holds
        # endpoint -> chain heads this EPP sent there that its engine has not reported yet
        # (the request still queued) -> when first sent.
        self._pending: dict[str, dict[int, float]] = {}
        self.foreign_at = float("-inf")  # last chain head stored that this EPP did not send

    # -- feeding ------------------------------------------------------------------------

    def apply(self, endpoint: str, batch: KVEventBatch, now: float) -> None:
        """Apply one event batch from `endpoint`, received at `now`."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.stored(
                    endpoint,
                    event.block_hashes,
                    now,
                    block_size=event.block_size,
                    head=event.parent_block_hash is None,
                    parent=event.parent_block_hash,
                )
            elif isinstance(event, BlockRemoved):
                self.removed(endpoint, event.block_hashes, now)
            elif isinstance(event, AllBlocksCleared):
                self.cleared(endpoint, now)
        self.heard(endpoint, now)

    def stored(
        self,
        endpoint: str,
        hashes: Sequence[int],
        now: float,
        *,
        block_size: int | None = None,
        head: bool = False,
        parent: int | None = None,
    ) -> None:
        """`head`: the first of `hashes` starts a chain (the event's parent is None);
        `parent`: the block the first of `hashes` continues, if known (the module's rule
        for an unanchored continuation)."""
        if block_size is not None and block_size >= 1:
            self.block_size = block_size
        if parent is not None and not self._index.holds(endpoint, parent):
            self.unanchored += len(hashes)
            self.heard(endpoint, now)
            return
        if head and hashes:
            self._heads.setdefault(endpoint, set()).add(hashes[0])
            pending = self._pending.get(endpoint)
            if pending:
                pending.pop(hashes[0], None)
            if (endpoint, hashes[0]) not in self._sent:
                self.foreign_at = now
        self.admissions += len(hashes)
        evicted = self._index.insert(endpoint, hashes)
        if evicted:
            self.evictions += len(evicted)
            heads = self._heads.get(endpoint)
            if heads:
                heads.difference_update(evicted)
        self.heard(endpoint, now)

    def removed(self, endpoint: str, hashes: Sequence[int], now: float) -> None:
        self.removals += len(hashes)
        self._index.remove(endpoint, hashes)
        heads = self._heads.get(endpoint)
        if heads:
            heads.difference_update(hashes)
        self.heard(endpoint, now)

    def cleared(self, endpoint: str, now: float) -> None:
        self._index.clear(endpoint)
        self._heads.pop(endpoint, None)
        self.heard(endpoint, now)

    def heard(self, endpoint: str, now: float) -> None:
        """An event batch (possibly empty) arrived from `endpoint`."""
        self._last_event[endpoint] = now
        self._routed_since.pop(endpoint, None)

    def lost(self, endpoint: str, now: float) -> None:
        """Events from `endpoint` were lost (sequence gap, reconnect): drop what it reported
        and distrust it for `stale_after_s`, while new events rebuild its view."""
        self._index.clear(endpoint)
        self._heads.pop(endpoint, None)
        self._distrust_until[endpoint] = now + self.stale_after_s

    def sent(self, endpoint: str, head: int, now: float, *, own: bool = True) -> None:
        """This EPP sent a prompt whose first engine block is `head` to `endpoint` at `now`;
        `own` False: another replica did (cross-replica sync), which counts as a pending head
        but not as this EPP's send (its report still shows another router, `foreign_at`)."""
        if own:
            key = (endpoint, head)
            sent = self._sent
            sent[key] = None
            sent.move_to_end(key)
            if len(sent) > SENT_HEADS:
                sent.popitem(last=False)
        if head not in self._heads.get(endpoint, ()):
            pending = self._pending.setdefault(endpoint, {})
            pending.setdefault(head, now)  # a new head goes last: the dict is in time order
            # Heads an engine never reports (an aborted request, a lost event) age out here,
            # not only when `heads` reads them (the same horizon): oldest first.
            horizon = now - self.stale_after_s
            while pending and (oldest := next(iter(pending.items())))[1] <= horizon:
                del pending[oldest[0]]

    def routed(self, endpoint: str, now: float) -> None:
        """The EPP sent a request to `endpoint` at `now` (the staleness rule's evidence)."""
        self._routed_since.setdefault(endpoint, now)

    # -- reading ------------------------------------------------------------------------

    def fresh(self, endpoint: str, now: float) -> bool:
        """Whether `endpoint`'s exact view may be used at `now` (the module's rule)."""
        return self.staleness(endpoint, now) is None

    def staleness(self, endpoint: str, now: float) -> Staleness | None:
        """Why `endpoint`'s exact view is not used at `now` (the module's rule), or None:
        `no_events` (no batch yet), `lost` (distrusted after lost events), `silent` (routed
        to `stale_after_s` ago or earlier, no batch since)."""
        if endpoint not in self._last_event:
            return "no_events"
        if now < self._distrust_until.get(endpoint, float("-inf")):
            return "lost"
        return "silent" if self.unanswered(endpoint, now) else None

    def unanswered(self, endpoint: str, now: float) -> bool:
        """Routed to `stale_after_s` ago or earlier with no batch since, whether or not one
        came before (`silent`, or `no_events` routed to): its feed looks broken, and the
        subscriber reopens it (`kvsubscriber.py`)."""
        since = self._routed_since.get(endpoint)
        return since is not None and now - since >= self.stale_after_s

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per endpoint, the leading blocks of `hashes` it reported holding (only those > 0)."""
        return self._index.match(hashes)

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """`match`, counted (the prefix scorer's lookup per decision; other readers use
        `match`): the blocks asked for and the best endpoint's, fresh or not (what the index
        holds; `staleness` says which views are used)."""
        found = self._index.match(hashes)
        self.lookups += 1
        self.lookup_blocks += len(hashes)
        if found:
            self.lookup_hits += max(found.values())
        return found

    def blocks(self, endpoint: str) -> int:
        """Blocks held for `endpoint` (at most `max_blocks_per_endpoint`)."""
        return self._index.blocks(endpoint)

    @property
    def max_blocks_per_endpoint(self) -> int:
        return self._index.capacity_per_endpoint

    def heads(self, endpoint: str, now: float, *, pending: bool = True) -> int:
        """Chain heads `endpoint` holds: the distinct prompt beginnings its engine reported
        (for shared-prefix traffic, about the prefix groups placed there), plus, with
        `pending`, those this EPP sent it in the last `stale_after_s` that it has not reported
        yet (still queued: engines report blocks when they schedule a request; other replicas
        know them only through cross-replica sync, `sent(own=False)`)."""
        heads = self._heads.get(endpoint)
        count = 0 if heads is None else len(heads)
        if not pending:
            return count
        pending_heads = self._pending.get(endpoint)
        if pending_heads:
            horizon = now - self.stale_after_s
            live = {h: t for h, t in pending_heads.items() if t > horizon}
            if len(live) < len(pending_heads):
                self._pending[endpoint] = live
            count += len(live)
        return count

    @property
    def size(self) -> int:
        """Total (endpoint, block) entries."""
        return self._index.size

    def forget_endpoints(self, keep: set[str]) -> None:
        self._index.forget_endpoints(keep)
        tables = (
            self._last_event,
            self._routed_since,
            self._distrust_until,
            self._heads,
            self._pending,
        )
        for table in tables:
            for endpoint in [e for e in table if e not in keep]:
                del table[endpoint]
