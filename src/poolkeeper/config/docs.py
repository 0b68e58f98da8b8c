"""Field reference tables of the GatewayConfig, generated from the pydantic schema.

docs/configuration.md carries the output between two marker lines, and the engine table of the
engine registry (`poolkeeper.backend.engines`) between two others; regenerate both with

    .venv/bin/python -m poolkeeper.config.docs docs/configuration.md

Tests check that every section's table and the engine table are current.
"""

from __future__ import annotations

import enum
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from poolkeeper.backend.engines import Engine
from poolkeeper.config.endpoints import StaticEndpoint
from poolkeeper.config.gateway import GatewayConfigSpec
from poolkeeper.envoy.config import Edge, Listeners
from poolkeeper.flowcontrol.bandconfig import BandConfig
from poolkeeper.flowcontrol.bands import Bands
from poolkeeper.flowcontrol.config import HoldNewPrefixes
from poolkeeper.requestcontrol.config import RequestHandling

BEGIN_MARKER = "<!-- BEGIN GENERATED FIELD TABLES (python -m poolkeeper.config.docs) -->"
END_MARKER = "<!-- END GENERATED FIELD TABLES -->"
ENGINES_BEGIN_MARKER = "<!-- BEGIN GENERATED ENGINE TABLE (python -m poolkeeper.config.docs) -->"
ENGINES_END_MARKER = "<!-- END GENERATED ENGINE TABLE -->"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        optional = len(names) < len(args)
        return " or ".join(names) + (" (optional)" if optional else "")
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " | ".join(f"`{m.value}`" for m in annotation)
        if issubclass(annotation, BaseModel):
            return "object"
        return {"int": "integer", "str": "string", "bool": "boolean", "float": "number"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


def _constraints(info: FieldInfo) -> str:
    parts: list[str] = []
    for item in info.metadata:
        if isinstance(item, Ge):
            parts.append(f">= {item.ge}")
        elif isinstance(item, Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, Lt):
            parts.append(f"< {item.lt}")
        elif isinstance(item, Le):
            parts.append(f"<= {item.le}")
        elif isinstance(item, MinLen):
            parts.append(f"length >= {item.min_length}")
        elif isinstance(item, MaxLen):
            parts.append(f"length <= {item.max_length}")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        factory = typing.cast(Callable[[], Any], info.default_factory)
        value = factory()
        if isinstance(value, BaseModel):
            return "(section defaults)"
        if isinstance(value, list | tuple):
            return _yaml_list(value)
        return f"`{value!r}`" if value != {} else "`{}`"
    if info.default is PydanticUndefined:
        return "**required**"
    if info.default is None:
        return "unset"
    value = info.default
    if isinstance(value, list | tuple):
        return _yaml_list(value)
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _yaml_list(values: list[Any] | tuple[Any, ...]) -> str:
    """A list default as a user writes it in YAML, `[a, b]` (enum members by their values, not
    their repr; brackets even for one item, which otherwise reads as a scalar)."""
    items = [v.value if isinstance(v, enum.Enum) else v for v in values]
    if not all(isinstance(v, str | int | float | bool) for v in items):
        return f"`{values!r}`"
    flow = yaml.safe_dump(items, default_flow_style=True, width=sys.maxsize)
    return f"`{flow.strip()}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def field_table(model: type[BaseModel]) -> str:
    """A markdown table: field (camelCase), type and limits, default, description."""
    lines = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        alias = info.alias or name
        kind = _type_name(info.annotation)
        limits = _constraints(info)
        if limits:
            kind += f" ({limits})"
        description = info.description or ""
        lines.append(
            f"| `{alias}` | {_cell(kind)} | {_cell(_default(info))} | {_cell(description)} |"
        )
    return "\n".join(lines)


def _section_model(name: str) -> type[BaseModel]:
    annotation = GatewayConfigSpec.model_fields[name].annotation
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        raise TypeError(f"spec.{name} is not a pydantic model section")
    return annotation


# (heading, model) of every documented section, in the page's order. Each section is declared
# by the package that reads it (config/gateway.py says which); tests check every table is current.
OWN_SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("spec", GatewayConfigSpec),
    ("spec.listeners", Listeners),
    ("spec.endpoints[]", StaticEndpoint),
    ("spec.requestHandling", RequestHandling),
    ("spec.edge", Edge),
    ("spec.scraping", _section_model("scraping")),
    ("spec.admission", _section_model("admission")),
    ("spec.scheduling", _section_model("scheduling")),
    ("spec.flowControl", _section_model("flow_control")),
    ("spec.flowControl.bands", Bands),
    ("spec.flowControl.bands.<critical|standard|sheddable>", BandConfig),
    ("spec.flowControl.holdNewPrefixes", HoldNewPrefixes),
    ("spec.replicaSync", _section_model("replica_sync")),
)


def sections() -> list[tuple[str, type[BaseModel]]]:
    """Every documented section, in the page's order."""
    return list(OWN_SECTIONS)


def section_markdown(heading: str, model: type[BaseModel]) -> str:
    doc = " ".join((model.__doc__ or "").split())
    return f"### `{heading}`\n\n{doc}\n\n{field_table(model)}\n"


def reference_markdown() -> str:
    """The generated block (markers included)."""
    body = "\n".join(section_markdown(heading, model) for heading, model in sections())
    return f"{BEGIN_MARKER}\n\n{body}\n{END_MARKER}"


def engine_table() -> str:
    """A markdown table of the engine registry: names, aliases and the families read."""
    lines = [
        "| Engine | Name | Aliases | Waiting / running / KV usage read from |",
        "|---|---|---|---|",
    ]
    for engine in Engine:
        mapping = engine.mapping
        families = " / ".join(
            " or ".join(f"`{spec}`" for spec in specs) or "(not exported)"
            for specs in (mapping.waiting, mapping.running, mapping.kv_usage)
        )
        aliases = ", ".join(f"`{a}`" for a in engine.definition.aliases) or "-"
        lines.append(
            f"| {engine.definition.title} | `{engine.value}` | {aliases} | {_cell(families)} |"
        )
    return "\n".join(lines)


def engines_markdown() -> str:
    """The generated engine block (markers included)."""
    return f"{ENGINES_BEGIN_MARKER}\n\n{engine_table()}\n\n{ENGINES_END_MARKER}"


def replace_block(
    text: str, block: str, begin: str = BEGIN_MARKER, end_marker: str = END_MARKER
) -> str:
    """`text` with the part between the markers (inclusive) replaced by `block`."""
    start = text.index(begin)
    end = text.index(end_marker) + len(end_marker)
    return text[:start] + block + text[end:]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m poolkeeper.config.docs docs/configuration.md", file=sys.stderr)
        return 2
    path = Path(argv[0])
    text = path.read_text(encoding="utf-8")
    if BEGIN_MARKER not in text or END_MARKER not in text:
        print(f"{path}: the generated-table markers are missing", file=sys.stderr)
        return 1
    text = replace_block(text, reference_markdown())
    if ENGINES_BEGIN_MARKER in text and ENGINES_END_MARKER in text:
        text = replace_block(text, engines_markdown(), ENGINES_BEGIN_MARKER, ENGINES_END_MARKER)
    path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
