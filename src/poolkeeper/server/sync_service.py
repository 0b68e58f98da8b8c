"""Cross-replica sync in the runtime: started with it, or later, when an optional key appears;
its key file followed while it runs; its metrics.

`SyncService.start` reads the key and starts the syncer (`replica_sync.start_replica_sync`), or,
with `keyOptional` and the key's optional Secret not created yet (`sync_keys.key_missing`),
leaves it off with a warning. Either way, every `reconcileIntervalMs` the key file is polled
(`sync_keys.KeyFile`, on the runtime's clock): a change to valid keys is swapped into the
running codec between datagrams, or starts the syncer that waited for it (the kubelet fills an
optional Secret volume once the Secret is created: no restart needed). Why starting late is
safe: the syncer binds to the running scheduler as at start (peers' sends folded in from then
on; this replica's sends made before it are simply not told, as after a restart), under a new
origin, and a profile it could not bind to is refused at the runtime's start, not when the key
appears. A start that fails then (the port taken) is logged and tried again at each poll,
each try counted (`_start_failures_total`). Checks run one at a time (a start awaits its
socket), and the runtime's shutdown stops them first (`stop_following`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poolkeeper.datastore.store import ChangeKind, Datastore
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.replicasync.peerunseen import PeerUnseen
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server.replica_sync import RunningSync, bind, start_replica_sync
from poolkeeper.server.sync_keys import KeyFile, key_missing
from poolkeeper.server.transport import by_reason, counters

log = logging.getLogger("poolkeeper.replicasync")


class SyncService:
    """The runtime's syncer (`spec.replicaSync` on): `running` None while it waits for its
    optional key (the module docstring)."""

    def __init__(
        self,
        config: ReplicaSyncConfig,
        scheduler: Scheduler,
        datastore: Datastore,
        *,
        clock: Callable[[], float],
        wake: Callable[[], None] | None = None,
        follow: bool = True,
        on_unseen: Callable[[PeerUnseen | None], None] | None = None,
    ) -> None:
        self.config, self.scheduler, self.datastore = config, scheduler, datastore
        self.clock, self.wake, self.follow = clock, wake, follow
        # Told the running syncer's peers' unseen sends (`peerUnseen`), and None once it
        # stops: the Director adds them to its candidates (`Director.peers`).
        self.on_unseen = on_unseen
        self.every_s = config.reconcile_interval_ms / 1000.0
        self.keys = KeyFile(config, every_s=self.every_s, now=clock())
        self.running: RunningSync | None = None
        self._waiting: list[bytes] | None = None  # valid keys whose late start failed
        self._failed: str | None = None  # that start's error, logged once
        self.start_failures = 0  # late starts that failed (each retry counted)
        self._checking = asyncio.Lock()  # one check at a time: a start awaits its socket
        self._unsubscribe: Callable[[], None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the syncer, or leave it off with a warning (`keyOptional`, no key yet);
        ConfigError for a bad key or a profile it cannot bind to, OSError for a taken port.
        Then the key file is followed every `every_s` of real time, unless `follow` is False
        (tests, which call `check` on their own clock and must not race a loop)."""
        if (why := key_missing(self.config)) is not None:
            bind(ReplicaSync("probe"), self.scheduler).unbind()  # refused now, not later
            log.warning("%s", why)
        else:
            await self._run(self.keys.load())
        if self.follow:
            self._task = asyncio.create_task(self._follow(), name="replica-sync-keys")

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.check()
            except Exception:  # a bug here must not stop the key from being followed
                log.exception("replica sync: following the key file")

    async def check(self) -> None:
        """One poll of the key file (the loop's step): swap changed keys into the running
        codec, or start the syncer that waited for them. Serial: a check called while one
        awaits a start waits for it (two would start two syncers on one port)."""
        async with self._checking:
            await self._check()

    async def _check(self) -> None:
        keys = self.keys.poll(self.clock(), running=self.running is not None)
        if keys is not None and self.running is not None:
            self.running.transport.codec.set_keys(keys)
            return
        if keys is not None:
            self._waiting, self._failed = keys, None
        if self._waiting is None or self.running is not None:
            return
        try:
            await self._run(self._waiting)
        except Exception as exc:  # (ConfigError, OSError): tried again at the next poll
            self.start_failures += 1
            if str(exc) != self._failed:
                log.error("replica sync: not started: %s (tried again every %.1fs)",
                          exc, self.every_s)  # fmt: skip
            self._failed = str(exc)
            return
        self._waiting = None

    async def _run(self, keys: list[bytes]) -> None:
        pool = {e.hostport for e in self.datastore.snapshot().all_endpoints()}
        running = await start_replica_sync(
            self.config, self.scheduler, clock=self.clock, wake=self.wake, pool=pool, keys=keys
        )
        self.running = running
        if self.on_unseen is not None and running.unseen is not None:
            self.on_unseen(running.unseen)
        self._unsubscribe = self.datastore.subscribe(running.pool_changed)
        # The pool may have changed while the syncer started (its socket and peers' lookups
        # awaited): read it again now that the listener is in place, so none is missed.
        running.pool_changed(self.datastore.snapshot(), ChangeKind.ENDPOINTS)

    async def stop_following(self) -> None:
        """Stop following the key file (the runtime's shutdown begins: sync must not start
        or change keys while it drains); a start in progress is cancelled."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def stop(self) -> None:
        """Stop following the key and stop the syncer (its last ends told to the peers)."""
        await self.stop_following()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self.running is not None:
            if self.on_unseen is not None:
                self.on_unseen(None)
            await self.running.stop()

    def collector(self) -> SyncCollector:
        return SyncCollector(lambda: self.running, self.keys, lambda: self.start_failures)


class SyncCollector(Collector):
    """`poolkeeper_replica_sync_*` at scrape time (docs/kubernetes.md lists them); while
    `running` gives None (turned on, but its optional key is not there, or its late start
    fails) only `_enabled` 0, the key file's reloads and the failed starts."""

    def __init__(
        self,
        running: Callable[[], RunningSync | None],
        keys: KeyFile | None = None,
        start_failures: Callable[[], int] | None = None,
    ) -> None:
        self._running, self.keys, self._start_failures = running, keys, start_failures

    def collect(self) -> Iterator[Metric]:
        prefix, running = "poolkeeper_replica_sync", self._running()
        yield GaugeMetricFamily(
            f"{prefix}_enabled",
            "1 while the syncer runs; 0 when it is turned on but stays off (keyOptional: "
            "no valid key yet, or its start fails: start_failures_total).",
            value=0 if running is None else 1,
        )
        if self.keys is not None:
            reloads = CounterMetricFamily(
                f"{prefix}_key_reloads",
                "Changed key files read while running, by result (ok: in use; invalid: "
                "refused, the keys in use kept).",
                labels=["result"],
            )
            for result, count in self.keys.reloads.items():
                reloads.add_metric([result], count)
            yield reloads
        if self._start_failures is not None:
            yield CounterMetricFamily(
                f"{prefix}_start_failures",
                "Late starts (keyOptional, once the key is there) that failed, each retry "
                "counted (e.g. the port taken: the log says why); sync stays off meanwhile.",
                value=self._start_failures(),
            )
        if running is None:
            return
        stats, hub, codec = running.transport.stats, running.hub, running.transport.codec
        yield from counters(
            prefix,
            ("batches_sent", stats.batches_sent, "Own batches sent to the peers."),
            ("datagrams_sent", stats.datagrams_sent, "Datagrams sent, every peer counted."),
            ("batches_received", stats.received, "Peers' batches verified and folded in."),
            ("batches_refused", stats.refused, "Verified batches the hub refused."),
            ("outbox_dropped", hub.dropped, "Own events dropped from a full outbox."),
            (
                "reconciled",
                hub.reconciled,
                "Peers' sends dropped because their open statement no longer listed them "
                "(their first byte or end was lost in transit).",
            ),
            (
                "verified_old_key",
                codec.verified_old,
                "Datagrams verified by a key other than the first (rotation: 0 once every "
                "replica signs with the new key).",
            ),
            (
                "blocks_trimmed",
                codec.trimmed,
                "Own sends whose prefix blocks did not all fit a datagram (tail not sent).",
            ),
        )
        yield by_reason(f"{prefix}_rejected", "Datagrams rejected, by reason.", stats.rejected)
        yield by_reason(f"{prefix}_send_dropped", "Datagrams not sent, by reason.", stats.dropped)
        peers = len(running.transport.peers)
        yield GaugeMetricFamily(f"{prefix}_peers", "Peer addresses sent to.", value=peers)
        yield GaugeMetricFamily(
            f"{prefix}_origins", "Peers heard from within the TTL.", value=len(hub.peers())
        )
