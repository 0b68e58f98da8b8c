"""RBAC for the API-server double: the rules a set of manifests grants one ServiceAccount, and
the check kube-apiserver's RBAC authorizer makes with them.

`granted(docs, namespace, service_account)` reads Roles, ClusterRoles, RoleBindings and
ClusterRoleBindings (as `helm template` renders them) and returns the rules bound to
`system:serviceaccount:NS:NAME`: a RoleBinding's rules hold in its own namespace only, a
ClusterRoleBinding's everywhere. `allows(rules, ...)` is the authorizer's question: is there a
rule whose apiGroups, resources (a plural or `plural/subresource`) and verbs cover the request
(`*` covering anything), in a namespace it holds in? Aggregated ClusterRoles, resourceNames and
non-resource URLs other than as recorded are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    namespace: str | None  # None: cluster-wide (a ClusterRoleBinding)
    non_resource_urls: frozenset[str] = frozenset()

    def covers(self, group: str, resource: str, verb: str, namespace: str | None) -> bool:
        if self.namespace is not None and namespace != self.namespace:
            return False
        return (
            bool({group, "*"} & self.groups)
            and bool({resource, "*"} & self.resources)
            and bool({verb, "*"} & self.verbs)
        )


def _rules(role: Mapping[str, Any], namespace: str | None) -> list[Rule]:
    return [
        Rule(
            groups=frozenset(r.get("apiGroups") or ()),
            resources=frozenset(r.get("resources") or ()),
            verbs=frozenset(r.get("verbs") or ()),
            namespace=namespace,
            non_resource_urls=frozenset(r.get("nonResourceURLs") or ()),
        )
        for r in role.get("rules") or ()
    ]


def _binds(binding: Mapping[str, Any], namespace: str, service_account: str) -> bool:
    default_ns = (binding.get("metadata") or {}).get("namespace")
    return any(
        s.get("kind") == "ServiceAccount"
        and s.get("name") == service_account
        and (s.get("namespace") or default_ns) == namespace
        for s in binding.get("subjects") or ()
    )


def granted(docs: Iterable[Mapping[str, Any]], namespace: str, service_account: str) -> list[Rule]:
    """The rules `docs` bind to the ServiceAccount `namespace/service_account`."""
    docs = [d for d in docs if d]
    roles = {
        (d["kind"], (d["metadata"].get("namespace") if d["kind"] == "Role" else None),
         d["metadata"]["name"]): d
        for d in docs
        if d.get("kind") in ("Role", "ClusterRole")
    }  # fmt: skip
    out: list[Rule] = []
    for d in docs:
        if d.get("kind") not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not _binds(d, namespace, service_account):
            continue
        ref = d["roleRef"]
        binding_ns = d["metadata"].get("namespace") if d["kind"] == "RoleBinding" else None
        role_ns = binding_ns if ref["kind"] == "Role" else None
        role = roles.get((ref["kind"], role_ns, ref["name"]))
        if role is not None:
            out.extend(_rules(role, binding_ns))
    return out


def allows(rules: Iterable[Rule], group: str, resource: str, verb: str,
           namespace: str | None) -> bool:  # fmt: skip
    return any(rule.covers(group, resource, verb, namespace) for rule in rules)


def allows_url(rules: Iterable[Rule], path: str, verb: str) -> bool:
    return any(
        rule.namespace is None and path in rule.non_resource_urls and {verb, "*"} & rule.verbs
        for rule in rules
    )
