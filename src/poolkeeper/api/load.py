"""Loading API objects from files: multi-document YAML, JSON, `kind: List`, and directories.

Bad input never raises: every problem becomes a `LoadError` that prints as
`PATH[:DOC]: Kind/namespace/name: field.path: message` (DOC is the 0-based document index, shown
when the file holds several documents), or `PATH:LINE:COL: message` for syntax errors. Objects
of kinds poolkeeper does not handle (Deployments, Services, ...) are skipped with a notice.

This module owns the loading (files, documents, `kind: List`, validation, duplicates); what a
load produced is `load_results`, a file's text into documents (strict YAML, JSON) `load_syntax`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from poolkeeper.api.fielderrors import FieldError, from_pydantic, go_value, supported_values
from poolkeeper.api.kinds import KindRegistry, default_registry
from poolkeeper.api.load_results import LoadedResource, LoadError, LoadResult, object_ref
from poolkeeper.api.load_syntax import parse_json, parse_yaml

SUFFIXES = (".yaml", ".yml", ".json")

T = TypeVar("T", bound=BaseModel)


def load_paths(paths: Iterable[str | Path], *, registry: KindRegistry | None = None) -> LoadResult:
    """Load files and directories (recursively: *.yaml, *.yml, *.json, sorted)."""
    registry = registry or default_registry()
    result = LoadResult()
    for path in paths:
        for file in _expand(Path(path), result):
            _load_file(file, registry, result)
    _reject_duplicates(result)
    return result


def load_text(
    text: str,
    source: str = "<input>",
    *,
    json_format: bool = False,
    registry: KindRegistry | None = None,
) -> LoadResult:
    """Load one file's worth of text (YAML, or JSON when `json_format`)."""
    result = LoadResult()
    _load_documents(text, source, json_format, registry or default_registry(), result)
    _reject_duplicates(result)
    return result


def _expand(path: Path, result: LoadResult) -> Iterator[Path]:
    if path.is_dir():
        found = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix in SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not found:
            result.notices.append(f"{path}: no *.yaml, *.yml or *.json files")
        yield from found
    elif path.is_file():
        yield path
    else:
        result.errors.append(LoadError(str(path), "no such file or directory"))


def _load_file(file: Path, registry: KindRegistry, result: LoadResult) -> None:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        result.errors.append(LoadError(str(file), f"cannot read: {exc}"))
        return
    _load_documents(text, str(file), file.suffix == ".json", registry, result)


def _load_documents(
    text: str, source: str, json_format: bool, registry: KindRegistry, result: LoadResult
) -> None:
    docs, syntax_error = parse_json(text, source) if json_format else parse_yaml(text, source)
    multi = len(docs) > 1
    for index, data in enumerate(docs):
        if data is None:
            continue  # an empty document (e.g. a trailing `---`)
        _load_document(data, source, index, multi, None, registry, result)
    if syntax_error is not None:
        result.errors.append(syntax_error)


def _load_document(
    data: Any,
    source: str,
    doc: int,
    multi: bool,
    item: int | None,
    registry: KindRegistry,
    result: LoadResult,
) -> None:
    prefix = f"items[{item}]." if item is not None else ""

    def error(message: str, path: str = "", ref: str | None = None) -> None:
        full = prefix + path if path else prefix.rstrip(".")
        result.errors.append(LoadError(source, message, doc, multi, ref, full))

    if not isinstance(data, Mapping):
        what = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        error(f"a document must be an object with apiVersion and kind, not {what}")
        return
    ref = object_ref(data)
    api_version, kind = data.get("apiVersion"), data.get("kind")
    if not kind:
        error("Required value", "kind", ref)
        return
    if not isinstance(kind, str):
        error(f"Invalid value: {go_value(kind)}: kind must be a string", "kind", ref)
        return
    items = data.get("items")
    if kind.endswith("List") and isinstance(items, list):
        for index, entry in enumerate(items):
            _load_document(entry, source, doc, multi, index, registry, result)
        return
    if not api_version:
        error("Required value", "apiVersion", ref)
        return
    if not isinstance(api_version, str):
        error(
            f"Invalid value: {go_value(api_version)}: apiVersion must be a string",
            "apiVersion",
            ref,
        )
        return
    entry = registry.lookup(api_version, kind)
    where = (f"{source}:{doc}" if multi else source) + (
        f" items[{item}]" if item is not None else ""
    )
    if entry is None:
        versions = registry.api_versions_of(kind)
        if versions:
            error(
                f"Unsupported value: {json.dumps(api_version)}: supported values: "
                f"{supported_values(versions)}",
                "apiVersion",
                ref,
            )
        else:
            result.notices.append(f"{where}: skipping {api_version} {ref} (not a poolkeeper kind)")
        return
    obj, problems = validate_object(entry.target, data)
    for problem in problems:
        error(problem.message, problem.path, ref)
    if obj is not None:
        result.resources.append(LoadedResource(obj, source, doc, multi, item))


def validate_object(cls: type[T], data: Mapping[str, Any]) -> tuple[T | None, list[FieldError]]:
    """Validate raw data as `cls`, the API server's way: explicit nulls count as unset."""
    cleaned = prune_nulls(data)
    fields = {f.alias or name for name, f in cls.model_fields.items()}
    for envelope in ("apiVersion", "kind"):
        if envelope not in fields:
            cleaned.pop(envelope, None)
    try:
        return cls.model_validate(cleaned), []
    except ValidationError as exc:
        return None, from_pydantic(exc)
    except Exception as exc:  # a bug in a validator must surface as an error line, not a crash
        return None, [FieldError("", f"Internal error: {type(exc).__name__}: {exc}")]


def prune_nulls(data: Mapping[str, Any]) -> dict[str, Any]:
    """Drop `key: null` entries at every level (the API server prunes them too)."""
    return {k: _prune(v) for k, v in data.items() if v is not None}


def _prune(value: Any) -> Any:
    if isinstance(value, Mapping):
        return prune_nulls(value)
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def _reject_duplicates(result: LoadResult) -> None:
    seen: dict[tuple[str, str, str, str], LoadedResource] = {}
    kept: list[LoadedResource] = []
    for res in result.resources:
        obj = res.obj
        api_version = str(getattr(obj, "api_version", "") or "")
        meta = getattr(obj, "metadata", None)
        name = str(getattr(meta, "name", ""))
        namespace = str(getattr(meta, "namespace", "default"))
        key = (
            api_version.rpartition("/")[0],
            str(getattr(obj, "kind", "") or type(obj).__name__),
            namespace,
            name,
        )
        first = seen.get(key)
        if first is None:
            seen[key] = res
            kept.append(res)
            continue
        where = first.location + (f" items[{first.item}]" if first.item is not None else "")
        result.errors.append(
            LoadError(
                res.source,
                f"Duplicate value: {json.dumps(name)}: already defined in {where}",
                res.doc,
                res.multi_doc,
                res.ref,
                (f"items[{res.item}]." if res.item is not None else "") + "metadata.name",
            )
        )
    result.resources[:] = kept
