"""`decision-tree-filter`: GIE's v0.1-v0.5 filter tree, nodes referring to filters by name.

A node runs its `current` filter. Success (at least one endpoint left) passes the filtered set
to `nextOnSuccess`; failure passes the node's *original* input to `nextOnFailure`;
`nextOnSuccessOrFailure` stands for both. A node without a next step returns what its filter
returned (empty on failure, which fails the tree). Each reference is a plugin name (`"x"` or
`{pluginRef: x}`) or a nested `{decisionTree: {...}}`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, model_validator

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import CycleState, Filter, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.registry import BuildContext, PluginParams
from poolkeeper.scheduling.types import LLMRequest


class NodeRef(PluginParams):
    """A filter plugin by name, or a nested tree."""

    plugin_ref: str | None = Field(default=None, description="Name of a filter in `plugins`.")
    decision_tree: DecisionTreeParams | None = Field(
        default=None, description="A nested tree node."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> NodeRef:
        if (self.plugin_ref is None) == (self.decision_tree is None):
            raise ValueError("give exactly one of pluginRef or decisionTree")
        return self


Ref = NodeRef | str


class DecisionTreeParams(PluginParams):
    current: Ref = Field(description="The filter this node runs.")
    next_on_success: Ref | None = Field(default=None, description="Runs on the filtered endpoints.")
    next_on_failure: Ref | None = Field(default=None, description="Runs on this node's input.")
    next_on_success_or_failure: Ref | None = Field(
        default=None, description="Both of the above (exclusive with them)."
    )

    @model_validator(mode="after")
    def _either_or(self) -> DecisionTreeParams:
        if self.next_on_success_or_failure is not None and (
            self.next_on_success is not None or self.next_on_failure is not None
        ):
            raise ValueError(
                "nextOnSuccessOrFailure cannot be combined with nextOnSuccess/nextOnFailure"
            )
        return self


NodeRef.model_rebuild()


def tree_references(params: PluginParams) -> list[tuple[str, str]]:
    """Every (parameter path, plugin name) the tree refers to."""
    assert isinstance(params, DecisionTreeParams)
    out: list[tuple[str, str]] = []

    def walk(node: DecisionTreeParams, path: str) -> None:
        for attr, key in (
            ("current", "current"),
            ("next_on_success", "nextOnSuccess"),
            ("next_on_failure", "nextOnFailure"),
            ("next_on_success_or_failure", "nextOnSuccessOrFailure"),
        ):
            ref = getattr(node, attr)
            if ref is None:
                continue
            sub = f"{path}{key}"
            if isinstance(ref, str):
                out.append((sub, ref))
            elif ref.plugin_ref is not None:
                out.append((f"{sub}.pluginRef", ref.plugin_ref))
            elif ref.decision_tree is not None:
                walk(ref.decision_tree, f"{sub}.decisionTree.")

    walk(params, "")
    return out


class DecisionTreeFilter(NamedPlugin):
    """One node of the tree (nested nodes are DecisionTreeFilters too)."""

    __slots__ = ("current", "on_failure", "on_success")

    def __init__(
        self,
        typed_name: TypedName,
        current: Filter,
        on_success: Filter | None,
        on_failure: Filter | None,
    ) -> None:
        super().__init__(typed_name)
        self.current = current
        self.on_success = on_success
        self.on_failure = on_failure

    @classmethod
    def build(
        cls, typed_name: TypedName, params: DecisionTreeParams, ctx: BuildContext
    ) -> DecisionTreeFilter:
        def resolve(ref: Ref | None) -> Filter | None:
            if ref is None:
                return None
            if isinstance(ref, str):
                return ctx.resolve_filter(ref)
            if ref.plugin_ref is not None:
                return ctx.resolve_filter(ref.plugin_ref)
            assert ref.decision_tree is not None
            return cls.build(typed_name, ref.decision_tree, ctx)

        both = resolve(params.next_on_success_or_failure)
        current = resolve(params.current)
        assert current is not None
        return cls(
            typed_name,
            current,
            both if both is not None else resolve(params.next_on_success),
            both if both is not None else resolve(params.next_on_failure),
        )

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        kept = self.current.filter(cycle, request, candidates)
        if kept:
            nxt = self.on_success
            return kept if nxt is None else nxt.filter(cycle, request, kept)
        nxt = self.on_failure
        return kept if nxt is None else nxt.filter(cycle, request, candidates)
