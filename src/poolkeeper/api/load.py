"""Loading API objects from files: multi-document YAML, JSON, `kind: List`, and directories.

Bad input never raises: every problem becomes a `LoadError` that prints as
`PATH[:DOC]: Kind/namespace/name: field.path: message` (DOC is the 0-based document index, shown
when the file holds several documents), or `PATH:LINE:COL: message` for syntax errors. Objects
of kinds poolkeeper does not handle (Deployments, Services, ...) are skipped with a notice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from poolkeeper.api.fielderrors import FieldError, from_pydantic, go_value, supported_values
from poolkeeper.api.kinds import KindRegistry, default_registry
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.api.rewrite import InferenceModelRewrite

SUFFIXES = (".yaml", ".yml", ".json")

T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class LoadedResource:
    """A valid object and where it came from."""

    obj: BaseModel
    source: str
    doc: int
    multi_doc: bool = False
    item: int | None = None

    @property
    def location(self) -> str:
        return f"{self.source}:{self.doc}" if self.multi_doc else self.source

    @property
    def ref(self) -> str:
        return object_ref(self.obj)


@dataclass(frozen=True, slots=True)
class LoadError:
    """One problem, printable as one line."""

    source: str
    message: str
    doc: int | None = None
    multi_doc: bool = False
    ref: str | None = None
    path: str = ""
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.source}:{self.line}:{self.column}: {self.message}"
        location = self.source
        if self.doc is not None and self.multi_doc:
            location += f":{self.doc}"
        parts = [location]
        if self.ref:
            parts.append(self.ref)
        if self.path:
            parts.append(self.path)
        parts.append(self.message)
        return ": ".join(parts)


@dataclass(slots=True)
class LoadResult:
    """Everything a load produced. `ok` is true when there were no errors (notices are fine)."""

    resources: list[LoadedResource] = field(default_factory=list)
    errors: list[LoadError] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def objects_of(self, cls: type[T]) -> list[T]:
        return [r.obj for r in self.resources if isinstance(r.obj, cls)]

    def models(self) -> list[InferenceModel]:
        return self.objects_of(InferenceModel)

    def objectives(self) -> list[InferenceObjective]:
        return self.objects_of(InferenceObjective)

    def rewrites(self) -> list[InferenceModelRewrite]:
        return self.objects_of(InferenceModelRewrite)

    def pools(self) -> list[AnyInferencePool]:
        return [r.obj for r in self.resources if isinstance(r.obj, AnyInferencePool)]


def object_ref(obj: Any) -> str:
    """`Kind/namespace/name` of a validated object (or of raw data, best effort)."""
    if isinstance(obj, Mapping):
        meta = obj.get("metadata")
        meta = meta if isinstance(meta, Mapping) else {}
        kind = obj.get("kind") or "<no kind>"
        namespace = meta.get("namespace") or "default"
        name = meta.get("name") or "<no name>"
        return f"{kind}/{namespace}/{name}"
    meta = getattr(obj, "metadata", None)
    kind = getattr(obj, "kind", None) or type(obj).__name__
    namespace = getattr(meta, "namespace", None) or "default"
    name = getattr(meta, "name", None) or "<no name>"
    return f"{kind}/{namespace}/{name}"


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
    docs, syntax_error = _parse_json(text, source) if json_format else _parse_yaml(text, source)
    multi = len(docs) > 1
    for index, data in enumerate(docs):
        if data is None:
            continue  # an empty document (e.g. a trailing `---`)
        _load_document(data, source, index, multi, None, registry, result)
    if syntax_error is not None:
        result.errors.append(syntax_error)


def _parse_json(text: str, source: str) -> tuple[list[Any], LoadError | None]:
    try:
        return [json.loads(text)], None
    except json.JSONDecodeError as exc:
        return [], LoadError(source, f"invalid JSON: {exc.msg}", line=exc.lineno, column=exc.colno)
    except RecursionError:
        return [], LoadError(source, "invalid JSON: nested too deeply")


def _parse_yaml(text: str, source: str) -> tuple[list[Any], LoadError | None]:
    docs: list[Any] = []
    try:
        for doc in yaml.load_all(text, Loader=_StrictLoader):
            docs.append(doc)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "malformed document"
        if exc.context and exc.problem:
            started = f" started at line {exc.context_mark.line + 1}" if exc.context_mark else ""
            problem += f" ({exc.context}{started})"
        if mark is None:
            return docs, LoadError(source, f"invalid YAML: {problem}")
        return docs, LoadError(
            source, f"invalid YAML: {problem}", line=mark.line + 1, column=mark.column + 1
        )
    except yaml.YAMLError as exc:
        return docs, LoadError(source, f"invalid YAML: {exc}")
    except RecursionError:
        return docs, LoadError(source, "invalid YAML: nested too deeply")
    return docs, None


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


MAX_EXPANDED_NODES = 200_000  # a document's nodes with every alias expanded


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes in `node` with aliases expanded (memoised: linear in the composed graph)."""
    known = memo.get(id(node))
    if known is not None:
        return known
    memo[id(node)] = 1  # a cycle counts once (the constructor refuses what it cannot build)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    memo[id(node)] = size
    return size


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that keeps timestamps as strings (like JSON), rejects duplicate keys, and
    refuses documents whose aliases expand past MAX_EXPANDED_NODES (a "billion laughs" bomb
    composes in microseconds but would take hours to validate)."""

    def compose_document(self) -> yaml.Node | None:
        node: yaml.Node | None = super().compose_document()
        if node is not None and _expanded_size(node, {}) > MAX_EXPANDED_NODES:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"document expands to more than {MAX_EXPANDED_NODES} nodes (aliases)",
                node.start_mark,
            )
        return node

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                duplicate = False  # unhashable keys are reported by the base class
            if duplicate:
                first = seen[key].start_mark
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"found duplicate key {key!s} (first defined at line {first.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)
