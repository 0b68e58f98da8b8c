"""The pure core of the Kubernetes source: API objects (plain dicts) → pools, models, endpoints.

No I/O here; the watch loops (`kubernetes/source.py`) feed these functions and apply the result.

- `ResourceKind`: one (group, version, kind, plural) the source lists and watches.
- `ObjectCache`: the objects of one kind as last seen, by `namespace/name`, with the
  resource version to resume from. `apply_event` folds one watch event in; `replace` swaps in a
  fresh list and says what vanished in the gap (pruned), so a re-list after 410 Gone or a
  dropped stream converges however many events were lost.
- `pod_endpoint`: a Pod is an endpoint while it is Ready, has an IP and is not being deleted;
  it becomes an `EndpointSpec` without a port, so the datastore gives it each target port of
  every pool whose selector matches its labels (in the pool's namespace).
- `parse_object` (and `parse_pool` / `parse_model`): validation with the same kind registry and
  API types the file loader uses; an invalid object is left out and its problems are reported
  (`Kind/ns/name: path: message`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from pydantic import BaseModel

from poolkeeper.api import model as im, objective, pool as ip, rewrite
from poolkeeper.api.kinds import default_registry
from poolkeeper.api.load import validate_object
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.api.versions import resources
from poolkeeper.datastore.snapshot import EndpointSpec

__all__ = [
    "LEASE",
    "MODEL_KINDS",
    "POD",
    "POLICY_KINDS",
    "POOL_KINDS",
    "ObjectCache",
    "ResourceKind",
    "object_key",
    "parse_model",
    "parse_object",
    "parse_pool",
    "pod_endpoint",
    "resource_version",
    "watched_resources",
]


@dataclass(frozen=True, slots=True)
class ResourceKind:
    """One resource type the source reads (or, for Lease, writes)."""

    group: str  # "" for the core group
    version: str
    kind: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def __str__(self) -> str:
        return f"{self.plural}.{self.group or 'core'}/{self.version}"


def _slots(*kinds: str) -> tuple[tuple[ResourceKind, ...], ...]:
    """One slot per (group, kind) of the API-generation table, in table order.

    A slot is one set of objects; where one CRD serves several versions of the same objects,
    the slot lists them in order of preference (the storage version, then newest first) and
    the first version served is watched (never two: every object would appear twice).
    """
    slots = []
    for _, kind, rows in resources():
        if kind in kinds:
            preferred = sorted(reversed(rows), key=lambda row: not row.storage)
            slots.append(
                tuple(ResourceKind(r.group, r.version, r.kind, r.plural) for r in preferred)
            )
    return tuple(slots)


POOL_KINDS: Final = _slots(ip.KIND)
(MODEL_KINDS,) = _slots(im.KIND)  # one InferenceModel resource: the source keeps one cache
POLICY_KINDS: Final = _slots(objective.KIND, rewrite.KIND)
POD: Final = ResourceKind("", "v1", "Pod", "pods")
LEASE: Final = ResourceKind("coordination.k8s.io", "v1", "Lease", "leases")


def watched_resources() -> dict[str, list[str]]:
    """The API resources the source lists and watches, by group in watch order (for RBAC)."""
    by_group: dict[str, list[str]] = {}
    for slot in (*POOL_KINDS, MODEL_KINDS, *POLICY_KINDS):
        for kind in slot:
            plurals = by_group.setdefault(kind.group, [])
            if kind.plural not in plurals:
                plurals.append(kind.plural)
    return by_group


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"


def resource_version(obj: Mapping[str, Any]) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv else None


@dataclass(slots=True)
class ObjectCache:
    """The objects of one kind by `namespace/name`, and the version to resume watching from."""

    kind: ResourceKind  # the version being watched (the first of `candidates` served)
    candidates: tuple[ResourceKind, ...] = ()  # versions of the same objects, preferred first
    objects: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    version: str | None = None  # the list's or the last event's resourceVersion
    synced: bool = False  # a full list has been applied
    installed: bool = False  # the last list found the resource served (its CRD is installed)

    def apply_event(self, event_type: str, obj: Mapping[str, Any]) -> bool:
        """Fold one watch event in (ADDED, MODIFIED, DELETED, BOOKMARK); True if the set of
        objects or one of them changed."""
        rv = resource_version(obj)
        if rv is not None:
            self.version = rv
        if event_type == "BOOKMARK":
            return False
        key = object_key(obj)
        if event_type == "DELETED":
            return self.objects.pop(key, None) is not None
        if event_type in ("ADDED", "MODIFIED"):
            old = self.objects.get(key)
            if old is not None and rv is not None and resource_version(old) == rv:
                return False
            self.objects[key] = obj
            return True
        raise ValueError(f"unknown watch event type {event_type!r}")

    def replace(self, items: Iterable[Mapping[str, Any]], version: str | None) -> list[str]:
        """Swap in a full list; returns the keys pruned (gone since the last state seen)."""
        fresh = {object_key(o): o for o in items}
        pruned = sorted(self.objects.keys() - fresh.keys())
        self.objects = fresh
        self.version = version
        self.synced = True
        return pruned


def _problems(kind: str, obj: Mapping[str, Any], problems: Iterable[Any]) -> list[str]:
    ref = f"{kind}/{object_key(obj)}"
    return [f"{ref}: {p.path}: {p.message}" if p.path else f"{ref}: {p.message}" for p in problems]


_REGISTRY = default_registry()


def parse_object(obj: Mapping[str, Any]) -> tuple[BaseModel | None, list[str]]:
    """The API object (any kind poolkeeper knows), or None and the reasons it is invalid, with
    the same types and rules as the file loader. A pool's status is dropped first: the Gateway
    controller writes it in its own shape, and it is not ours to read."""
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    entry = _REGISTRY.lookup(str(api_version), str(kind))
    if entry is None:
        return None, [f"{kind}/{object_key(obj)}: apiVersion: unsupported {api_version!r}"]
    data = _strip_server_fields(obj)
    if kind == ip.KIND:
        data.pop("status", None)
    parsed, problems = validate_object(entry.target, data)
    return parsed, _problems(str(kind), obj, problems)


def parse_pool(obj: Mapping[str, Any]) -> tuple[AnyInferencePool | None, list[str]]:
    parsed, problems = parse_object(obj)
    if parsed is not None and not isinstance(parsed, AnyInferencePool):
        return None, [f"InferencePool/{object_key(obj)}: not an InferencePool"]
    return parsed, problems


def parse_model(obj: Mapping[str, Any]) -> tuple[InferenceModel | None, list[str]]:
    parsed, problems = parse_object(obj)
    if parsed is not None and not isinstance(parsed, InferenceModel):
        return None, [f"InferenceModel/{object_key(obj)}: not an InferenceModel"]
    return parsed, problems


def _strip_server_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Drop what only the API server adds and the API types need not know."""
    data = dict(obj)
    meta = dict(data.get("metadata") or {})
    meta.pop("selfLink", None)
    data["metadata"] = meta
    return data


def pod_is_endpoint(pod: Mapping[str, Any]) -> bool:
    """Ready, with an IP, and not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def pod_endpoint(
    pod: Mapping[str, Any], engine_for: Callable[[Mapping[str, str]], str]
) -> EndpointSpec | None:
    """The pod as an endpoint (port from the pool), or None while it is not one.

    `engine_for(labels)` names the pod's metrics engine (the GatewayConfig's engine label rule);
    a ValueError from it (unknown engine) leaves the pod out.
    """
    if not pod_is_endpoint(pod):
        return None
    meta = pod.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    try:
        engine = engine_for(labels)
    except ValueError:
        return None
    return EndpointSpec(
        name=str(meta.get("name") or ""),
        address=str((pod.get("status") or {})["podIP"]),
        port=None,
        namespace=str(meta.get("namespace") or "default"),
        labels=MappingProxyType(labels),
        engine=engine,
    )
