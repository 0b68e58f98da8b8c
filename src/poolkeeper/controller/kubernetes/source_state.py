"""What the Kubernetes resource source is set up with and holds: `KubeSettings` (namespace,
identity, Lease, watch and backoff timings, the pool group, standalone mode) and
`KubeSourceState`, the source's construction (API client, cluster caches, leader elector,
status writer) with the `ResourceSource` questions answered from it (`healthy`, `stale_s`,
`leading`, ...). Following the API server is `source_watch`, starting and running the source
`source`."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from poolkeeper.api.model import InferenceModel, InferenceModelStatus
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.kubernetes.client import KubeApi
from poolkeeper.controller.kubernetes.leader import LeaderElector, LeaseTiming
from poolkeeper.controller.kubernetes.objects import ObjectCache
from poolkeeper.controller.kubernetes.standalone import EndpointSelector
from poolkeeper.controller.kubernetes.state import ClusterState
from poolkeeper.controller.kubernetes.status import StatusWriter
from poolkeeper.datastore.store import Datastore

__all__ = ["KubeSettings", "KubeSourceState", "Sleep"]

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


class KubeSourceState:
    """The Kubernetes source's parts and state (`KubernetesResourceSource` extends this)."""

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

    def _caches(self) -> list[ObjectCache]:
        return self.state.caches()
