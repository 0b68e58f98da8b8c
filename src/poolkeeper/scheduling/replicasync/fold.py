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
  hub. Only requests the backlog counted are told (a first byte of a request it never saw is
  not);
- peers' events (`PeerSink`, bound to the hub): `Sent` counts the request in every backlog under
  `(origin, request_id)` (so in the scorer's costs and busy share, in flow control's
  `holdNewPrefixes` and in the cold-placement filter's band, which read that backlog through
  `scheduling/prefillfacts.py` and `ColdPlacementFilter.backlogs`), inserts its blocks into the
  prefix scorer's approximate index for that endpoint, and adds its head as a pending head of
  the exact index (`ExactPrefixIndex.sent(own=False)`: not this EPP's send, so the engine's report
  still shows another router); `Answered` clears it as a first byte (a drain-rate sample of
  that endpoint, stamped at delivery), `Ended` as an end; a peer gone (`ReplicaSync.expire`)
  drops its entries.

Options (measured in docs/notes/2026-12-07-replica-sync.md): `index` (peers' blocks into the
approximate index), `drain` (peers' first bytes as drain-rate samples), `heads` (peers' heads
as pending heads).

Bounded: a peer's entries live in the backlog under its caps (`max_entries`, `max_age_s`), its
blocks in the index's per-endpoint LRU; the endpoints peers name are at most `max_endpoints`
(events for a further one are ignored and counted, until `forget_endpoints` prunes the set as
the pool changes).

Without a bound hub nothing here runs: the scorers' `sync` is None and they route as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.interfaces import CycleState
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.replicasync.events import MAX_BLOCKS, Answered, Ended, Sent, SyncEvent
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.tokens import CHARS_PER_TOKEN

MAX_ENDPOINTS = 10_000  # distinct endpoints peers may name (a pool of thousands fits)


class SchedulerFold:
    """One scheduler's end of cross-replica sync (the module docstring)."""

    __slots__ = (
        "_endpoints", "_last_sent", "backlogs", "drain", "heads", "ignored", "index",
        "max_endpoints", "prefix", "sync",
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
    ) -> None:
        if not backlogs:
            raise ValueError(
                "cross-replica sync needs a prefill-backlog-scorer: it publishes the sends that "
                "scorer records and folds the peers' into its backlog"
            )
        if max_endpoints < 1:
            raise ValueError("max_endpoints must be >= 1")
        self.sync = sync
        self.backlogs = tuple(backlogs)
        self.prefix = prefix
        self.index = index
        self.drain = drain
        self.heads = heads
        self.max_endpoints = max_endpoints
        self._endpoints: set[str] = set()  # endpoints peers named
        # Two backlog scorers in one profile tell one decision twice: (cycle, request id).
        self._last_sent: tuple[int, str] = (0, "")
        self.ignored = 0  # peers' events for an endpoint past `max_endpoints`

    # -- own events (SendTap) ---------------------------------------------------------------

    def sent(self, cycle: CycleState, request: LLMRequest, endpoint: str, tokens: int) -> None:
        decision = (id(cycle), request.request_id)
        if decision == self._last_sent:
            return
        self._last_sent = decision
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
        self.sync.publish(Sent(request.request_id, endpoint, tokens, request.stream, blocks, head))

    def answered(self, request_id: str) -> None:
        self.sync.publish(Answered(request_id))

    def ended(self, request_id: str) -> None:
        self.sync.publish(Ended(request_id))

    # -- peers' events (PeerSink) -----------------------------------------------------------

    def fold(self, origin: str, event: SyncEvent, now: float) -> None:
        key = (origin, event.request_id)
        if isinstance(event, Sent):
            self._fold_sent(key, event, now)
        elif isinstance(event, Answered):
            at = now if self.drain else None
            for scorer in self.backlogs:
                scorer.backlog.first_token(key, at)
        else:
            for scorer in self.backlogs:
                scorer.backlog.ended(key)

    def _fold_sent(self, key: tuple[str, str], event: Sent, now: float) -> None:
        endpoint = event.endpoint
        if endpoint not in self._endpoints:
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

    def forget_endpoints(self, keep: set[str]) -> None:
        """Forget the endpoints peers named that left the pool (the scheduler's plugins drop
        their state in `Scheduler.forget_endpoints`)."""
        self._endpoints &= keep

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
) -> SchedulerFold:
    """Bind `sync` to `scheduler`'s backlog and prefix scorers (the module docstring): its own
    sends are published to `sync`, the peers' batches `sync` accepts are folded in. The prefix
    scorer is the one the (first) backlog scorer reads, else the scheduler's only one."""
    plugins = list(scheduler.plugins.values())
    backlogs = [p for p in plugins if isinstance(p, PrefillBacklogScorer)]
    prefix = next((b.prefix for b in backlogs if b.prefix is not None), None)
    if prefix is None:
        prefixes = [p for p in plugins if isinstance(p, PrefixCacheScorer)]
        prefix = prefixes[0] if len(prefixes) == 1 else None
    fold = SchedulerFold(sync, backlogs, prefix, index=index, drain=drain, heads=heads)
    for scorer in backlogs:
        scorer.sync = fold
    sync.bind(fold)
    return fold
