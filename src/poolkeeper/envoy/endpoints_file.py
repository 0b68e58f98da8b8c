"""The endpoint list of the EPP-routed cluster, as a file stock Envoy watches (file-based EDS).

The EPP names the primary endpoint and its fallbacks in `x-gateway-destination-endpoint`
(`ip:port,ip:port,...`, protocol v0.4+). Envoy's `override_host` load-balancing policy sends the
request to the first and retries on the next ones, but only picks hosts its cluster knows. So
the cluster lists every endpoint of every pool, and this file keeps that list current when the
pools change (hot reload): Envoy reloads it when it is renamed into its directory
(`path_config_source` with `watched_directory`), so it is always written whole, via a temporary
file and `os.replace`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from poolkeeper.envoy.params import ROUTED_CLUSTER, T, lb_endpoints

CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def load_assignment(hostports: Iterable[str]) -> dict[str, Any]:
    """The ClusterLoadAssignment of the routed cluster (sorted, duplicates dropped)."""
    hosts = sorted(set(hostports))
    return {
        "cluster_name": ROUTED_CLUSTER,
        "endpoints": [{"lb_endpoints": lb_endpoints(hosts)}] if hosts else [],
    }


class EndpointsFile:
    """Writes the routed cluster's endpoints for Envoy; rewrites only when they changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.version = 0
        self._current: frozenset[str] | None = None

    def write(self, hostports: Iterable[str]) -> bool:
        """Write the list if it differs from the last one written; True when written."""
        hosts = frozenset(hostports)
        if hosts == self._current:
            return False
        self.version += 1
        body = {
            "version_info": str(self.version),
            "resources": [{T: CLA_TYPE, **load_assignment(hosts)}],
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, self.path)
        self._current = hosts
        return True
