"""Which pool and which endpoints a request may go to: the default pool (bodyless requests,
and models no resource names), the pool's endpoints narrowed by the proxy's subset hint (by IP,
as upstream), and the scheduler's targets kept to those candidates and capped by
`fallbackEndpoints`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from poolkeeper.api.pool import V1 as POOL_V1
from poolkeeper.backend.engines import names_responses_itself
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import NoReadyEndpoint
from poolkeeper.hostport import host_of
from poolkeeper.requestcontrol.config import RequestHandling, UnknownModelPolicy
from poolkeeper.requestcontrol.ports import SnapshotView
from poolkeeper.scheduling.types import SchedulingResult

log = logging.getLogger("poolkeeper.requestcontrol.director")  # the Director's lines, as before


def a_pick_names_responses_itself(
    candidates: Sequence[EndpointState], endpoints: Sequence[str]
) -> bool:
    """Whether any server the request may go to (pick or fallback) names its responses after
    itself, whatever the request's model (llama.cpp)."""
    chosen = set(endpoints)
    return any(names_responses_itself(s.endpoint.engine) for s in candidates if s.key in chosen)


def default_pool(snapshot: SnapshotView, wanted: str | None) -> str:
    """`requestHandling.defaultPool` (`wanted`), else the only pool, else the first by key."""
    pool_keys = snapshot.pool_keys()
    if wanted is not None:
        if wanted not in pool_keys:
            raise NoReadyEndpoint(f"default pool {wanted} is not loaded")
        return wanted
    if not pool_keys:
        raise NoReadyEndpoint("no InferencePool is loaded")
    return pool_keys[0]


def unknown_model_pool(snapshot: SnapshotView, config: RequestHandling) -> str | None:
    """The pool a model no resource names goes to, or None to refuse it (404).

    `unknownModelPolicy` unset follows the default pool's API generation: an
    `inference.networking.k8s.io/v1` pool passes any model through (upstream v1.x and
    llm-d-router have no model list), the x-k8s generations keep their 404."""
    policy = config.unknown_model_policy
    if policy is UnknownModelPolicy.REJECT:
        return None
    if policy is not None:
        return default_pool(snapshot, config.default_pool)
    try:
        pool_key = default_pool(snapshot, config.default_pool)
    except NoReadyEndpoint:
        return None
    pool = snapshot.pool(pool_key)
    return pool_key if pool is not None and pool.api_version == POOL_V1 else None


def pool_candidates(
    snapshot: SnapshotView, pool_key: str, subset: frozenset[str] | None
) -> list[EndpointState]:
    """The pool's endpoints the request may go to (in the subset hint's, when it has one)."""
    states = list(snapshot.states(pool_key))
    if subset is not None:
        ips = {host_of(entry) for entry in subset}
        states = [s for s in states if s.endpoint.address in ips]
        if not states:
            raise NoReadyEndpoint(
                f"no endpoint of pool {pool_key} is in the proxy's endpoint subset"
            )
    if not states:
        raise NoReadyEndpoint(f"pool {pool_key} has no ready endpoint")
    return states


def destinations(
    result: SchedulingResult, candidates: Sequence[EndpointState], fallback_endpoints: int
) -> tuple[str, ...]:
    """The scheduler's targets as `ip:port`, best first, capped by `fallbackEndpoints`.

    Only candidates can be destinations: whatever a (buggy or custom) plugin returns, the
    gateway never sends a request to an address outside the pool (reliability F4).
    """
    allowed = {s.key for s in candidates}
    out: list[str] = []
    for target in result.targets:
        key = target.key
        if key not in allowed:
            log.error("scheduler returned %s, which is not a candidate; ignored", key)
        elif key not in out:
            out.append(key)
            if len(out) > fallback_endpoints:
                break
    return tuple(out)
