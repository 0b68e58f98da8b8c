"""The RoutingDecision made of a scheduled request: the body rewritten where the target model
differs or a stream's usage chunk is injected, and the ticket its in-flight accounting and
end are kept under (`sends.py`). Also a bodyless request's decision (a random endpoint of the
default pool).

Why apart from the Director: what the answer to Envoy carries is decided here once the
endpoints are known; the Director decides whether, when and where (`director.py`).
"""

from __future__ import annotations

import random

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.requestcontrol.candidates import (
    a_pick_names_responses_itself,
    default_pool,
    pool_candidates,
)
from poolkeeper.requestcontrol.config import RequestHandling
from poolkeeper.requestcontrol.ports import SnapshotView
from poolkeeper.requestcontrol.prepare import Prepared
from poolkeeper.requestcontrol.rewrite import rewrite_body, should_inject_usage
from poolkeeper.requestcontrol.sends import Ticket
from poolkeeper.requestcontrol.types import RoutingDecision, model_renamed


def routing_decision(
    prepared: Prepared,
    key: str,
    candidates: list[EndpointState],
    endpoints: tuple[str, ...],
    *,
    now: float,
    flow: str,
    config: RequestHandling,
    responses_observed: bool,
) -> RoutingDecision:
    """`prepared` sent to `endpoints` (primary first), counted under `key` from `now`."""
    request, parsed, target = prepared.request, prepared.parsed, prepared.target
    server_names_model = a_pick_names_responses_itself(candidates, endpoints)
    # With the response observer, a response whose model name needs no rewrite never passes
    # the EPP, so nothing could strip a usage chunk injected into it.
    passes_epp = not responses_observed or server_names_model or model_renamed(target, parsed.model)
    inject = should_inject_usage(parsed, enabled=config.inject_stream_usage and passes_epp)
    body = None
    if inject or target != parsed.model:
        body = rewrite_body(
            parsed.payload,
            model=target if target != parsed.model else None,
            include_usage=inject,
        )
    return RoutingDecision(
        request_id=request.request_id,
        endpoints=endpoints,
        pool=prepared.pool_key,
        model_name=parsed.model,
        target_model=target,
        criticality=prepared.criticality,
        priority=prepared.priority,
        stream=parsed.stream,
        prompt_tokens=parsed.prompt_tokens,
        body=body,
        include_usage_injected=inject,
        server_names_model=server_names_model,
        ticket=Ticket(
            key, endpoints[0], parsed.prompt_tokens, now, flow, prepared.criticality, model=target
        ),
    )


def bodyless_decision(
    request_id: str,
    snapshot: SnapshotView,
    config: RequestHandling,
    subset: frozenset[str] | None,
    *,
    rng: random.Random,
    key: str,
    now: float,
) -> RoutingDecision:
    """A bodyless request (e.g. GET /v1/models) to random endpoints of the default pool (within
    `subset`). Keyed like any send: its end is told the learners, and a bare client id could
    name another send's key."""
    pool_key = default_pool(snapshot, config.default_pool)
    states = pool_candidates(snapshot, pool_key, subset)
    count = min(len(states), 1 + config.fallback_endpoints)
    picked = rng.sample(range(len(states)), count)
    return RoutingDecision(
        request_id=request_id,
        endpoints=tuple(states[i].key for i in picked),
        pool=pool_key,
        ticket=Ticket(key, "", 0, now),
    )
