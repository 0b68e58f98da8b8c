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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final, TypeVar

from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.datastore.models import (
    EMPTY_MODEL_INDEX,
    ModelIndex,
    ModelResource,
    ModelRoute,
    RewriteRule,
    build_model_index,
)

__all__ = ["ChangeKind", "Datastore", "DatastoreSnapshot", "EndpointSpec", "Listener"]

log = logging.getLogger(__name__)

_NO_METRICS: Final = EndpointMetrics()


K = TypeVar("K")
V = TypeVar("V")


def _frozen(items: Mapping[K, V]) -> Mapping[K, V]:
    return MappingProxyType(dict(items))


def _empty_labels() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """An endpoint as a source knows it: the port and namespace may come from the pool."""

    name: str
    address: str
    port: int | None = None
    namespace: str | None = None  # None: standalone, selectable by pools of any namespace
    labels: Mapping[str, str] = field(default_factory=_empty_labels, compare=False, hash=False)
    engine: str = "vllm"

    @classmethod
    def of(cls, endpoint: Endpoint) -> EndpointSpec:
        """A spec for a fully known endpoint (explicit port and namespace)."""
        return cls(
            endpoint.name,
            endpoint.address,
            endpoint.port,
            endpoint.namespace,
            endpoint.labels,
            endpoint.engine,
        )

    def for_pool(self, pool: AnyInferencePool) -> tuple[Endpoint, ...]:
        """The endpoints this spec is in `pool` (none if the pool does not select it).

        With an explicit port: one endpoint. Without: one per target port of the pool; with
        several target ports (v1 data-parallel ranks) rank i > 0 is named `<name>-rank-<i>`,
        as upstream does.
        """
        if self.namespace is not None and self.namespace != pool.namespace:
            return ()
        if not pool.matches(self.labels):
            return ()
        ports = (self.port,) if self.port is not None else pool.target_ports()
        labels = MappingProxyType(dict(self.labels))
        namespace = self.namespace or pool.namespace
        return tuple(
            Endpoint(
                name=self.name if rank == 0 else f"{self.name}-rank-{rank}",
                address=self.address,
                port=port,
                namespace=namespace,
                labels=labels,
                engine=self.engine,
            )
            for rank, port in enumerate(ports)
        )


class ChangeKind(StrEnum):
    """What a write changed."""

    RESOURCES = "resources"  # pools or models (endpoints may follow from selectors)
    ENDPOINTS = "endpoints"
    METRICS = "metrics"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class DatastoreSnapshot:
    """One consistent view of everything; never changes after it is built."""

    version: int
    pools: Mapping[str, AnyInferencePool]  # pool key `namespace/name` -> pool
    model_index: ModelIndex
    specs: tuple[EndpointSpec, ...]
    metrics: Mapping[str, EndpointMetrics]  # `ip:port` -> latest metrics
    _pool_keys: tuple[str, ...]
    _endpoints_by_pool: Mapping[str, tuple[Endpoint, ...]]
    _endpoint_at: Mapping[str, Endpoint]  # `ip:port` -> endpoint, over all pools

    def pool_keys(self) -> tuple[str, ...]:
        """Pool keys, sorted."""
        return self._pool_keys

    def pool(self, pool_key: str) -> AnyInferencePool | None:
        return self.pools.get(pool_key)

    def models(self, pool_key: str) -> Mapping[str, InferenceModel]:
        """modelName -> accepted InferenceModel in one pool (empty for an unknown pool)."""
        return self.model_index.models(pool_key)

    def resolve(self, model_name: str) -> ModelRoute | None:
        """Where requests for `model_name` go (pool key, model); None if no model serves it."""
        return self.model_index.resolve(model_name)

    def model_names(self) -> tuple[str, ...]:
        """Every servable modelName, sorted."""
        return self.model_index.names()

    def rewrite_rule(self, pool_key: str, model_name: str) -> RewriteRule | None:
        """The InferenceModelRewrite rule for `model_name` in a pool, if any."""
        return self.model_index.rewrite_rule(pool_key, model_name)

    def objective(self, pool_key: str, name: str) -> InferenceObjective | None:
        """The accepted InferenceObjective `name` of a pool, if any."""
        return self.model_index.objective(pool_key, name)

    def endpoints(self, pool_key: str) -> tuple[Endpoint, ...]:
        """The endpoints a pool selects, by name."""
        return self._endpoints_by_pool.get(pool_key, ())

    def states(self, pool_key: str) -> tuple[EndpointState, ...]:
        """The pool's endpoints with their latest metrics (never-scraped ones have age inf)."""
        metrics = self.metrics
        return tuple(
            EndpointState(endpoint, metrics.get(endpoint.hostport, _NO_METRICS))
            for endpoint in self._endpoints_by_pool.get(pool_key, ())
        )

    def all_endpoints(self) -> tuple[Endpoint, ...]:
        """Every selected endpoint once per `ip:port` (what the scrapers poll), by key."""
        return tuple(self._endpoint_at[key] for key in sorted(self._endpoint_at))

    def endpoint(self, key: str) -> Endpoint | None:
        return self._endpoint_at.get(key)

    def metrics_for(self, key: str) -> EndpointMetrics:
        return self.metrics.get(key, _NO_METRICS)

    def is_stale(self, key: str, now: float, staleness_s: float) -> bool:
        """True when the endpoint's last successful scrape is older than `staleness_s`."""
        updated = self.metrics_for(key).updated_at
        return updated <= 0.0 or now - updated > staleness_s

    def stale_keys(self, now: float, staleness_s: float) -> tuple[str, ...]:
        """`ip:port` of every selected endpoint whose metrics are stale (or never came)."""
        return tuple(k for k in sorted(self._endpoint_at) if self.is_stale(k, now, staleness_s))


Listener = Callable[[DatastoreSnapshot, ChangeKind], None]


def _empty_snapshot() -> DatastoreSnapshot:
    return DatastoreSnapshot(
        version=0,
        pools=MappingProxyType({}),
        model_index=EMPTY_MODEL_INDEX,
        specs=(),
        metrics=MappingProxyType({}),
        _pool_keys=(),
        _endpoints_by_pool=MappingProxyType({}),
        _endpoint_at=MappingProxyType({}),
    )


class Datastore:
    """Holds the current snapshot; writers swap in new ones and notify listeners."""

    def __init__(self) -> None:
        self._snapshot = _empty_snapshot()
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
            snapshot = _replace_metrics(current, MappingProxyType(merged))
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


def _replace_metrics(
    snapshot: DatastoreSnapshot, metrics: Mapping[str, EndpointMetrics]
) -> DatastoreSnapshot:
    return DatastoreSnapshot(
        version=snapshot.version + 1,
        pools=snapshot.pools,
        model_index=snapshot.model_index,
        specs=snapshot.specs,
        metrics=metrics,
        _pool_keys=snapshot._pool_keys,
        _endpoints_by_pool=snapshot._endpoints_by_pool,
        _endpoint_at=snapshot._endpoint_at,
    )
