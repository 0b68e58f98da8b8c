"""What the body-based routing bootstrap is built from: the pools behind the BBR listener and
the names derived from them.

`BbrParams` (serve's `BootstrapParams` plus the BBR service and the pools) and `PoolRoute` (one
InferencePool: its model names, its EPP, its model servers); the model header BBR sets, the BBR
cluster's name, and each pool's EPP and model-server cluster names (`epp_cluster`,
`pool_cluster`). envoy/bbr.py builds the bootstrap; envoy/bbr_routes.py its route table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from poolkeeper.envoy.params import BootstrapParams

MODEL_HEADER = "x-gateway-model-name"
BBR_CLUSTER = "bbr"


@dataclass(frozen=True, slots=True)
class PoolRoute:
    """One InferencePool behind the BBR listener."""

    pool: str  # pool key `namespace/name` (cluster names derive from it)
    models: tuple[str, ...]  # values of x-gateway-model-name routed to this pool
    epp: str  # host:port of the pool's Endpoint Picker (ext_proc gRPC)
    endpoints: tuple[str, ...]  # ip:port of the pool's model servers (the EPP picks among them)


@dataclass(frozen=True, slots=True)
class BbrParams:
    base: BootstrapParams  # listener, admin, timeouts and limits (its EPP fields are unused)
    bbr: str  # host:port of the BBR ext_proc service
    pools: tuple[PoolRoute, ...]
    # The per-client-address connection cap (envoy/conncap.py): the listener asks `poolkeeper
    # bbr`'s connection counter (on the BBR cluster) on each connection's first bytes and
    # reports every close to it; fails open when it does not answer.
    client_cap: bool = False


def slug(pool: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", pool.lower()).strip("_")


def epp_cluster(pool: str) -> str:
    return f"epp_{slug(pool)}"


def pool_cluster(pool: str) -> str:
    return f"pool_{slug(pool)}"
