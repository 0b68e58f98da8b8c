"""Upstream's `--endpoint-selector` mode: no InferencePool; the endpoints are the Ready Pods of
the namespace that a label selector matches, on the given target ports.

As llm-d-router's EPP: only Pods are watched (no InferencePool, objective or rewrite objects:
the standalone chart grants `pods` get/list/watch only), the pool is named after the EPP's own
Deployment, and the selector may be set-based (`k in (a,b)`, `!k`, ...). The Pods are listed
whole and selected here, as upstream's Pod reconciler does.

Inside poolkeeper the selection is a v1 InferencePool object made in memory (`pool_object`):
its selector is one marker label that `select` adds to every Pod the selector matches, so the
rest of poolkeeper (endpoints per target port, `-rank-<i>` names) works unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from poolkeeper.datastore.snapshot import EndpointSpec

__all__ = ["MARKER", "EndpointSelector", "Term"]

MARKER: Final = "poolkeeper.dev/endpoint-selector"  # the in-memory pool's selector label

# (key, operator, values): operators `=`, `!=`, `in`, `notin`, `exists`, `!` (absent).
Term = tuple[str, str, tuple[str, ...]]


def _term_matches(term: Term, labels: Mapping[str, str]) -> bool:
    key, op, values = term
    value = labels.get(key)
    if op in ("=", "in"):
        return value is not None and value in values
    if op in ("!=", "notin"):  # also matches Pods without the label, as Kubernetes does
        return value is None or value not in values
    if op == "exists":
        return value is not None
    return value is None  # "!"


@dataclass(frozen=True, slots=True)
class EndpointSelector:
    pool_name: str  # the EPP's Deployment (upstream: from POD_NAME)
    namespace: str
    terms: tuple[Term, ...]
    target_ports: tuple[int, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(_term_matches(term, labels) for term in self.terms)

    def pool_object(self) -> dict[str, Any]:
        """The in-memory `inference.networking.k8s.io/v1` InferencePool it stands for."""
        return {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": self.pool_name, "namespace": self.namespace},
            "spec": {
                "selector": {"matchLabels": {MARKER: self.pool_name}},
                "targetPorts": [{"number": port} for port in self.target_ports],
            },
        }

    def select(self, spec: EndpointSpec) -> EndpointSpec | None:
        """The Pod's endpoint spec marked as the pool's, or None if the selector skips it."""
        if not self.matches(spec.labels):
            return None
        return dataclasses.replace(
            spec, labels=MappingProxyType({**spec.labels, MARKER: self.pool_name})
        )
