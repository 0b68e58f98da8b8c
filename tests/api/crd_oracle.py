"""An independent check of objects against the generated CRD schema, standing in for the API
server: structural defaulting, `jsonschema` for the OpenAPI part (unknown fields rejected, as
with strict field validation) and `celpy` for `x-kubernetes-validations` (transition rules only
when an old object is given)."""

from __future__ import annotations

import copy
from typing import Any

import celpy
from celpy.adapter import json_to_cel
from jsonschema import Draft7Validator

from poolkeeper.api.crds import version_schema
from poolkeeper.api.load import prune_nulls

Schema = dict[str, Any]


def to_jsonschema(node: Schema) -> Schema:
    out: Schema = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {k: to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_jsonschema(value)
        elif key == "format" or key.startswith("x-kubernetes-") or key == "default":
            continue
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def apply_defaults(node: Schema, value: Any) -> Any:
    if isinstance(value, dict):
        for key, sub in node.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [apply_defaults(node["items"], v) for v in value]
    return value


def cel_errors(node: Schema, value: Any, old: Any, path: str) -> list[str]:
    errors: list[str] = []
    env = celpy.Environment()
    for rule in node.get("x-kubernetes-validations", []):
        is_transition = "oldSelf" in rule["rule"]
        if is_transition and old is None:
            continue
        activation = {"self": json_to_cel(value)}
        if is_transition:
            activation["oldSelf"] = json_to_cel(old)
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate(activation)
        # Anything but a plain `true` (false, or an evaluation error) rejects the object.
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            errors.append(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in node.get("properties", {}).items():
            if key in value:
                old_child = old.get(key) if isinstance(old, dict) else None
                errors += cel_errors(sub, value[key], old_child, f"{path}.{key}".lstrip("."))
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                errors += cel_errors(extra, value[key], None, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            errors += cel_errors(node["items"], item, None, f"{path}[{i}]")
        errors += list_map_errors(node, value, path)
    return errors


def list_map_errors(node: Schema, value: list[Any], path: str) -> list[str]:
    """`x-kubernetes-list-type: map` lists may not repeat a key (the API server checks this)."""
    if node.get("x-kubernetes-list-type") != "map":
        return []
    keys = node["x-kubernetes-list-map-keys"]
    seen: set[tuple[Any, ...]] = set()
    errors = []
    for i, item in enumerate(value):
        key = tuple(item.get(k) for k in keys)
        if key in seen:
            errors.append(f"{path}[{i}]: Duplicate value: {key}")
        seen.add(key)
    return errors


def oracle_errors(doc: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """What the generated CRD says about `doc` (empty list: accepted)."""
    schema = version_schema(doc["apiVersion"], doc["kind"])
    obj = apply_defaults(schema, prune_nulls(doc))
    validator = Draft7Validator(to_jsonschema(schema))
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(obj)
    ]
    if errors:
        return errors
    old_obj = apply_defaults(schema, prune_nulls(old)) if old is not None else None
    return cel_errors(schema, obj, old_obj, "")
