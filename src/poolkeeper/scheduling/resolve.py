"""Check a SchedulingConfig against a plugin registry and resolve it into a build plan.

All cross-reference rules live here, and every problem is reported with its path: unknown
types and parameters, duplicate names, unknown or misplaced references, weights on
non-scorers, more than one picker per profile, decision-tree references and cycles, the
profile handler. Defaults are filled in as GIE's loader does: no profile -> one `default`
profile with every filter, scorer and picker; scorer without weight -> 1; profile without a
picker -> max-score-picker; no handler -> single-profile-handler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.config import ProfilePluginRef, SchedulingConfig
from poolkeeper.scheduling.interfaces import TypedName
from poolkeeper.scheduling.registry import PluginKind, PluginParams, PluginRegistry, PluginSpec

DEFAULT_PICKER = "max-score-picker"
DEFAULT_HANDLER = "single-profile-handler"


@dataclass(frozen=True, slots=True)
class ResolvedPlugin:
    typed_name: TypedName
    spec: PluginSpec
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


def _registry(registry: PluginRegistry | None) -> PluginRegistry:
    if registry is not None:
        return registry
    from poolkeeper.scheduling.plugins.builtins import builtin_registry

    return builtin_registry()


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def check_scheduling_config(
    config: SchedulingConfig, registry: PluginRegistry | None = None
) -> list[str]:
    """Every problem of `config`, each as `path: message`; [] when it is valid."""
    problems: list[str] = []
    _resolve(config, _registry(registry), problems)
    return problems


def resolve_scheduling(
    config: SchedulingConfig, registry: PluginRegistry | None = None
) -> ResolvedScheduling:
    """The build plan for `config`; raises ConfigError listing every problem."""
    problems: list[str] = []
    resolved = _resolve(config, _registry(registry), problems)
    if problems or resolved is None:
        raise ConfigError("invalid scheduling config:\n  " + "\n  ".join(problems))
    return resolved


def _resolve(
    config: SchedulingConfig, registry: PluginRegistry, problems: list[str]
) -> ResolvedScheduling | None:
    if config.preset is not None:
        if config.plugins or config.scheduling_profiles or config.profile_handler:
            problems.append(
                "preset: a preset cannot be combined with plugins, schedulingProfiles or "
                "profileHandler"
            )
            return None
        from poolkeeper.scheduling.presets import PRESETS, preset_config

        if config.preset not in PRESETS:
            problems.append(
                f'preset: unknown preset "{config.preset}" (known: {", ".join(sorted(PRESETS))})'
            )
            return None
        inner = _resolve(preset_config(config.preset), registry, problems)
        if inner is None:
            return None
        return ResolvedScheduling(
            inner.plugins, inner.profiles, inner.handler, source=f"preset {config.preset}"
        )
    if not config.plugins and not config.scheduling_profiles and not config.profile_handler:
        from poolkeeper.scheduling.presets import preset_config

        inner = _resolve(preset_config("default"), registry, problems)
        if inner is None:
            return None
        return ResolvedScheduling(inner.plugins, inner.profiles, inner.handler, "preset default")

    plugins: dict[str, ResolvedPlugin] = {}
    first_seen: dict[str, int] = {}
    for i, inst in enumerate(config.plugins):
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
        spec = registry.get(inst.type)
        if spec is None:
            problems.append(
                f'plugins[{i}].type: unknown plugin type "{inst.type}" '
                f"(known: {', '.join(registry.type_names())})"
            )
            continue
        try:
            params = spec.params.model_validate(inst.parameters)
        except ValidationError as exc:
            for err in exc.errors():
                problems.append(f"plugins[{i}].parameters{_loc(err['loc'])}: {err['msg']}")
            continue
        plugins[name] = ResolvedPlugin(TypedName(spec.type_name, name), spec, params)

    _check_filter_references(config, plugins, first_seen, problems)

    profiles: list[ResolvedProfile] = []
    if config.scheduling_profiles:
        seen_profiles: set[str] = set()
        for p, prof_cfg in enumerate(config.scheduling_profiles):
            if prof_cfg.name in seen_profiles:
                problems.append(
                    f'schedulingProfiles[{p}].name: duplicate profile "{prof_cfg.name}"'
                )
            seen_profiles.add(prof_cfg.name)
            profiles.append(_resolve_profile(p, prof_cfg.name, prof_cfg.plugins, plugins, problems))
    else:
        # GIE's loader default: one profile with every filter, scorer and picker, in order,
        # except filters that decision trees use (a tree's drop leaf must not run on its own).
        in_trees = {
            ref
            for rp in plugins.values()
            if rp.spec.filter_references is not None
            for _path, ref in rp.spec.filter_references(rp.params)
        }
        names = [
            n
            for n, rp in plugins.items()
            if rp.spec.kind is not PluginKind.PROFILE_HANDLER and n not in in_trees
        ]
        refs = [ProfilePluginRef.model_validate({"pluginRef": n}) for n in names]
        profiles.append(_resolve_profile(None, "default", refs, plugins, problems))

    handler = _resolve_handler(config, plugins, len(profiles), registry, problems)
    for prof in profiles:
        if prof.picker == DEFAULT_PICKER and DEFAULT_PICKER not in plugins:
            spec = registry.get(DEFAULT_PICKER)
            if spec is not None:
                plugins[DEFAULT_PICKER] = ResolvedPlugin(
                    TypedName(DEFAULT_PICKER, DEFAULT_PICKER), spec, spec.params()
                )
    if problems or handler is None:
        return None
    return ResolvedScheduling(plugins, tuple(profiles), handler)


def _resolve_profile(
    index: int | None,
    name: str,
    refs: Sequence[ProfilePluginRef],
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
    config: SchedulingConfig,
    plugins: dict[str, ResolvedPlugin],
    n_profiles: int,
    registry: PluginRegistry,
    problems: list[str],
) -> str | None:
    handlers = [n for n, rp in plugins.items() if rp.spec.kind is PluginKind.PROFILE_HANDLER]
    if config.profile_handler is not None:
        rp = plugins.get(config.profile_handler)
        if rp is None:
            problems.append(f'profileHandler: unknown plugin "{config.profile_handler}"')
            return None
        if rp.spec.kind is not PluginKind.PROFILE_HANDLER:
            problems.append(
                f'profileHandler: "{config.profile_handler}" is a {rp.spec.kind}, '
                "not a profile handler"
            )
            return None
        name = config.profile_handler
    elif len(handlers) > 1:
        problems.append(
            f"profileHandler: several profile handlers in plugins ({', '.join(handlers)}); name one"
        )
        return None
    elif handlers:
        name = handlers[0]
    else:
        name = DEFAULT_HANDLER
        spec = registry.get(DEFAULT_HANDLER)
        if spec is None:
            problems.append(f"profileHandler: the registry has no {DEFAULT_HANDLER}")
            return None
        plugins.setdefault(name, ResolvedPlugin(TypedName(name, name), spec, spec.params()))
    if plugins[name].spec.type_name == DEFAULT_HANDLER and n_profiles != 1:
        problems.append(
            f"schedulingProfiles: {DEFAULT_HANDLER} runs exactly one profile, "
            f"but {n_profiles} are configured"
        )
    return name


def _check_filter_references(
    config: SchedulingConfig,
    plugins: dict[str, ResolvedPlugin],
    index_of: dict[str, int],
    problems: list[str],
) -> None:
    """Decision-tree references must name filters, and trees must not contain cycles."""
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
