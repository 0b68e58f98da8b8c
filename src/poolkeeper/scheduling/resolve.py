"""Resolve one plugins/profiles document against a plugin registry into a build plan.

All cross-reference rules live here, and every problem is reported with its path: unknown
types and parameters, duplicate names, unknown or misplaced references, weights on
non-scorers, more than one picker per profile, decision-tree references and cycles, the
profile handler. Defaults are filled in as GIE's loader does: no profile -> one `default`
profile with every filter, scorer and picker; scorer without weight -> 1; profile without a
picker -> max-score-picker; no handler -> single-profile-handler.

Presets are not known here: `SchedulingConfig` (config.py) turns a preset name into its
document and feeds it to `resolve` like any other. The document is typed by the protocols
below, so this module needs nothing from the config schema above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.interfaces import TypedName
from poolkeeper.scheduling.registry import PluginKind, PluginParams, PluginRegistry, PluginSpec

DEFAULT_PICKER = "max-score-picker"
DEFAULT_HANDLER = "single-profile-handler"


class PluginEntry(Protocol):
    """One entry of `plugins` (config.PluginInstanceConfig)."""

    @property
    def type(self) -> str: ...
    @property
    def instance_name(self) -> str: ...
    @property
    def parameters(self) -> Mapping[str, Any]: ...


class ProfileRef(Protocol):
    """One plugin of a profile (config.ProfilePluginRef)."""

    @property
    def plugin_ref(self) -> str: ...
    @property
    def weight(self) -> float | None: ...


class ProfileEntry(Protocol):
    """One entry of `schedulingProfiles` (config.SchedulingProfileConfig)."""

    @property
    def name(self) -> str: ...
    @property
    def plugins(self) -> Sequence[ProfileRef]: ...


class SchedulingDocument(Protocol):
    """A plugins/profiles document (config.SchedulingConfig without its preset)."""

    @property
    def plugins(self) -> Sequence[PluginEntry]: ...
    @property
    def scheduling_profiles(self) -> Sequence[ProfileEntry]: ...
    @property
    def profile_handler(self) -> str | None: ...


class InvalidSchedulingConfig(ConfigError, ValueError):
    """Every problem of a scheduling document, each as `path: message`.

    A ValueError too, so that pydantic reports it when the config validator raises it.
    """

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("invalid scheduling config:\n  " + "\n  ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True, slots=True)
class ResolvedPlugin:
    typed_name: TypedName
    # Not compared: registries build their specs afresh, so equal plans from two registries
    # would otherwise differ (the type name is in `typed_name`).
    spec: PluginSpec = field(compare=False)
    params: PluginParams


@dataclass(frozen=True, slots=True)
class ResolvedProfile:
    name: str
    filters: tuple[str, ...]
    scorers: tuple[tuple[str, float], ...]
    picker: str


@dataclass(frozen=True, slots=True)
class ResolvedScheduling:
    """Plugin instances by name (implicit defaults included) and the profiles using them."""

    plugins: dict[str, ResolvedPlugin]
    profiles: tuple[ResolvedProfile, ...]
    handler: str
    source: str = field(default="config")  # "config" or "preset <name>"


@dataclass(frozen=True, slots=True)
class _DefaultRef:
    """A plugin of the implicit default profile: no weight given."""

    plugin_ref: str
    weight: float | None = None


def resolve(doc: SchedulingDocument, registry: PluginRegistry) -> ResolvedScheduling:
    """The build plan for `doc`; raises InvalidSchedulingConfig listing every problem."""
    problems: list[str] = []
    plugins, index_of = _resolve_plugins(doc.plugins, registry, problems)
    _check_filter_references(plugins, index_of, problems)
    if doc.scheduling_profiles:
        profiles = _resolve_profiles(doc.scheduling_profiles, plugins, problems)
    else:
        profiles = [_default_profile(plugins, problems)]
    handler = _resolve_handler(doc.profile_handler, plugins, len(profiles), registry, problems)
    _add_default_picker(profiles, plugins, registry)
    if problems or handler is None:
        raise InvalidSchedulingConfig(problems)
    return ResolvedScheduling(plugins, tuple(profiles), handler)


def problems_of(exc: ValidationError) -> list[str]:
    """The problems of a failed SchedulingConfig validation, as `resolve` reports them."""
    out: list[str] = []
    for err in exc.errors():
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, InvalidSchedulingConfig):
            out.extend(cause.problems)
        else:
            out.append(f"{_loc(err['loc']).lstrip('.')}: {err['msg']}")
    return out


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


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
            problems.append(f"plugins[{i}].parameters{_loc(err['loc'])}: {err['msg']}")
        return None
    return ResolvedPlugin(TypedName(spec.type_name, inst.instance_name), spec, params)


def _resolve_profiles(
    entries: Sequence[ProfileEntry], plugins: dict[str, ResolvedPlugin], problems: list[str]
) -> list[ResolvedProfile]:
    profiles: list[ResolvedProfile] = []
    seen: set[str] = set()
    for p, entry in enumerate(entries):
        if entry.name in seen:
            problems.append(f'schedulingProfiles[{p}].name: duplicate profile "{entry.name}"')
        seen.add(entry.name)
        profiles.append(_resolve_profile(p, entry.name, entry.plugins, plugins, problems))
    return profiles


def _default_profile(plugins: dict[str, ResolvedPlugin], problems: list[str]) -> ResolvedProfile:
    """GIE's loader default: one profile with every filter, scorer and picker, in order,
    except filters that decision trees use (a tree's drop leaf must not run on its own)."""
    in_trees = {
        ref
        for rp in plugins.values()
        if rp.spec.filter_references is not None
        for _path, ref in rp.spec.filter_references(rp.params)
    }
    refs = [
        _DefaultRef(n)
        for n, rp in plugins.items()
        if rp.spec.kind is not PluginKind.PROFILE_HANDLER and n not in in_trees
    ]
    return _resolve_profile(None, "default", refs, plugins, problems)


def _resolve_profile(
    index: int | None,
    name: str,
    refs: Sequence[ProfileRef],
    plugins: dict[str, ResolvedPlugin],
    problems: list[str],
) -> ResolvedProfile:
    base = f"schedulingProfiles[{index}]" if index is not None else "(default profile)"
    filters: list[str] = []
    scorers: list[tuple[str, float]] = []
    pickers: list[str] = []
    used: set[str] = set()
    for k, ref in enumerate(refs):
        path = f"{base}.plugins[{k}]"
        rp = plugins.get(ref.plugin_ref)
        if rp is None:
            problems.append(f'{path}.pluginRef: unknown plugin "{ref.plugin_ref}"')
            continue
        if ref.plugin_ref in used:
            problems.append(f'{path}.pluginRef: plugin "{ref.plugin_ref}" is listed twice')
            continue
        used.add(ref.plugin_ref)
        kind = rp.spec.kind
        if ref.weight is not None and kind is not PluginKind.SCORER:
            problems.append(
                f'{path}.weight: only scorers take a weight ("{ref.plugin_ref}" is a {kind})'
            )
        if kind is PluginKind.FILTER:
            filters.append(ref.plugin_ref)
        elif kind is PluginKind.SCORER:
            scorers.append((ref.plugin_ref, 1.0 if ref.weight is None else ref.weight))
        elif kind is PluginKind.PICKER:
            pickers.append(ref.plugin_ref)
        else:
            problems.append(
                f'{path}.pluginRef: "{ref.plugin_ref}" is a {kind}; set it as profileHandler'
            )
    if len(pickers) > 1:
        problems.append(
            f"{base}.plugins: exactly one picker per profile, got {len(pickers)} "
            f"({', '.join(pickers)})"
        )
    return ResolvedProfile(
        name, tuple(filters), tuple(scorers), pickers[0] if pickers else DEFAULT_PICKER
    )


def _resolve_handler(
    configured: str | None,
    plugins: dict[str, ResolvedPlugin],
    n_profiles: int,
    registry: PluginRegistry,
    problems: list[str],
) -> str | None:
    """The profile handler's instance name (the default one added to `plugins` if needed)."""
    name = _pick_handler(configured, plugins, registry, problems)
    if name is None:
        return None
    if plugins[name].spec.type_name == DEFAULT_HANDLER and n_profiles != 1:
        problems.append(
            f"schedulingProfiles: {DEFAULT_HANDLER} runs exactly one profile, "
            f"but {n_profiles} are configured"
        )
    return name


def _pick_handler(
    configured: str | None,
    plugins: dict[str, ResolvedPlugin],
    registry: PluginRegistry,
    problems: list[str],
) -> str | None:
    if configured is not None:
        rp = plugins.get(configured)
        if rp is None:
            problems.append(f'profileHandler: unknown plugin "{configured}"')
            return None
        if rp.spec.kind is not PluginKind.PROFILE_HANDLER:
            problems.append(
                f'profileHandler: "{configured}" is a {rp.spec.kind}, not a profile handler'
            )
            return None
        return configured
    handlers = [n for n, rp in plugins.items() if rp.spec.kind is PluginKind.PROFILE_HANDLER]
    if len(handlers) > 1:
        problems.append(
            f"profileHandler: several profile handlers in plugins ({', '.join(handlers)}); name one"
        )
        return None
    if handlers:
        return handlers[0]
    if not _add_default(DEFAULT_HANDLER, plugins, registry):
        problems.append(f"profileHandler: the registry has no {DEFAULT_HANDLER}")
        return None
    return DEFAULT_HANDLER


def _add_default_picker(
    profiles: Sequence[ResolvedProfile],
    plugins: dict[str, ResolvedPlugin],
    registry: PluginRegistry,
) -> None:
    if any(prof.picker == DEFAULT_PICKER for prof in profiles):
        _add_default(DEFAULT_PICKER, plugins, registry)


def _add_default(
    type_name: str, plugins: dict[str, ResolvedPlugin], registry: PluginRegistry
) -> bool:
    """Add an instance of `type_name` with default parameters, named after its type, unless
    `plugins` already has that name; False if the registry lacks the type."""
    spec = registry.get(type_name)
    if spec is None:
        return False
    plugins.setdefault(
        type_name, ResolvedPlugin(TypedName(type_name, type_name), spec, spec.params())
    )
    return True


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
