"""The registry of kinds a loader understands, keyed by (apiVersion, kind).

`default_registry()` holds the API kinds only: every row of the API-generation table
(`poolkeeper.api.versions`). Packages above add their own document kinds by composing a registry
(`poolkeeper.config.load` adds GatewayConfig), so this package never imports them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel

from poolkeeper.api.versions import GENERATIONS


@dataclass(frozen=True, slots=True)
class KindEntry:
    """One (apiVersion, kind) and the pydantic model that validates it."""

    api_version: str
    kind: str
    target: type[BaseModel]


class KindRegistry:
    """Lookup of kinds; build one with `default_registry()` (no shared global instance)."""

    def __init__(self, entries: Iterable[KindEntry]) -> None:
        self._entries = {(e.api_version, e.kind): e for e in entries}

    def lookup(self, api_version: str, kind: str) -> KindEntry | None:
        return self._entries.get((api_version, kind))

    def api_versions_of(self, kind: str) -> list[str]:
        """Every apiVersion registered for `kind` (to explain an unsupported version)."""
        return [v for (v, k) in self._entries if k == kind]

    def entries(self) -> list[KindEntry]:
        return list(self._entries.values())

    def with_entries(self, *entries: KindEntry) -> KindRegistry:
        """This registry plus `entries` (a new registry; this one is unchanged)."""
        return KindRegistry([*self._entries.values(), *entries])


def default_registry() -> KindRegistry:
    """The API kinds: every row of the API-generation table (`poolkeeper.api.versions`)."""
    return KindRegistry(KindEntry(row.api_version, row.kind, row.model) for row in GENERATIONS)
