"""A tiny base for plugins: the instance's typed name, and a readable repr."""

from __future__ import annotations

from poolkeeper.scheduling.interfaces import TypedName


class NamedPlugin:
    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName) -> None:
        self.typed_name = typed_name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typed_name})"
