"""`KubernetesResourceSource`: pools, models and Pods from the API server → the datastore.

The Kubernetes implementation of the `ResourceSource` seam (`controller/source.py`).

start(): list InferencePools (x-k8s v1alpha2, or v1alpha1 where only that is served; k8s.io v1),
InferenceModels (v1alpha2, else v1alpha1), InferenceObjectives and InferenceModelRewrites
(v1alpha2) and Pods in the namespace (a resource the API server does not serve counts as empty
and is looked for again later), apply them in one datastore write, and yield the GatewayConfig
given at construction. An unreachable API server is retried with backoff for
`start_timeout_s`, then a ConfigError says why.

run(): one follower per kind watches from the list's resourceVersion (bookmarks keep it fresh)
and applies every event as it comes: a Pod that turns NotReady leaves the datastore on that
one event. When a watch fails (410 Gone, a dropped stream, the API server down), the follower
marks itself stale, backs off with jitter (a 429 waits the server's Retry-After instead),
re-lists and prunes whatever vanished in the gap, then watches again; a successful list
resets the backoff, so every replica is back within one capped delay (`backoff_max_s`, 4 s)
of the API server's return. A 403 is logged at ERROR with the API server's own message (the
verb and resource refused), on every attempt. Beside them: the leader election and the status
writer (statuses are reconciled after every resource change, when leadership is gained, and
every `resync_s` from the cache, writing only what differs).

healthy(): the first full sync is done. As upstream's EPP, readiness never depends on the API
server afterwards: through an outage the datastore keeps the last known state and routing goes
on; `stale_s()` says for how long it has not been kept in step (a metric and the retry logs).
run() releases the Lease when cancelled, whatever else ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from poolkeeper.api.model import InferenceModel, InferenceModelStatus
from poolkeeper.api.status import compute_model_statuses
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.kubernetes.backoff import Backoff
from poolkeeper.controller.kubernetes.client import (
    ApiUnavailable,
    Forbidden,
    Gone,
    KubeApi,
    NotFound,
    Throttled,
)
from poolkeeper.controller.kubernetes.leader import LeaderElector, LeaseTiming
from poolkeeper.controller.kubernetes.objects import ObjectCache
from poolkeeper.controller.kubernetes.standalone import EndpointSelector
from poolkeeper.controller.kubernetes.state import ClusterState
from poolkeeper.controller.kubernetes.status import StatusWriter
from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import ConfigError

__all__ = ["KubeSettings", "KubernetesResourceSource"]

log = logging.getLogger(__name__)

Sleep = Callable[[float], Any]


@dataclass(frozen=True, slots=True)
class KubeSettings:
    namespace: str
    identity: str  # this replica (the pod name in a cluster): the Lease holder
    pool_names: tuple[str, ...] = ()  # empty: every pool in the namespace
    write_status: bool = True
    lease_name: str = "poolkeeper-epp"
    lease: LeaseTiming = field(default_factory=LeaseTiming)
    watch_timeout_s: int = 300  # the API server ends each watch after this; it is resumed
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 4.0  # also bounds how long after the API server's return replicas agree
    start_timeout_s: float = 30.0
    resync_s: float = 300.0  # status reconcile from the cache, as controller-runtime's resync
    field_manager: str = "poolkeeper-epp"  # stable across pods: one managedFields entry
    pool_group: str = ""  # only this group's InferencePools (upstream --pool-group); "": all
    # Take part in the Lease even without status writes (upstream --ha-enable-leader-election:
    # readiness follows leadership, see `leading`).
    leader_election: bool = False
    # Upstream's --endpoint-selector mode: no InferencePool, Pods only (standalone.py).
    standalone: EndpointSelector | None = None


class KubernetesResourceSource:
    """Feeds a datastore from the API server and keeps it in step (a `ResourceSource`)."""

    def __init__(
        self,
        api: KubeApi,
        datastore: Datastore,
        settings: KubeSettings,
        gateway_config: GatewayConfig | None = None,
        *,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        clock: Callable[[], float] = time.monotonic,
        elector: LeaderElector | None = None,
    ) -> None:
        self.api = api
        self.settings = settings
        self.gateway_config = gateway_config or GatewayConfig.default()
        self._datastore = datastore
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._now = now
        self._clock = clock
        self.state = ClusterState(
            settings.pool_names,
            self.gateway_config.spec.scraping.engine_for,
            settings.pool_group,
            settings.standalone,
        )
        self._degraded: dict[str, float] = {}  # follower -> when it lost the watch (clock)
        self._statuses: Mapping[str, InferenceModelStatus] = MappingProxyType({})
        self._models_by_key: dict[str, InferenceModel] = {}
        self._status_due = asyncio.Event()
        self.elector = elector or LeaderElector(
            api,
            settings.lease_name,
            settings.identity,
            timing=settings.lease,
            field_manager=settings.field_manager,
        )
        self.elector.on_change = lambda leader: self._status_due.set() if leader else None
        self.status_writer = StatusWriter(
            api, field_manager=settings.field_manager, allowed=self.elector.is_leader, now=now
        )
        self.relists = 0  # full lists applied after the first sync (for tests and logs)
        self.resyncs = 0  # periodic status reconciles from the cache

    # --- the ResourceSource protocol ---------------------------------------------------------

    def describe(self) -> str:
        pools = ", ".join(self.settings.pool_names) or "every pool"
        return f"kubernetes namespace {self.settings.namespace} ({pools})"

    def statuses(self) -> Mapping[str, InferenceModelStatus]:
        return self._statuses

    def healthy(self) -> bool:
        """The first full sync is done (readiness, as upstream: API trouble later never takes
        the data plane down; the last known state is served, see `stale_s`)."""
        return self.synced()

    def leading(self) -> bool | None:
        """Whether this replica holds the Lease; None when it takes no part in one (status
        writes off and no leader election asked for)."""
        if not (self.settings.write_status or self.settings.leader_election):
            return None
        return self.elector.is_leader()

    def in_step(self) -> bool:
        """Every watch is running (none re-listing after a failure)."""
        return self.synced() and not self._degraded

    def stale_s(self) -> float:
        """For how long the datastore has not been kept in step (0 while every watch runs)."""
        if not self._degraded:
            return 0.0
        return max(0.0, self._clock() - min(self._degraded.values()))

    def synced(self) -> bool:
        return all(c.synced for c in self._caches())

    async def start(self) -> GatewayConfig:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.start_timeout_s
        backoff = self._backoff()
        while True:
            try:
                for cache in self._caches():
                    await self._list(cache)
                break
            except Forbidden as exc:
                # RBAC is not going to change by itself within the start timeout: say so now.
                log.error("permission denied listing resources: %s", exc)
                raise ConfigError(
                    f"the Kubernetes API server refused to list resources in namespace "
                    f"{self.settings.namespace} ({exc}); the EPP's Role needs list and watch on "
                    f"them (deploy/rbac.yaml)"
                ) from exc
            except ApiUnavailable as exc:
                if loop.time() >= deadline:
                    raise ConfigError(
                        f"cannot list resources in namespace {self.settings.namespace} from the "
                        f"Kubernetes API server: {exc}"
                    ) from exc
                delay = self._delay(backoff, exc)
                log.warning("listing resources failed (%s); retrying in %.1fs", exc, delay)
                await self._sleep(delay)
        self._apply(resources=True)
        if not self._datastore.snapshot().pool_keys():
            wanted = ", ".join(self.settings.pool_names) or "any"
            log.warning(
                "no InferencePool (%s) in namespace %s yet; waiting for one",
                wanted,
                self.settings.namespace,
            )
        return self.gateway_config

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(self._follow(c), name=f"watch {c.kind}") for c in self._caches()
        ]
        if self.settings.write_status or self.settings.leader_election:
            tasks.append(asyncio.create_task(self.elector.run(self._sleep), name="lease"))
        if self.settings.write_status:
            tasks.append(asyncio.create_task(self._write_statuses(), name="status"))
            tasks.append(asyncio.create_task(self._resync_loop(), name="resync"))
        try:
            # asyncio.wait, not gather: cancelling run() must reach every task exactly once
            # (below). A gather cancels its children itself and returns at the first one
            # cancelled, so a second cancel landed inside the elector's Lease release.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:  # none should end (each catches its own errors): a bug
                if not task.cancelled() and task.exception() is not None:
                    log.error("%s stopped", task.get_name(), exc_info=task.exception())
        finally:
            for task in tasks:
                task.cancel()
            # Shielded: a second cancel of run() (shutdown timing out) must not cut the
            # Lease release short; it takes one GET and one PUT.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
            await self.api.close()

    # --- listing and watching ----------------------------------------------------------------

    def _caches(self) -> list[ObjectCache]:
        return self.state.caches()

    def _backoff(self) -> Backoff:
        s = self.settings
        return Backoff(s.backoff_initial_s, s.backoff_max_s, rng=self._rng)

    def _delay(self, backoff: Backoff, exc: Exception) -> float:
        """How long to wait after `exc`: a 429's Retry-After (plus up to 10% jitter, so the
        replicas it turned away do not all come back in the same instant), else the backoff."""
        if isinstance(exc, Throttled):
            return backoff.after(exc.retry_after_s)
        return backoff.next()

    async def _list(self, cache: ObjectCache) -> list[str]:
        """List the first served version of the cache's objects, replace and prune. None
        served (the CRD is not installed): empty, and `version` None so it is looked for again."""
        items: list[dict[str, Any]] = []
        version: str | None = None
        cache.installed = False
        for kind in cache.candidates or (cache.kind,):
            try:
                items, version = await self.api.list(kind)
            except NotFound:
                continue
            if kind != cache.kind:
                log.info("watching %s (the version the API server serves)", kind)
                cache.kind = kind
            cache.installed = True
            break
        pruned = cache.replace(items, version)
        for key in pruned:
            log.info("%s %s vanished while the watch was down; pruned", cache.kind.kind, key)
        return pruned

    async def _follow(self, cache: ObjectCache) -> None:
        """Watch one kind forever: apply events; on failure back off, re-list, prune, resume."""
        backoff = self._backoff()
        name = str(cache.kind)
        relist = False
        while True:
            try:
                if relist or cache.version is None:
                    await self._list(cache)
                    self.relists += 1
                    self._apply(resources=cache is not self.state.pods_cache)
                    relist = False
                    backoff.reset()  # in step again: the next failure starts small
                lost = self._degraded.pop(name, None)
                if lost is not None:
                    log.info("watch of %s is back; in step after %.1fs", name, self._clock() - lost)
                if cache.version is None:  # not served: look again later
                    await self._sleep(self.settings.backoff_max_s)
                    relist = True
                    continue
                events = 0
                async for event_type, obj in self.api.watch(
                    cache.kind, cache.version, timeout_s=self.settings.watch_timeout_s
                ):
                    events += 1
                    backoff.reset()
                    if cache.apply_event(event_type, obj):
                        self._apply(resources=cache is not self.state.pods_cache)
                # The server ended the watch (timeoutSeconds): resume from the last version;
                # after a stream with no event at all, not at once (no hot loop against a
                # server that keeps closing streams).
                if not events:
                    await self._sleep(backoff.next())
            except asyncio.CancelledError:
                raise
            except Gone:
                # The first 410 re-lists at once; repeated ones (no event in between) back off.
                self._degraded.setdefault(name, self._clock())
                relist = True
                delay = backoff.next() if backoff.failures else 0.0
                backoff.failures = max(backoff.failures, 1)
                log.info("watch of %s: resource version too old (410); re-listing in %.2fs",
                         name, delay)  # fmt: skip
                if delay:
                    await self._sleep(delay)
            except Exception as exc:  # ApiUnavailable, a dropped stream, bad JSON
                self._degraded.setdefault(name, self._clock())
                relist = True
                delay = self._delay(backoff, exc)
                message = "watch of %s failed (%s); serving the last known state (%.1fs stale); "
                log.log(
                    logging.ERROR if isinstance(exc, Forbidden) else logging.WARNING,
                    message + "re-listing in %.2fs",
                    name,
                    exc,
                    self.stale_s(),
                    delay,
                )
                await self._sleep(delay)

    # --- applying to the datastore -----------------------------------------------------------

    def _apply(self, *, resources: bool) -> None:
        state = self.state
        if not resources:
            self._datastore.set_endpoints(state.endpoints(), source="k8s")
            return
        models = state.models()
        snapshot = self._datastore.set_all(
            state.pools(), [*models, *state.policies()], state.endpoints(), source="k8s"
        )
        verdicts = snapshot.model_index.verdicts
        self._models_by_key = {m.key: m for m in models}
        self._statuses = MappingProxyType(compute_model_statuses(models, verdicts, now=self._now()))
        self._status_due.set()

    # --- status --------------------------------------------------------------------------------

    async def reconcile_statuses(self) -> int:
        """Write the statuses that differ now (only as leader); returns the writes made."""
        if not self.settings.write_status or not self.elector.is_leader():
            return 0
        verdicts = self._datastore.snapshot().model_index.verdicts
        kind = self.state.models_cache.kind
        return await self.status_writer.reconcile(kind, self._models_by_key, verdicts)

    async def _write_statuses(self) -> None:
        while True:
            await self._status_due.wait()
            self._status_due.clear()
            with contextlib.suppress(ApiUnavailable):
                await self.reconcile_statuses()

    async def _resync_loop(self) -> None:
        while True:
            await self._sleep(self.settings.resync_s)
            self.resyncs += 1
            self._status_due.set()
