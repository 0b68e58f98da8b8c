"""The body-based routing bootstrap's route table (envoy/bbr.py builds the rest).

Serve's guard routes first (envoy/routes.py), then one route per model name and pool, once the
EPP has named a destination and once while it decides; the entry routes (no model header yet:
every request's first route, and the answer for bodyless requests, the first pool's EPP); the
unknown model's 404; and serve's outside-the-API answers.
"""

from __future__ import annotations

from typing import Any

from poolkeeper.envoy.bbr_params import (
    MODEL_HEADER,
    BbrParams,
    PoolRoute,
    epp_cluster,
    pool_cluster,
    slug,
)
from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    EXT_PROC_PER_ROUTE_TYPE,
    SERVED_HEADER,
    T,
    duration,
)
from poolkeeper.envoy.routes import (
    _json_direct,
    _openai_error,
    _retry_policy,
    guard_routes,
    inference_path_regex,
    method_groups,
    outside_api_routes,
)

# Envoy's own answers (guard routes, paths outside the API) consult neither ext_proc filter.
BOTH_FILTERS = ("bbr", "epp")


def bbr_routes(p: BbrParams) -> list[dict[str, Any]]:
    """Guard routes, then the models' routes, the entry routes (no model header yet: every
    request's first route), the unknown model's 404, and the outside-the-API answers."""
    base = p.base
    served = [
        {
            "header": {"key": SERVED_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    every_path = inference_path_regex(base.inference_paths)
    routed = {"name": DESTINATION_HEADER, "present_match": True}
    # Each pool route twice: once the EPP has named a destination, and while it decides.
    states = (("", routed, True), ("_deciding", {**routed, "invert_match": True}, False))

    def to_pool(
        name: str, route: PoolRoute, match: dict[str, Any], decided: bool
    ) -> dict[str, Any]:
        # No total timeout (a generation can run for minutes); idle timeouts bound dead
        # streams. Until the EPP has named a destination (it clears the route cache, so the
        # route is chosen again), BBR or the EPP may be deciding: a hung one costs a request
        # at most the message timeout, as behind serve's listener (Envoy's ext_proc message
        # timer does not run for FULL_DUPLEX_STREAMED bodies).
        idle_s = base.stream_idle_timeout_s if decided else base.message_timeout_s
        return {
            "name": name,
            "match": match,
            # The body kept for a retry: larger than the client connection's buffer.
            "per_request_buffer_limit_bytes": base.buffer_limit_bytes,
            "route": {
                "cluster": pool_cluster(route.pool),
                "timeout": "0s",
                "idle_timeout": duration(idle_s),
                "retry_policy": _retry_policy(base),
            },
            "response_headers_to_add": served,
            "typed_per_filter_config": {
                "epp": {
                    T: EXT_PROC_PER_ROUTE_TYPE,
                    "overrides": {
                        "grpc_service": {"envoy_grpc": {"cluster_name": epp_cluster(route.pool)}}
                    },
                }
            },
        }

    routes = guard_routes(base, skip=BOTH_FILTERS)
    # The model header exists only once BBR set it, and BBR runs only on an entry route (the
    # others skip it), which checks the path and the method: so these check the path only.
    routes += [
        to_pool(
            f"{slug(route.pool)}_{i}{suffix}",
            route,
            {
                "safe_regex": {"regex": every_path},
                "headers": [{"name": MODEL_HEADER, "string_match": {"exact": model}}, state],
            },
            decided,
        )
        for route in p.pools
        for i, model in enumerate(route.models)
        for suffix, state, decided in states
    ]
    # Entry routes, and the answer for bodyless requests (no model header at all): the first
    # pool's EPP decides.
    no_model = {"name": MODEL_HEADER, "present_match": True, "invert_match": True}
    routes += [
        to_pool(
            f"bodyless{suffix}{state_suffix}",
            p.pools[0],
            {
                "safe_regex": {"regex": inference_path_regex(paths)},
                "headers": [
                    no_model,
                    {"name": ":method", "string_match": {"exact": method}},
                    state,
                ],
            },
            decided,
        )
        for suffix, method, paths in method_groups(base.inference_paths)
        for state_suffix, state, decided in states
    ]
    unknown = _openai_error(
        "no InferencePool serves the requested model", "invalid_request_error", "model_not_found"
    )
    routes.append(
        {
            "name": "no_pool",
            "match": {
                "safe_regex": {"regex": every_path},
                "headers": [{"name": MODEL_HEADER, "present_match": True}],
            },
            **_json_direct(404, unknown, skip=("epp",)),  # BBR has run: it set the header
        }
    )
    return routes + outside_api_routes(base, skip=BOTH_FILTERS)
