"""Workloads as JSONL files (`bench workload --out w.jsonl`): one header line with the
workload's metadata, then one request per line; a bad line is a ConfigError naming its file
and line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.bench.workload.workload_spec import Arrival
from poolkeeper.errors import ConfigError

_HEADER_KEY = "poolkeeper_workload"


def save_jsonl(path: Path, arrivals: Iterable[Arrival], meta: dict[str, Any]) -> None:
    """One header line ({"poolkeeper_workload": meta}) then one JSON object per request."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps({_HEADER_KEY: meta}) + "\n")
        for a in arrivals:
            row = {
                "request_id": a.request_id,
                "time": round(a.time, 6),
                "model": a.model,
                "target_model": a.target_model,
                "criticality": str(a.criticality),
                "system": a.system,
                "user": a.user,
                "output_tokens": a.output_tokens,
                "group": a.group,
            }
            fh.write(json.dumps(row) + "\n")


def _parse_row(path: Path, lineno: int, row: Any) -> Arrival:
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    try:
        return Arrival(
            request_id=str(row["request_id"]),
            time=float(row["time"]),
            model=str(row["model"]),
            target_model=str(row.get("target_model", row["model"])),
            criticality=Criticality(row.get("criticality", "Standard")),
            system=str(row.get("system", "")),
            user=str(row["user"]),
            output_tokens=int(row["output_tokens"]),
            group=str(row.get("group", "")),
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: bad value: {exc}") from exc


def iter_jsonl(path: Path) -> Iterator[Arrival]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from exc
            if isinstance(row, dict) and _HEADER_KEY in row:
                continue
            yield _parse_row(path, lineno, row)


def load_jsonl(path: Path) -> tuple[dict[str, Any], list[Arrival]]:
    """The header's metadata (empty if absent) and the arrivals, sorted by time."""
    meta: dict[str, Any] = {}
    with path.open(encoding="utf-8") as fh:
        first = fh.readline()
    try:
        head = json.loads(first) if first.strip() else None
    except json.JSONDecodeError:
        head = None
    if isinstance(head, dict) and isinstance(head.get(_HEADER_KEY), dict):
        meta = head[_HEADER_KEY]
    arrivals = sorted(iter_jsonl(path), key=lambda a: a.time)
    return meta, arrivals
