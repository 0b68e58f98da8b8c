"""CustomResourceDefinitions generated from the pydantic types, so the CRD and the Python
validation cannot drift apart (tests/api check that both accept and reject the same objects).

The pydantic JSON schema is turned into a structural OpenAPI v3 schema: `$ref`s inlined,
`Optional` unwrapped, titles and `additionalProperties: false` dropped (the API server prunes or,
with strict field validation, rejects unknown fields itself), empty defaults dropped. The few
per-version differences of InferenceModel are applied from the tables in `poolkeeper.api.model`.

Which CRDs and versions exist comes from the API-generation table (`poolkeeper.api.versions`);
this module only adds how each kind is printed (columns, short names).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from poolkeeper import __version__
from poolkeeper.api import model, objective, pool, rewrite
from poolkeeper.api.versions import GENERATIONS, resources

Schema = dict[str, Any]

_MODEL_COLUMNS = [
    {"name": "Model Name", "type": "string", "jsonPath": ".spec.modelName"},
    {"name": "Inference Pool", "type": "string", "jsonPath": ".spec.poolRef.name"},
    {"name": "Criticality", "type": "string", "jsonPath": ".spec.criticality"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
_OBJECTIVE_COLUMNS = [
    {"name": "Inference Pool", "type": "string", "jsonPath": ".spec.poolRef.name"},
    {"name": "Priority", "type": "string", "jsonPath": ".spec.priority"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
_REWRITE_COLUMNS = [
    {"name": "Inference Pool", "type": "string", "jsonPath": ".spec.poolRef.name"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
_AGE_COLUMN = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
_COLUMNS = {
    model.KIND: _MODEL_COLUMNS,
    objective.KIND: _OBJECTIVE_COLUMNS,
    rewrite.KIND: _REWRITE_COLUMNS,
    pool.KIND: _AGE_COLUMN,
}
_SHORT_NAMES = {(pool.V1_GROUP, pool.KIND): ["infpool"]}  # upstream's v1 CRD
# Groups under these suffixes are Kubernetes-owned: their CRDs must carry an approval annotation.
_PROTECTED_GROUP_SUFFIXES = (".k8s.io", ".kubernetes.io")


def openapi_schema(cls: type[BaseModel]) -> Schema:
    """The structural openAPIV3Schema of a top-level API type."""
    raw = cls.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    body = _structural(raw, defs)
    properties = body.get("properties", {})
    return {
        "description": body.get("description", ""),
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string", "description": "Versioned schema of this object."},
            "kind": {"type": "string", "description": "REST resource this object represents."},
            "metadata": {"type": "object"},
            "spec": properties["spec"],
            "status": properties["status"],
        },
        "required": ["spec"],
    }


def _structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    node = dict(node)
    ref = node.pop("$ref", None)
    if ref is not None:
        target = _structural(defs[ref.rsplit("/", 1)[1]], defs)
        node = {**target, **node}
    variants = node.pop("anyOf", None)
    if variants is not None:
        concrete = [v for v in variants if v != {"type": "null"}]
        if len(concrete) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {variants}")
        node = {**_structural(concrete[0], defs), **node}
    node.pop("title", None)
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if "default" in node and node["default"] in (None, [], {}):
        del node["default"]
    if "properties" in node:
        node["properties"] = {k: _structural(v, defs) for k, v in node["properties"].items()}
    if isinstance(node.get("items"), dict):
        node["items"] = _structural(node["items"], defs)
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"], defs)
    return node


def inference_model_schema(version: str) -> Schema:
    """InferenceModel's schema for `version` (v1alpha1 or v1alpha2)."""
    schema = openapi_schema(model.InferenceModel)
    spec = schema["properties"]["spec"]["properties"]
    spec["targetModels"]["items"]["properties"]["weight"]["minimum"] = model.MIN_WEIGHT_BY_VERSION[
        version
    ]
    if version in model.IMMUTABLE_MODEL_NAME_VERSIONS:
        spec["modelName"]["x-kubernetes-validations"] = [
            {"rule": model.IMMUTABLE_RULE, "message": model.IMMUTABLE_MESSAGE}
        ]
    return schema


def version_schema(api_version: str, kind: str) -> Schema:
    """The openAPIV3Schema for (apiVersion, kind): every row of the generation table has one,
    served or not."""
    for row in GENERATIONS:
        if (row.api_version, row.kind) == (api_version, kind):
            if kind == model.KIND:
                return inference_model_schema(row.version)
            return openapi_schema(row.model)
    raise KeyError(f"no CRD serves {api_version} {kind}")


def _crd(
    group: str,
    kind: str,
    versions: list[dict[str, Any]],
    *,
    short_names: list[str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    plural = kind.lower() + "s"
    names: dict[str, Any] = {
        "kind": kind,
        "listKind": f"{kind}List",
        "plural": plural,
        "singular": kind.lower(),
    }
    if short_names:
        names["shortNames"] = short_names
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{group}",
            "annotations": {"poolkeeper.dev/generated-by": f"poolkeeper {__version__}"}
            | (annotations or {}),
        },
        "spec": {"group": group, "names": names, "scope": "Namespaced", "versions": versions},
    }


def _version(
    name: str, schema: Schema, *, storage: bool, columns: list[dict[str, str]]
) -> dict[str, Any]:
    return {
        "name": name,
        "served": True,
        "storage": storage,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}},
        "additionalPrinterColumns": copy.deepcopy(columns),
    }


def custom_resource_definitions() -> list[dict[str, Any]]:
    """One CRD per (group, kind) of the generation table with a served version."""
    crds = []
    for group, kind, rows in resources():
        versions = [
            _version(
                row.version,
                version_schema(row.api_version, kind),
                storage=row.storage,
                columns=_COLUMNS.get(kind, _AGE_COLUMN),
            )
            for row in rows
            if row.served
        ]
        if not versions:
            continue
        annotations = None
        if group.endswith(_PROTECTED_GROUP_SUFFIXES):
            # The upstream CRD carries the real approval.
            annotations = {
                "api-approved.kubernetes.io": "unapproved, generated by poolkeeper; "
                "install the upstream CRD in production clusters"
            }
        crds.append(
            _crd(
                group,
                kind,
                versions,
                short_names=_SHORT_NAMES.get((group, kind)),
                annotations=annotations,
            )
        )
    return crds


def crds_yaml() -> str:
    """All CRDs as one multi-document YAML stream."""
    return yaml.safe_dump_all(
        custom_resource_definitions(), sort_keys=False, explicit_start=True, width=100
    )
