"""Resolve one plugins/profiles document against a plugin registry into a build plan.

All cross-reference rules live here and in `profile_plan.py` (the profiles, the handler and the
defaults added), and every problem is reported with its path: unknown
types and parameters, duplicate names, unknown or misplaced references, weights on
non-scorers, more than one picker per profile, decision-tree references and cycles, the
profile handler. Defaults are filled in as GIE's loader does: no profile -> one `default`
profile with every filter, scorer and picker; scorer without weight -> 1; profile without a
picker -> max-score-picker; no handler -> single-profile-handler.

Presets are not known here: `SchedulingConfig` (config.py) turns a preset name into its
document and feeds it to `resolve` like any other. The document is typed by protocols
(`resolved.py`, with the plan), so this module needs nothing from the config schema above it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from poolkeeper.scheduling.interfaces import TypedName
from poolkeeper.scheduling.profile_plan import (
    add_default_picker,
    default_profile,
    resolve_handler,
    resolve_profiles,
)
from poolkeeper.scheduling.registry import PluginKind, PluginRegistry
from poolkeeper.scheduling.resolved import (
    InvalidSchedulingConfig,
    PluginEntry,
    ResolvedPlugin,
    ResolvedScheduling,
    SchedulingDocument,
    loc_path,
)


def resolve(doc: SchedulingDocument, registry: PluginRegistry) -> ResolvedScheduling:
    """The build plan for `doc`; raises InvalidSchedulingConfig listing every problem."""
    problems: list[str] = []
    plugins, index_of = _resolve_plugins(doc.plugins, registry, problems)
    _check_filter_references(plugins, index_of, problems)
    if doc.scheduling_profiles:
        profiles = resolve_profiles(doc.scheduling_profiles, plugins, problems)
    else:
        profiles = [default_profile(plugins, problems)]
    handler = resolve_handler(doc.profile_handler, plugins, len(profiles), registry, problems)
    add_default_picker(profiles, plugins, registry)
    if problems or handler is None:
        raise InvalidSchedulingConfig(problems)
    return ResolvedScheduling(plugins, tuple(profiles), handler)


def _resolve_plugins(
    entries: Sequence[PluginEntry], registry: PluginRegistry, problems: list[str]
) -> tuple[dict[str, ResolvedPlugin], dict[str, int]]:
    """The valid plugin instances by name, and the index in `plugins` of each name."""
    plugins: dict[str, ResolvedPlugin] = {}
    first_seen: dict[str, int] = {}
    for i, inst in enumerate(entries):
        name = inst.instance_name
        if not name:
            problems.append(f"plugins[{i}].name: must not be empty")
            continue
        if name in first_seen:
            problems.append(
                f'plugins[{i}].name: duplicate plugin name "{name}" '
                f"(also plugins[{first_seen[name]}])"
            )
            continue
        first_seen[name] = i
        resolved = _resolve_plugin(i, inst, registry, problems)
        if resolved is not None:
            plugins[name] = resolved
    return plugins, first_seen


def _resolve_plugin(
    i: int, inst: PluginEntry, registry: PluginRegistry, problems: list[str]
) -> ResolvedPlugin | None:
    spec = registry.get(inst.type)
    if spec is None:
        problems.append(
            f'plugins[{i}].type: unknown plugin type "{inst.type}" '
            f"(known: {', '.join(registry.type_names())})"
        )
        return None
    try:
        params = spec.params.model_validate(inst.parameters)
    except ValidationError as exc:
        for err in exc.errors():
            problems.append(f"plugins[{i}].parameters{loc_path(err['loc'])}: {err['msg']}")
        return None
    return ResolvedPlugin(TypedName(spec.type_name, inst.instance_name), spec, params)


def _check_filter_references(
    plugins: dict[str, ResolvedPlugin], index_of: dict[str, int], problems: list[str]
) -> None:
    """Decision-tree references must name filters, and trees must not contain cycles."""
    edges = _filter_edges(plugins, index_of, problems)
    # Depth-first search for a cycle among plugins that refer to other filters.
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
                problems.append(
                    f"plugins[{index_of[nxt]}].parameters: decision trees refer to each "
                    f"other in a cycle ({' -> '.join(cycle)})"
                )
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in edges:
        if name not in state:
            visit(name, [name])


def _filter_edges(
    plugins: dict[str, ResolvedPlugin], index_of: dict[str, int], problems: list[str]
) -> dict[str, list[str]]:
    """Plugin -> the filters its parameters refer to; references to non-filters reported."""
    edges: dict[str, list[str]] = {}
    for name, rp in plugins.items():
        refs_of = rp.spec.filter_references
        if refs_of is None:
            continue
        base = f"plugins[{index_of[name]}].parameters"
        for path, ref in refs_of(rp.params):
            target = plugins.get(ref)
            if target is None:
                problems.append(f'{base}.{path}: unknown plugin "{ref}"')
            elif target.spec.kind is not PluginKind.FILTER:
                problems.append(f'{base}.{path}: "{ref}" is a {target.spec.kind}, not a filter')
            else:
                edges.setdefault(name, []).append(ref)
    return edges
