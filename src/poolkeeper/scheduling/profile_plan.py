"""The profiles and the profile handler of a build plan (`resolve.py`'s steps): each profile's
filters, weighted scorers and picker, GIE's implicit default profile, the handler named or
implied, and the default picker and handler added as plugin instances where needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolkeeper.scheduling.interfaces import TypedName
from poolkeeper.scheduling.registry import PluginKind, PluginRegistry
from poolkeeper.scheduling.resolved import ProfileEntry, ProfileRef, ResolvedPlugin, ResolvedProfile

DEFAULT_PICKER = "max-score-picker"


DEFAULT_HANDLER = "single-profile-handler"


@dataclass(frozen=True, slots=True)
class _DefaultRef:
    """A plugin of the implicit default profile: no weight given."""

    plugin_ref: str
    weight: float | None = None


def resolve_profiles(
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


def default_profile(plugins: dict[str, ResolvedPlugin], problems: list[str]) -> ResolvedProfile:
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


def resolve_handler(
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


def add_default_picker(
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
