"""What one EndpointPickerConfig translation gathers as it goes, and the lookups its steps share.

`TranslationWork` collects the problems (reported together as one ConfigError), the notices
(for the startup log), each plugin instance's validated parameters and upstream entry; `role_of`
says what an instance is (upstream's or one of poolkeeper's own plugins), `one_of` resolves a
`pluginRef` of a given role, `duration_ms` reads an upstream duration. The steps that use them:
`plugin_checks.py`, `scheduling_section.py`, `scraping_section.py`, `flow_sections.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from poolkeeper.config.endpointpicker.catalogue import Params, Role, UpstreamPlugin
from poolkeeper.config.endpointpicker.document import PluginSpec
from poolkeeper.config.endpointpicker.values import parse_duration
from poolkeeper.scheduling.plugins.builtins import builtin_registry
from poolkeeper.scheduling.registry import PluginKind

_ROLE_OF_KIND = {
    PluginKind.FILTER: Role.FILTER,
    PluginKind.SCORER: Role.SCORER,
    PluginKind.PICKER: Role.PICKER,
    PluginKind.PROFILE_HANDLER: Role.PROFILE_HANDLER,
}


@dataclass(slots=True)
class TranslationWork:
    """The problems, notices and plugin instances of one translation so far."""

    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    params: dict[str, Params] = field(default_factory=dict)  # by instance name
    specs: dict[str, UpstreamPlugin | None] = field(default_factory=dict)  # None: poolkeeper's
    raw: dict[str, PluginSpec] = field(default_factory=dict)


def role_of(name: str, work: TranslationWork) -> Role | None:
    spec = work.specs.get(name)
    if spec is not None:
        return spec.role
    registered = builtin_registry().get(work.raw[name].type) if name in work.raw else None
    return _ROLE_OF_KIND[registered.kind] if registered is not None else None


def one_of(role: Role, work: TranslationWork, ref: str | None, where: str) -> str | None:
    """The instance a `pluginRef` names (checked), or the only instance of `role`."""
    if ref is not None:
        if ref not in work.raw:
            work.problems.append(f"{where}: unknown plugin {ref!r}")
            return None
        if role_of(ref, work) is not role:
            work.problems.append(f"{where}: {ref!r} is not a {role}")
            return None
        return ref
    found = [n for n in work.raw if role_of(n, work) is role]
    return found[0] if found else None


def duration_ms(text: str, where: str, work: TranslationWork) -> int | None:
    try:
        return round(parse_duration(text) * 1000)
    except ValueError as exc:
        work.problems.append(f"{where}: {exc}")
        return None
