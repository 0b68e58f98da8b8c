"""What a load of API objects produced: the valid objects and where each came from
(`LoadedResource`), one printable line per problem (`LoadError`), and both with the notices
(`LoadResult`); `object_ref` names an object `Kind/namespace/name` in those lines. The loading
itself is `load`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.api.rewrite import InferenceModelRewrite

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
