"""Raw API documents (as decoded from YAML) for the api tests, and small edit helpers."""

from __future__ import annotations

import copy
from typing import Any

from poolkeeper.api.fielderrors import FieldError
from poolkeeper.api.kinds import default_registry
from poolkeeper.api.load import validate_object
from poolkeeper.api.model import InferenceModel, validate_update

Doc = dict[str, Any]

M1 = "inference.networking.x-k8s.io/v1alpha1"
M2 = "inference.networking.x-k8s.io/v1alpha2"
P2 = "inference.networking.x-k8s.io/v1alpha2"
PA1 = "inference.networking.x-k8s.io/v1alpha1"
P1 = "inference.networking.k8s.io/v1"


def model_doc(api_version: str = M2, **spec: Any) -> Doc:
    return {
        "apiVersion": api_version,
        "kind": "InferenceModel",
        "metadata": {"name": "chat", "namespace": "default"},
        "spec": {"modelName": "llama", "poolRef": {"name": "pool"}, **spec},
    }


def pool2_doc(**spec: Any) -> Doc:
    return {
        "apiVersion": P2,
        "kind": "InferencePool",
        "metadata": {"name": "pool"},
        "spec": {
            "selector": {"app": "vllm"},
            "targetPortNumber": 8000,
            "extensionRef": {"name": "epp"},
            **spec,
        },
    }


def pool_alpha1_doc(**spec: Any) -> Doc:
    """An InferencePool v1alpha1 (upstream v0.1)."""
    return {**pool2_doc(**spec), "apiVersion": PA1}


def pool1_doc(**spec: Any) -> Doc:
    return {
        "apiVersion": P1,
        "kind": "InferencePool",
        "metadata": {"name": "pool"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
            **spec,
        },
    }


def condition(**over: Any) -> Doc:
    return {
        "type": "Accepted",
        "status": "True",
        "reason": "Accepted",
        "message": "",
        "lastTransitionTime": "2025-01-01T00:00:00Z",
        **over,
    }


def edit(doc: Doc, path: str, value: Any) -> Doc:
    """A copy of `doc` with the dotted `path` set to `value` (or removed when value is DELETE)."""
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return out


DELETE: Any = object()


def python_errors(doc: Doc, old: Doc | None = None) -> list[FieldError]:
    """Validate `doc` with poolkeeper's types (plus update rules when `old` is given)."""
    entry = default_registry().lookup(doc["apiVersion"], doc["kind"])
    assert entry is not None, (doc["apiVersion"], doc["kind"])
    obj, errors = validate_object(entry.target, doc)
    if obj is not None and old is not None:
        old_obj, old_errors = validate_object(entry.target, old)
        assert not old_errors, old_errors
        assert isinstance(obj, InferenceModel)
        assert isinstance(old_obj, InferenceModel)
        errors = validate_update(old_obj, obj)
    return errors


def messages(doc: Doc, old: Doc | None = None) -> list[str]:
    return [str(e) for e in python_errors(doc, old)]
