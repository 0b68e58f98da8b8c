"""Loading files: multi-document YAML, JSON, kind: List, directories, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given, settings, strategies as st

from poolkeeper.api.kinds import KindEntry, default_registry
from poolkeeper.api.load import load_paths, load_text
from poolkeeper.api.meta import ApiObject
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.pool import InferencePool, InferencePoolV1

POOL = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: pool}
spec:
  selector: {app: vllm}
  targetPortNumber: 8000
  extensionRef: {name: epp}
"""
MODEL = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: %s}
spec:
  modelName: %s
  poolRef: {name: pool}
"""
DEPLOYMENT = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: vllm}\nspec: {}\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def lines(result_errors: object) -> list[str]:
    return [str(e) for e in result_errors]  # type: ignore[attr-defined]


def test_multi_document_file(tmp_path: Path) -> None:
    f = write(tmp_path / "all.yaml", POOL + "---\n" + MODEL % ("a", "chat") + "---\n" + DEPLOYMENT)
    result = load_paths([f])
    assert result.ok
    assert [type(r.obj) for r in result.resources] == [InferencePool, InferenceModel]
    assert [(r.doc, r.location) for r in result.resources] == [(0, f"{f}:0"), (1, f"{f}:1")]
    assert result.notices == [
        f"{f}:2: skipping apps/v1 Deployment/default/vllm (not a poolkeeper kind)"
    ]
    assert [m.name for m in result.models()] == ["a"]
    assert [p.name for p in result.pools()] == ["pool"]


def test_error_line_format_with_and_without_doc_index(tmp_path: Path) -> None:
    single = write(tmp_path / "one.yaml", MODEL % ("a", "chat") + "  criticality: High\n")
    multi = write(tmp_path / "two.yaml", POOL + "---\n" + MODEL % ("b", "chat") + "  foo: 1\n")
    result = load_paths([single, multi])
    assert lines(result.errors) == [
        f'{single}: InferenceModel/default/a: spec.criticality: Unsupported value: "High": '
        'supported values: "Critical", "Standard", "Sheddable"',
        f'{multi}:1: InferenceModel/default/b: spec.foo: unknown field "spec.foo"',
    ]
    assert [r.ref for r in result.resources] == ["InferencePool/default/pool"]


def test_json_file_and_list(tmp_path: Path) -> None:
    items = [
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "gpool", "namespace": "ml"},
            "spec": {
                "selector": {"matchLabels": {"app": "x"}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
            },
        },
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceModel",
            "metadata": {"name": "bad"},
            "spec": {"poolRef": {"name": "p"}},
        },
    ]
    f = write(
        tmp_path / "list.json", json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    )
    result = load_paths([f])
    assert [type(r.obj) for r in result.resources] == [InferencePoolV1]
    assert result.resources[0].item == 0
    assert lines(result.errors) == [
        f"{f}: InferenceModel/default/bad: items[1].spec.modelName: Required value"
    ]


def test_directory_is_walked_recursively_in_sorted_order(tmp_path: Path) -> None:
    write(tmp_path / "b" / "z.yml", MODEL % ("z", "zz"))
    write(tmp_path / "a.yaml", POOL)
    write(
        tmp_path / "b" / "m.json",
        json.dumps({"apiVersion": "apps/v1", "kind": "Service", "metadata": {"name": "s"}}),
    )
    write(tmp_path / "notes.txt", "not yaml: [")
    write(tmp_path / ".hidden" / "x.yaml", "bad: [")
    result = load_paths([tmp_path])
    assert result.ok
    assert [Path(r.source).relative_to(tmp_path).as_posix() for r in result.resources] == [
        "a.yaml",
        "b/z.yml",
    ]
    assert len(result.notices) == 1
    assert "Service/default/s" in result.notices[0]


def test_bad_yaml_reports_line_and_column(tmp_path: Path) -> None:
    f = write(
        tmp_path / "bad.yaml", POOL + "---\nkind: InferenceModel\nspec:\n  modelName: [a, b\n"
    )
    result = load_paths([f])
    assert [r.ref for r in result.resources] == ["InferencePool/default/pool"]
    (error,) = result.errors
    assert (error.line, error.column) == (12, 1)
    assert str(error).startswith(f"{f}:12:1: invalid YAML: expected ',' or ']'")


def test_tab_indentation_is_a_yaml_error(tmp_path: Path) -> None:
    f = write(tmp_path / "tab.yaml", "kind: InferenceModel\nspec:\n\tmodelName: x\n")
    (error,) = load_paths([f]).errors
    assert str(error).startswith(f"{f}:3:1: invalid YAML: found character '\\t'")


def test_duplicate_yaml_keys_are_errors(tmp_path: Path) -> None:
    f = write(tmp_path / "dup.yaml", "kind: InferenceModel\nkind: InferencePool\n")
    assert lines(load_paths([f]).errors) == [
        f"{f}:2:1: invalid YAML: found duplicate key kind (first defined at line 1)"
    ]


def test_bad_json_reports_line_and_column(tmp_path: Path) -> None:
    f = write(tmp_path / "bad.json", '{\n  "kind": "InferenceModel",\n  "spec": {,}\n}\n')
    assert lines(load_paths([f]).errors) == [
        f"{f}:3:12: invalid JSON: Expecting property name enclosed in double quotes"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "- a\n- b\n",
            "<input>: a document must be an object with apiVersion and kind, not a list",
        ),
        (
            "apiVersion: v1\nmetadata: {name: x}\n",
            "<input>: <no kind>/default/x: kind: Required value",
        ),
        (
            "kind: InferenceModel\nmetadata: {name: x}\n",
            "<input>: InferenceModel/default/x: apiVersion: Required value",
        ),
        (
            "apiVersion: inference.networking.x-k8s.io/v1\n"
            "kind: InferencePool\nmetadata: {name: x}\n",
            "<input>: InferencePool/default/x: apiVersion: Unsupported value: "
            '"inference.networking.x-k8s.io/v1": supported values: '
            '"inference.networking.x-k8s.io/v1alpha1", "inference.networking.x-k8s.io/v1alpha2", '
            '"inference.networking.k8s.io/v1"',
        ),
    ],
    ids=["not-a-mapping", "no-kind", "no-api-version", "unsupported-version"],
)
def test_document_shape_errors(text: str, expected: str) -> None:
    assert lines(load_text(text).errors) == [expected]


def test_timestamps_stay_strings_until_validated() -> None:
    text = (MODEL % ("a", "chat")).replace(
        "{name: a}", "{name: a, creationTimestamp: 2025-01-02T03:04:05Z}"
    )
    result = load_text(text)
    assert result.ok
    ts = result.models()[0].metadata.creation_timestamp
    assert ts is not None
    assert ts.isoformat() == "2025-01-02T03:04:05+00:00"


def test_nulls_count_as_unset() -> None:
    result = load_text(MODEL % ("a", "chat") + "  criticality: null\n  targetModels: ~\n")
    assert result.ok
    assert result.models()[0].spec.criticality is None


def test_duplicates_are_errors_across_files(tmp_path: Path) -> None:
    first = write(tmp_path / "a.yaml", MODEL % ("same", "x"))
    second = write(tmp_path / "b.yaml", MODEL % ("same", "y") + "---\n" + MODEL % ("other", "z"))
    result = load_paths([tmp_path])
    assert [r.ref for r in result.resources] == [
        "InferenceModel/default/same",
        "InferenceModel/default/other",
    ]
    assert result.resources[0].source == str(first)
    assert lines(result.errors) == [
        f'{second}:0: InferenceModel/default/same: metadata.name: Duplicate value: "same": '
        f"already defined in {first}"
    ]


def test_same_name_in_other_namespace_or_kind_is_not_a_duplicate() -> None:
    text = (
        MODEL % ("x", "a")
        + "---\n"
        + (MODEL % ("x", "a")).replace("{name: x}", "{name: x, namespace: b}")
    )
    text += "---\n" + POOL.replace("name: pool", "name: x")
    assert load_text(text).ok


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    assert lines(load_paths([tmp_path / "nope.yaml"]).errors) == [
        f"{tmp_path / 'nope.yaml'}: no such file or directory"
    ]


class Widget(ApiObject):
    api_version: Literal["example.dev/v1"] = "example.dev/v1"
    kind: Literal["Widget"] = "Widget"


def test_a_composed_registry_adds_kinds_without_changing_the_default() -> None:
    base = default_registry()
    registry = base.with_entries(KindEntry("example.dev/v1", "Widget", Widget))
    text = "apiVersion: example.dev/v1\nkind: Widget\nmetadata: {name: w}\n"
    (loaded,) = load_text(text, registry=registry).resources
    assert isinstance(loaded.obj, Widget)
    skipped = load_text(text, registry=base)
    assert skipped.resources == []
    assert "skipping example.dev/v1 Widget/default/w (not a poolkeeper kind)" in skipped.notices[0]


def test_registry_knows_every_api_kind_and_only_those() -> None:
    registry = default_registry()
    assert registry.lookup("inference.networking.x-k8s.io/v1alpha1", "InferenceModel") is not None
    assert registry.lookup("inference.networking.x-k8s.io/v1alpha2", "InferencePool") is not None
    assert registry.lookup("inference.networking.k8s.io/v1", "InferencePool") is not None
    # GatewayConfig is the config package's kind: it composes its own registry (config/load.py).
    assert registry.lookup("poolkeeper.dev/v1alpha1", "GatewayConfig") is None
    assert registry.lookup("apps/v1", "Deployment") is None


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "apiVersion",
                    "kind",
                    "metadata",
                    "spec",
                    "name",
                    "items",
                    "modelName",
                    "poolRef",
                    "selector",
                    "x",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_never_raises(text: str) -> None:
    result = load_text(text)
    assert all(str(e) for e in result.errors)


@settings(max_examples=150, deadline=None)
@given(
    JSONISH,
    st.sampled_from(["inference.networking.x-k8s.io/v1alpha2", "inference.networking.k8s.io/v1"]),
    st.sampled_from(["InferenceModel", "InferencePool", "List"]),
)
def test_arbitrary_documents_never_raise(body: object, api_version: str, kind: str) -> None:
    doc = body if not isinstance(body, dict) else {"apiVersion": api_version, "kind": kind, **body}
    result = load_text(json.dumps(doc), json_format=True)
    for error in result.errors:
        assert str(error).startswith("<input>")
