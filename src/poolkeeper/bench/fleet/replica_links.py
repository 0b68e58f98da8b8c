"""What reaches the EPP replicas late (virtual time): the engines' KV events, the replicas' sync.

`EventDelay` is the queue of what is in flight, applied at the first routing decision or
release at or after its due time, stamped with that time. Two things travel through it:

`ExactFeed` (`run`'s `event_delay_s`, `--event-delay S`): each simulated engine's KV-cache
events, fed straight to every replica's exact index (`exact_indexes`), as the live simulator
publishes them over ZMQ but without sockets. With a delay they reach the replicas S seconds
after the engine stored the blocks (live they cross a socket and a busy event loop), so a new
prefix's second request can reach another replica before the report.

`SyncLink` (`run`'s `sync_delay_s`, `--sync-delay-ms D`; absent: no sync): cross-replica sync
(`scheduling/replicasync/`): every replica's scheduler is bound to a `ReplicaSync` hub
(`bind_scheduler`), and the batch each one's `take()` returns after each of its decisions,
first bytes and ends reaches every other replica D ms later (virtual time; applied at the first
routing decision or release at or after that, stamped with the due time; 0: at once, before
the next decision). A batch with a peer's first byte or end wakes the receiving replica's pump
at the next release (its hold reads a backlog that just shrank). `sync_folds` (`--sync-without
index drain heads wake`) turns parts of the fold (and the wake) off, to measure what each adds;
`unseen` (`--sync-with unseen`) turns one on: the peers' sends since each endpoint's last scrape
in the replica's unseen counts (`scheduling/replicasync/peerunseen.py`), which the queue and
running scorers and the saturation filter read, left out in a pool serving LoRA adapters as
`serve` does; `unseen-lora` (`--sync-with unseen-lora`) folds them in such a pool too (the
gate's A/B: docs/notes/2026-12-07-lora-unseen.md). `claim_s` (`--sync-claim-ms`): the fold's
`claimGraceMs` (the room a peer's first byte opened stays claimed in the hold's view that long;
the replica's pump runs again at its next release after it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

from poolkeeper.bench.fleet.replica_router import Replica, prefix_scorers, scheduler_of
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.replicasync.events import Batch
from poolkeeper.scheduling.replicasync.fold import bind_scheduler
from poolkeeper.scheduling.replicasync.hub import ReplicaSync, clears
from poolkeeper.scheduling.replicasync.peerunseen import PeerUnseen
from poolkeeper.sim.engine import EngineModel


class EventDelay:
    """KV events in flight from the engines to the replicas, `delay_s` long: each is applied
    to every replica's index at the first routing decision at least `delay_s` after the engine
    stored or evicted the blocks. Why: live, a report reaches the other replicas after the
    engine's publish, the network and the EPP's event loop (on a starved machine, tens to
    hundreds of ms), and a new prefix placed in that window looks cold to the others. (The
    sync link's batches travel the same way: `SyncLink`.)"""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._queue: deque[tuple[float, Callable[[float], None]]] = deque()

    def push(self, at: float, apply: Callable[[float], None]) -> None:
        if self.delay_s <= 0:
            apply(at)
        else:
            self._queue.append((at + self.delay_s, apply))  # `at` never decreases

    def deliver(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            due, apply = queue.popleft()
            apply(due)


class ExactFeed:
    """One engine's KV-cache sink: its events go to every replica's exact index. With a delay
    they leave at the engine's time (the later of the last routing decision and the engine's
    last step end: an engine stores a prompt's blocks when it plans the step that starts
    then); without, they are applied at once, stamped with the last routing decision."""

    def __init__(
        self,
        endpoint: str,
        indexes: list[ExactPrefixIndex],
        clock: list[float],
        engine: EngineModel,
        delay: EventDelay,
    ) -> None:
        self.endpoint = endpoint
        self.indexes = indexes
        self.clock = clock
        self.engine = engine
        self.delay = delay

    def _now(self) -> float:
        if self.delay.delay_s <= 0:
            return self.clock[0]  # applied at once: as the runs without a delay always were
        return max(self.clock[0], self.engine.last_step_end)

    def stored(self, hashes: list[int], parent: int | None) -> None:
        # The index keys blocks by their own (chained) hash; no parent = a chain's first block.
        endpoint, indexes, head = self.endpoint, self.indexes, parent is None

        def apply(at: float) -> None:
            for index in indexes:
                index.stored(endpoint, hashes, at, head=head, parent=parent)

        self.delay.push(self._now(), apply)

    def removed(self, hashes: list[int]) -> None:
        endpoint, indexes = self.endpoint, self.indexes

        def apply(at: float) -> None:
            for index in indexes:
                index.removed(endpoint, hashes, at)

        self.delay.push(self._now(), apply)


def exact_indexes(routers: Sequence[Replica], block_size: int) -> list[ExactPrefixIndex]:
    """Give each replica's prefix scorer(s) an exact index; returns them all."""
    out: list[ExactPrefixIndex] = []
    for plugin in prefix_scorers(routers, "exact=True"):
        index = ExactPrefixIndex(
            block_size=block_size,
            max_blocks_per_endpoint=plugin.params.kv_index_max_blocks_per_endpoint,
        )
        plugin.enable_exact(index)
        out.append(index)
    return out


class SyncLink:
    """Cross-replica sync between the replicas, `delay_s` long (the module docstring)."""

    def __init__(
        self,
        routers: Sequence[Replica],
        delay_s: float,
        folds: dict[str, bool],
        claim_s: float = 0.0,
    ) -> None:
        self.hubs: list[ReplicaSync] = []
        for k, router in enumerate(routers):
            scheduler = scheduler_of(router)
            if scheduler is None:
                raise ValueError("sync needs a policy with a scheduler")
            hub = ReplicaSync(f"replica{k}")
            on = {part: folds.get(part, True) for part in ("index", "drain", "heads")}
            bind_scheduler(
                hub, scheduler, index=on["index"], drain=on["drain"], heads=on["heads"],
                claim_s=claim_s,
            )  # fmt: skip
            everywhere = folds.get("unseen-lora", False)  # the LoRA-pool gate off (A/B only)
            if folds.get("unseen", False) or everywhere:  # off unless asked (`serve`: on)
                router.peers = PeerUnseen(adapters_gate=not everywhere)
                hub.bind(router.peers)
            self.hubs.append(hub)
        self._delay = EventDelay(delay_s)  # batches in flight
        # Replicas that got a peer's first byte or end since the last release: their held
        # requests may fit now, so their pump runs at the next release, as on their own.
        self.woken: set[int] = set()
        self.wakes = True

    def flush(self, now: float) -> None:
        """Send what each replica published since the last flush."""
        for hub in self.hubs:
            batch = hub.take()
            if batch is not None:
                self._delay.push(now, partial(self._to_peers, batch))

    def deliver(self, now: float) -> None:
        self._delay.deliver(now)

    def _to_peers(self, batch: Batch, at: float) -> None:
        wake = self.wakes and clears(batch)
        for k, hub in enumerate(self.hubs):
            if hub.origin != batch.origin and hub.deliver(batch, at) and wake:
                self.woken.add(k)
