"""The API generations poolkeeper understands: one row per apiVersion of each kind, one table.

Everything that depends on which API versions exist derives from `GENERATIONS`:

- validation: the kind registry (`poolkeeper.api.kinds.default_registry`), which the file
  loader and the Kubernetes source validate with;
- the CRDs (`poolkeeper.api.crds`, `poolkeeper crds`, deploy/crds.yaml): one per (group, kind)
  in table order, its served rows as versions in table order, `storage` marking the stored one;
- the Kubernetes watches (`poolkeeper.controller.kubernetes.objects`): one object cache per
  (group, kind), trying the storage version first, then the others newest first; and the
  controller's read RBAC, which follows the watches.

Some kinds moved group: InferenceObjective and InferenceModelRewrite live in `llm-d.ai` since
llm-d-router v0.10, and their `inference.networking.x-k8s.io` rows are `fallback` rows, as
upstream reads that group: loaded from files, watched, never served by poolkeeper's CRDs, and in
a cluster their objects count only while no preferred group of the kind is installed
(`fallback_applies`).

Adding a version or a group: the new type (in its kind's module, with its
apiVersion as a `Literal`) and its row here; docs/architecture.md says the rest. A row that
names an apiVersion its type does not accept fails at import, and tests/api check that every
consumer above agrees with the table.
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Final

from poolkeeper.api import model, objective, pool, rewrite
from poolkeeper.api.meta import ApiObject

__all__ = ["GENERATIONS", "Generation", "fallback_applies", "groups_of", "is_fallback", "resources"]


@dataclass(frozen=True, slots=True)
class Generation:
    """One apiVersion of one kind and the pydantic type that validates it."""

    api_version: str  # group/version
    kind: str
    model: type[ApiObject]
    storage: bool = False  # the version its CRD stores (exactly one per served (group, kind))
    served: bool = True  # by poolkeeper's CRD; False: loaded from files and watched, not served
    fallback: bool = False  # a legacy group: read only where the kind's other groups are absent

    def __post_init__(self) -> None:
        fields = self.model.model_fields
        accepted = typing.get_args(fields["api_version"].annotation)
        kinds = typing.get_args(fields["kind"].annotation)
        if self.api_version not in accepted or kinds != (self.kind,):
            raise ValueError(
                f"{self.model.__name__} does not validate {self.api_version} {self.kind} "
                f"(it accepts {accepted} {kinds})"
            )
        if self.storage and not self.served:
            raise ValueError(f"{self.api_version} {self.kind}: a stored version must be served")
        if self.fallback and self.served:
            raise ValueError(f"{self.api_version} {self.kind}: a fallback group is never served")

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def plural(self) -> str:
        """The resource name (`inferencepools`)."""
        return self.kind.lower() + "s"


GENERATIONS: Final[tuple[Generation, ...]] = (
    Generation(model.V1ALPHA1, model.KIND, model.InferenceModel),
    Generation(model.V1ALPHA2, model.KIND, model.InferenceModel, storage=True),
    # llm-d-router v0.10 moved these two to llm-d.ai; GIE v1.0-v1.5's group is read-only
    Generation(objective.LLMD_V1ALPHA2, objective.KIND, objective.InferenceObjective, storage=True),
    Generation(
        objective.V1ALPHA2,
        objective.KIND,
        objective.InferenceObjective,
        served=False,
        fallback=True,
    ),
    Generation(rewrite.LLMD_V1ALPHA2, rewrite.KIND, rewrite.InferenceModelRewrite, storage=True),
    Generation(
        rewrite.V1ALPHA2, rewrite.KIND, rewrite.InferenceModelRewrite, served=False, fallback=True
    ),
    # upstream v0.1 (removed in v0.2): loads from files and old clusters, never served
    Generation(pool.V1ALPHA1, pool.KIND, pool.InferencePoolV1Alpha1, served=False),
    Generation(pool.V1ALPHA2, pool.KIND, pool.InferencePool, storage=True),
    Generation(pool.V1, pool.KIND, pool.InferencePoolV1, storage=True),
)
"""Every (apiVersion, kind), grouped by (group, kind), each group's versions oldest first."""


def resources() -> Iterator[tuple[str, str, tuple[Generation, ...]]]:
    """(group, kind, its rows in table order) for each resource, in table order."""
    seen: dict[tuple[str, str], list[Generation]] = {}
    for row in GENERATIONS:
        seen.setdefault((row.group, row.kind), []).append(row)
    for (group, kind), rows in seen.items():
        yield group, kind, tuple(rows)


def groups_of(kind: str) -> tuple[str, ...]:
    """The API groups that serve `kind` (InferencePool: the x-k8s.io group and the v1 group)."""
    return tuple(group for group, k, _ in resources() if k == kind)


def fallback_applies(kind: str, group: str, installed: Collection[str]) -> bool | None:
    """Whether objects of `kind` in `group` count, given the groups whose resource for `kind`
    the API server serves (`installed`): always for a preferred group; for a fallback group
    only while none of the kind's preferred groups is installed. None: `group` has no row for
    `kind`."""
    rows = [row for row in GENERATIONS if row.kind == kind and row.group == group]
    if not rows:
        return None
    if not is_fallback(kind, group):
        return True
    preferred = {row.group for row in GENERATIONS if row.kind == kind and not row.fallback}
    return not preferred & set(installed)


def is_fallback(kind: str, group: str) -> bool:
    """Whether `group` is a legacy, read-only group of `kind` (its rows are `fallback`)."""
    return any(row.fallback for row in GENERATIONS if row.kind == kind and row.group == group)
