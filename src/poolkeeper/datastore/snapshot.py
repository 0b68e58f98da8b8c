"""`DatastoreSnapshot`: one consistent, immutable view of the pools, models, endpoints and
their latest metrics, with the reads the Director, the scheduler, status and health make
(`states`, `resolve`, `stale_keys`, ...); and `EndpointSpec`, an endpoint as a source knows
it, which a pool's selector and target ports turn into endpoints (`for_pool`). The writers
that build snapshots are `store.Datastore`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.datastore.models import EMPTY_MODEL_INDEX, ModelIndex, ModelRoute, RewriteRule

_NO_METRICS: Final = EndpointMetrics()

# (snapshot version, the pool's endpoints, the metrics, the states made of them)
_StatesMemo = tuple[
    int, tuple[Endpoint, ...], Mapping[str, EndpointMetrics], tuple[EndpointState, ...]
]


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
    # pool key -> (version, its endpoints, the metrics, `states`' answer for them) of the
    # newest snapshot that read it: shared by the snapshots that differ only in metrics
    # (`replace_metrics`), so `states` makes a new `EndpointState` only where an endpoint was
    # scraped since (a memo: never what a read sees, only whether it gets the same object).
    _states: dict[str, _StatesMemo] = field(default_factory=dict, compare=False, repr=False)

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
        """The pool's endpoints with their latest metrics (never-scraped ones have age inf).

        One object per endpoint and scrape: an endpoint not scraped since the last call (of
        this snapshot or one it was made from by `replace_metrics`) is the same object as
        then, so the values kept per state downstream (`InflightTracker.apply`, `columns.py`,
        compared by identity) see it unchanged; a scrape (a new metrics object) makes a new
        one. Safe from any thread: each reused state is checked against this snapshot's own
        endpoints and metrics, whichever snapshot wrote the memo last (two reads at once may
        leave an older snapshot's entry: the next read then builds the scraped states again)."""
        endpoints = self._endpoints_by_pool.get(pool_key, ())
        metrics = self.metrics
        memo = self._states
        kept = memo.get(pool_key)
        # (`kept[1] is endpoints` always holds today: only `replace_metrics` passes the memo on,
        # with the same endpoints; a guard should another path ever share it)
        if kept is not None and kept[1] is endpoints:
            if kept[2] is metrics:
                return kept[3]
            at = metrics.get
            out = tuple(
                s if s.metrics is (m := at(s.endpoint.hostport, _NO_METRICS))
                else EndpointState(s.endpoint, m)
                for s in kept[3]
            )  # fmt: skip
        else:
            out = tuple(
                EndpointState(endpoint, metrics.get(endpoint.hostport, _NO_METRICS))
                for endpoint in endpoints
            )
        if kept is None or kept[0] <= self.version:  # (an older snapshot's read keeps it)
            memo[pool_key] = (self.version, endpoints, metrics, out)
        return out

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


def empty_snapshot() -> DatastoreSnapshot:
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


def replace_metrics(
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
        _states=snapshot._states,
    )
