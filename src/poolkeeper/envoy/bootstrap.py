"""The Envoy bootstrap `poolkeeper serve` runs (and `poolkeeper envoy-config` prints).

One HTTP listener whose filter chain is ext_proc (to the EPP) then the router (with the
response observer, `observer.py`, its filters between them); its routes are built in
`routes.py`. The EPP names the pod and its fallbacks in `x-gateway-destination-endpoint`
(`ip:port,ip:port,...`, protocol v0.4+) and the same value in `envoy.lb` metadata; a route
matching that header sends the request to the EPP-routed cluster (`override_host` policy, see
`clusters.py`), whose retry policy moves on to the next listed endpoint when one cannot be
reached. Requests the EPP did not route (it is down and the pool is FailOpen) match the next
route: a round-robin cluster over the pool's endpoints, or, for FailClose, a 503 with an
OpenAI error body.

Why client copies of the destination header can never steer traffic: the HTTP connection
manager's *early header mutation* removes every `x-gateway-destination-endpoint*` header (and
`x-envoy-original-dst-host`) before any filter or route sees the request, so the only way the
header exists is the EPP setting it. Response headers name the pod that served
(`x-gateway-destination-endpoint-served`, from the upstream address).

Connection limits (reliability round 2): a connection with no request in progress (a silent
one from accept, a keep-alive one between requests) closes in seconds, and in about one second
as client connections near the overload manager's cap, which sits below the descriptor limit
`serve` gives Envoy; a request has a total timeout no trickle resets.

Everything is a plain dict (JSON is valid YAML, so `envoy -c` takes either).

Its parts: the ext_proc filters, `extproc_filters.py`; the client-facing HTTP connection
manager, `client_hcm.py` (its local replies, `local_replies.py`); the listener, admin and
overload manager, `edge.py`.
"""

from __future__ import annotations

import json
from typing import Any

from poolkeeper.envoy.client_hcm import hcm_filter, http_connection_manager
from poolkeeper.envoy.clusters import clusters
from poolkeeper.envoy.conncap import conncap_access_log, conncap_cluster, conncap_filter, conncap_on
from poolkeeper.envoy.edge import admin_interface, edge_listener, overload_manager
from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    EPP_CLUSTER,
    EXT_PROC_SERVICE,
    FALLBACK_CLUSTER,
    ROUTED_CLUSTER,
    SERVED_HEADER,
    BootstrapParams,
)

__all__ = [
    "DESTINATION_HEADER",
    "EPP_CLUSTER",
    "EXT_PROC_SERVICE",
    "FALLBACK_CLUSTER",
    "ROUTED_CLUSTER",
    "SERVED_HEADER",
    "BootstrapParams",
    "build_bootstrap",
    "render",
]


def build_bootstrap(p: BootstrapParams) -> dict[str, Any]:
    """The complete Envoy bootstrap as a dict."""
    return {
        # File-based EDS (the routed cluster's endpoints) needs a node id and cluster.
        "node": {"id": "poolkeeper", "cluster": "poolkeeper"},
        "admin": admin_interface(p),
        "static_resources": {
            "listeners": [
                edge_listener(
                    p,
                    "gateway",
                    [
                        *([conncap_filter(p)] if conncap_on(p) else []),
                        hcm_filter(http_connection_manager(p)),
                    ],
                    access_log=[conncap_access_log(p)] if conncap_on(p) else [],
                )
            ],
            "clusters": [*clusters(p), *([conncap_cluster(p)] if conncap_on(p) else [])],
        },
        "overload_manager": overload_manager(p),
    }


def render(bootstrap: dict[str, Any]) -> str:
    """JSON text, which Envoy reads as YAML too."""
    return json.dumps(bootstrap, indent=2) + "\n"
