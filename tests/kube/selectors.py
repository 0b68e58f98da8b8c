"""Label and field selectors as kube-apiserver parses and applies them (for the fake API server).

Label selectors (`labelSelector=`): comma-separated requirements `k=v`, `k==v`, `k!=v`,
`k in (a,b)`, `k notin (a,b)`, `k` (exists) and `!k` (does not exist); `!=` and `notin` also
match objects without the label, as upstream's `labels.Selector` does.

Field selectors (`fieldSelector=`): `path=v`, `path==v`, `path!=v`, only over the fields the
API server indexes for the resource (`metadata.name` and `metadata.namespace` everywhere; a
few Pod fields); any other field is refused with 400 "field label not supported", as the real
server does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SelectorError", "field_selector", "label_selector"]

Match = Callable[[Mapping[str, Any]], bool]

_FIELDS: dict[str, frozenset[str]] = {
    "pods": frozenset(
        {
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        }
    ),
}
_COMMON_FIELDS = frozenset({"metadata.name", "metadata.namespace"})
_KEY = re.compile(
    r"^([a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?/)?[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$"
)
_SET = re.compile(r"^(\S+)\s+(in|notin)\s+\((.*)\)$")


class SelectorError(ValueError):
    """The selector does not parse (the API server answers 400 BadRequest)."""


def _split(text: str) -> list[str]:
    """Requirements split on the commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return [p for p in parts if p]


def _key(key: str) -> str:
    if not _KEY.match(key):
        raise SelectorError(f"invalid label key {key!r}")
    return key


def _requirement(text: str) -> Match:
    def labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
        return (obj.get("metadata") or {}).get("labels") or {}

    found = _SET.match(text)
    if found:
        key, op = _key(found[1]), found[2]
        values = {v.strip() for v in found[3].split(",") if v.strip()}
        if op == "in":
            return lambda o: labels(o).get(key) in values
        return lambda o: labels(o).get(key) not in values
    for op in ("!=", "==", "="):
        if op in text:
            key, _, value = (s.strip() for s in text.partition(op))
            _key(key)
            if op == "!=":
                return lambda o: labels(o).get(key) != value
            return lambda o: labels(o).get(key) == value
    if text.startswith("!"):
        key = _key(text[1:].strip())
        return lambda o: key not in labels(o)
    key = _key(text)
    return lambda o: key in labels(o)


def label_selector(text: str) -> Match:
    """Every requirement must hold (an empty selector matches everything)."""
    checks = [_requirement(part) for part in _split(text)]
    return lambda obj: all(check(obj) for check in checks)


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _field_check(path: str, value: str, *, negate: bool) -> Match:
    return lambda obj: (_field_value(obj, path) == value) != negate


def field_selector(text: str, plural: str) -> Match:
    """Every `path=value` / `path!=value` must hold, over the fields this resource indexes."""
    supported = _COMMON_FIELDS | _FIELDS.get(plural, frozenset())
    checks: list[Match] = []
    for part in _split(text):
        for op in ("!=", "==", "="):
            if op in part:
                path, _, value = (s.strip() for s in part.partition(op))
                break
        else:
            raise SelectorError(f"invalid field selector {part!r}: no operator")
        if path not in supported:
            raise SelectorError(f"field label not supported: {path}")
        checks.append(_field_check(path, value, negate=op == "!="))
    return lambda obj: all(check(obj) for check in checks)
