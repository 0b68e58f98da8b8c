"""The datastore: pools, models, endpoints and their latest metrics, read as immutable snapshots.

Writers (resource sources, scrapers) replace parts of the state copy-on-write and swap in a new
`DatastoreSnapshot`; readers (the Director, the scheduler, status and health) take
`snapshot()` once per decision and never lock or see a half-applied change.

What a snapshot derives, once per resource write, so reads are cheap:
- `model_index`: which InferenceModel each modelName means (`datastore/models.py`: oldest wins;
  missing pool or all-zero weights do not compete), with every model's Accepted verdict, and the
  InferenceObjectives and InferenceModelRewrite rules of each pool (upstream v1.x kinds, handed
  in with the models). Metrics writes keep the same index object.
- `endpoints(pool_key)`: the endpoints a pool selects: its selector matches the endpoint's labels
  and, for endpoints with a namespace (pods), the namespaces agree (standalone endpoints from a
  GatewayConfig have none and may be selected by a pool of any namespace). An endpoint without
  a port gets the pool's target port (one endpoint per port when a v1 pool lists several).
- metrics are kept by `ip:port`; metrics of an `ip:port` that no pool selects any more, or that
  now belongs to a different endpoint (pod recreated elsewhere, IP reused), are dropped, and
  updates for unknown keys are ignored (a late scrape of a removed endpoint).

Several sources may feed endpoints and resources (`source=`): files today, Kubernetes later;
the snapshot is their union.

This module owns the writers (`Datastore`, its listeners); the snapshot and its reads, and
`EndpointSpec`, are `snapshot`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import TypeVar

from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics
from poolkeeper.datastore.models import ModelResource, build_model_index
from poolkeeper.datastore.snapshot import (
    DatastoreSnapshot,
    EndpointSpec,
    empty_snapshot,
    replace_metrics,
)

__all__ = ["ChangeKind", "Datastore", "Listener"]

log = logging.getLogger(__name__)


K = TypeVar("K")
V = TypeVar("V")


def _frozen(items: Mapping[K, V]) -> Mapping[K, V]:
    return MappingProxyType(dict(items))


class ChangeKind(StrEnum):
    """What a write changed."""

    RESOURCES = "resources"  # pools or models (endpoints may follow from selectors)
    ENDPOINTS = "endpoints"
    METRICS = "metrics"
    CLEARED = "cleared"


Listener = Callable[[DatastoreSnapshot, ChangeKind], None]


class Datastore:
    """Holds the current snapshot; writers swap in new ones and notify listeners."""

    def __init__(self) -> None:
        self._snapshot = empty_snapshot()
        self._pools_by_source: dict[str, tuple[AnyInferencePool, ...]] = {}
        self._models_by_source: dict[str, tuple[ModelResource, ...]] = {}
        self._specs_by_source: dict[str, tuple[EndpointSpec, ...]] = {}
        self._listeners: list[tuple[Listener, bool]] = []
        self._write_lock = threading.Lock()  # writers only; readers just read `_snapshot`

    def snapshot(self) -> DatastoreSnapshot:
        """The current snapshot (a plain attribute read: no lock, never partial)."""
        return self._snapshot

    # --- writers -----------------------------------------------------------------------------

    def set_resources(
        self,
        pools: Iterable[AnyInferencePool],
        models: Iterable[ModelResource],
        *,
        source: str = "files",
    ) -> DatastoreSnapshot:
        """Replace the pools and models (InferenceModels, InferenceObjectives and
        InferenceModelRewrites) one source provides."""
        with self._write_lock:
            self._pools_by_source[source] = tuple(pools)
            self._models_by_source[source] = tuple(models)
            snapshot = self._rebuild()
        self._notify(snapshot, ChangeKind.RESOURCES)
        return snapshot

    def set_all(
        self,
        pools: Iterable[AnyInferencePool],
        models: Iterable[ModelResource],
        endpoints: Iterable[EndpointSpec | Endpoint],
        *,
        source: str = "files",
    ) -> DatastoreSnapshot:
        """Replace one source's pools, models and endpoints in a single snapshot swap."""
        specs = tuple(e if isinstance(e, EndpointSpec) else EndpointSpec.of(e) for e in endpoints)
        with self._write_lock:
            self._pools_by_source[source] = tuple(pools)
            self._models_by_source[source] = tuple(models)
            self._specs_by_source[source] = specs
            snapshot = self._rebuild()
        self._notify(snapshot, ChangeKind.RESOURCES)
        return snapshot

    def set_endpoints(
        self, endpoints: Iterable[EndpointSpec | Endpoint], *, source: str = "files"
    ) -> DatastoreSnapshot:
        """Replace the endpoints one source provides (specs, or fully known Endpoints)."""
        specs = tuple(e if isinstance(e, EndpointSpec) else EndpointSpec.of(e) for e in endpoints)
        with self._write_lock:
            self._specs_by_source[source] = specs
            snapshot = self._rebuild(resources=False)
        self._notify(snapshot, ChangeKind.ENDPOINTS)
        return snapshot

    def update_metrics(self, key: str, metrics: EndpointMetrics) -> bool:
        """Store the latest metrics of `ip:port`; False (ignored) if no pool selects it."""
        with self._write_lock:
            current = self._snapshot
            if key not in current._endpoint_at:
                return False
            merged = dict(current.metrics)
            merged[key] = metrics
            snapshot = replace_metrics(current, MappingProxyType(merged))
            self._snapshot = snapshot
        self._notify(snapshot, ChangeKind.METRICS)
        return True

    def clear(self, *, source: str | None = None) -> DatastoreSnapshot:
        """Forget everything one source provided (all sources when None)."""
        with self._write_lock:
            for table in (self._pools_by_source, self._models_by_source, self._specs_by_source):
                if source is None:
                    table.clear()
                else:
                    table.pop(source, None)
            snapshot = self._rebuild()
        self._notify(snapshot, ChangeKind.CLEARED)
        return snapshot

    def subscribe(self, listener: Listener, *, metrics: bool = False) -> Callable[[], None]:
        """Call `listener(snapshot, kind)` after every write (metrics writes only if asked).

        Listeners run synchronously in the writer's thread after the swap; they must be quick
        (schedule work, don't do it). Their exceptions are logged and swallowed. Returns a
        function that unsubscribes.
        """
        entry = (listener, metrics)
        self._listeners.append(entry)

        def unsubscribe() -> None:
            if entry in self._listeners:
                self._listeners.remove(entry)

        return unsubscribe

    # --- internals ---------------------------------------------------------------------------

    def _rebuild(self, *, resources: bool = True) -> DatastoreSnapshot:
        """A new snapshot from every source's tables; `resources=False` (an endpoint write)
        keeps the model index, since pools and models did not change."""
        previous = self._snapshot
        pools: dict[str, AnyInferencePool] = {}
        for source in sorted(self._pools_by_source):
            for pool in self._pools_by_source[source]:
                pools.setdefault(pool.key, pool)  # first source (by name) wins a clash
        models = [m for s in sorted(self._models_by_source) for m in self._models_by_source[s]]
        specs = tuple(sp for s in sorted(self._specs_by_source) for sp in self._specs_by_source[s])
        model_index = (
            build_model_index(pools.values(), models) if resources else previous.model_index
        )
        endpoints_by_pool: dict[str, tuple[Endpoint, ...]] = {}
        endpoint_at: dict[str, Endpoint] = {}
        for pool_key in sorted(pools):
            selected: dict[str, Endpoint] = {}
            for spec in specs:
                for endpoint in spec.for_pool(pools[pool_key]):
                    selected.setdefault(endpoint.hostport, endpoint)
                    endpoint_at.setdefault(endpoint.hostport, endpoint)
            endpoints_by_pool[pool_key] = tuple(sorted(selected.values(), key=lambda e: e.name))
        # Keep metrics only where the same endpoint still sits at the same ip:port.
        kept = {
            key: m
            for key, m in previous.metrics.items()
            if key in endpoint_at and previous._endpoint_at.get(key) == endpoint_at[key]
        }
        snapshot = DatastoreSnapshot(
            version=previous.version + 1,
            pools=_frozen(pools),
            model_index=model_index,
            specs=specs,
            metrics=_frozen(kept),
            _pool_keys=tuple(sorted(pools)),
            _endpoints_by_pool=_frozen(endpoints_by_pool),
            _endpoint_at=_frozen(endpoint_at),
        )
        self._snapshot = snapshot
        return snapshot

    def _notify(self, snapshot: DatastoreSnapshot, kind: ChangeKind) -> None:
        for listener, wants_metrics in tuple(self._listeners):
            if kind is ChangeKind.METRICS and not wants_metrics:
                continue
            try:
                listener(snapshot, kind)
            except Exception:
                log.exception("datastore listener %r failed on a %s change", listener, kind)
