"""`poolkeeper validate | status | crds`: check API objects in files, show computed InferenceModel
status, print the CRDs.

Exit codes: 0 all good, 1 invalid objects, 2 usage errors (such as a path that does not exist).
Errors go to stdout, one per line (`PATH[:DOC]: Kind/namespace/name: field.path: message`);
notices (skipped kinds) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from poolkeeper.api.crds import crds_yaml
from poolkeeper.api.load_results import LoadedResource, LoadResult
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import InferencePool, InferencePoolV1, InferencePoolV1Alpha1
from poolkeeper.api.rewrite import InferenceModelRewrite
from poolkeeper.api.status import compute_model_statuses
from poolkeeper.config.load import load_paths
from poolkeeper.datastore.models import build_model_index


def register(subparsers: Any) -> None:
    validate = subparsers.add_parser(
        "validate",
        help="check InferencePool / InferenceModel / GatewayConfig files",
        description="Validate API objects in files and directories (YAML, JSON, kind: List) "
        "the way the Kubernetes API server would. Exit 0 when every object is valid, 1 otherwise.",
    )
    validate.add_argument("paths", nargs="+", metavar="PATH", help="file or directory")
    validate.set_defaults(handler=run_validate)

    status = subparsers.add_parser(
        "status",
        help="show the computed status of InferenceModels",
        description="Compute each InferenceModel's Accepted condition from the pools and models "
        "in the given files (modelName conflicts, missing pools, zero weights).",
    )
    status.add_argument("paths", nargs="+", metavar="PATH", help="file or directory")
    status.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="output format"
    )
    status.set_defaults(handler=run_status)

    crds = subparsers.add_parser(
        "crds",
        help="print the CustomResourceDefinitions as YAML",
        description="Print the InferenceModel and InferencePool CRDs (generated from the same "
        "types poolkeeper validates with), ready for `kubectl apply -f -`.",
    )
    crds.set_defaults(handler=run_crds)


def _console() -> Console:
    # Off a terminal (pipes, CI logs) rich would assume 80 columns and wrap every cell.
    width = None if sys.stdout.isatty() else 200
    return Console(file=sys.stdout, highlight=False, soft_wrap=True, width=width)


def _load(paths: Sequence[str], *, errors_to_stderr: bool = False) -> LoadResult | None:
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        for path in missing:
            print(f"poolkeeper: error: {path}: no such file or directory", file=sys.stderr)
        return None
    result = load_paths(paths)
    for notice in result.notices:
        print(notice, file=sys.stderr)
    for error in result.errors:
        print(error, file=sys.stderr if errors_to_stderr else sys.stdout)
    return result


def run_validate(args: argparse.Namespace) -> int:
    result = _load(args.paths)
    if result is None:
        return 2
    console = _console()
    if result.resources:
        console.print(_summary_table(result.resources))
    verdict = "valid" if result.ok else "INVALID"
    console.print(
        Text(
            f"{len(result.resources)} objects loaded, {len(result.errors)} errors, "
            f"{len(result.notices)} notices: {verdict}"
        )
    )
    return 0 if result.ok else 1


def _summary_table(resources: Sequence[LoadedResource]) -> Table:
    table = Table(title="Loaded objects")
    for column in ("Kind", "API version", "Namespace/Name", "Details", "Source"):
        table.add_column(column)
    for res in resources:
        obj = res.obj
        api_version = str(getattr(obj, "api_version", ""))
        kind = str(getattr(obj, "kind", type(obj).__name__))
        meta = getattr(obj, "metadata", None)
        name = f"{getattr(meta, 'namespace', 'default')}/{getattr(meta, 'name', '')}"
        table.add_row(*(Text(x) for x in (kind, api_version, name, _details(obj), res.location)))
    return table


def _details(obj: object) -> str:
    if isinstance(obj, InferenceModel):
        spec = obj.spec
        targets = ", ".join(
            t.name if t.weight is None else f"{t.name}={t.weight}" for t in spec.target_models
        )
        crit = spec.criticality.value if spec.criticality else "(Standard)"
        text = f"model {spec.model_name} -> pool {spec.pool_ref.name}, {crit}"
        return text + (f", targets {targets}" if targets else "")
    if isinstance(obj, InferenceObjective):
        return f"pool {obj.spec.pool_ref.name}, priority {obj.priority} ({obj.criticality})"
    if isinstance(obj, InferenceModelRewrite):
        rules = "; ".join(
            f"{'|'.join(r.exact_models()) or '*'} -> "
            + ", ".join(
                t.model_rewrite if t.weight is None else f"{t.model_rewrite}={t.weight}"
                for t in r.targets
            )
            for r in obj.spec.rules
        )
        return f"pool {obj.spec.pool_ref.name}: {rules}"
    if isinstance(obj, InferencePoolV1Alpha1 | InferencePool | InferencePoolV1):
        selector = ",".join(f"{k}={v}" for k, v in sorted(obj.selector().items()))
        ports = ",".join(str(p) for p in obj.target_ports())
        epp = obj.endpoint_picker().name or "(built-in)"
        return f"selector {selector}, ports {ports}, epp {epp} ({obj.failure_mode()})"
    return ""


def run_status(args: argparse.Namespace) -> int:
    # With -o json stdout must stay parseable, so load errors go to stderr.
    result = _load(args.paths, errors_to_stderr=args.output == "json")
    if result is None:
        return 2
    models = result.models()
    policies: list[InferenceObjective | InferenceModelRewrite] = [
        *result.objectives(),
        *result.rewrites(),
    ]
    index = build_model_index(result.pools(), [*models, *policies])
    statuses = compute_model_statuses(models, index.verdicts, now=datetime.now(UTC))
    # (kind, key, model name, pool, [(type, status, reason, message)])
    rows: list[tuple[str, str, str, str, list[tuple[str, str, str, str]]]] = [
        (
            m.kind,
            m.key,
            m.spec.model_name,
            m.spec.pool_ref.name,
            [(c.type, c.status, c.reason, c.message) for c in statuses[m.key].conditions],
        )
        for m in models
    ]
    for obj in policies:
        verdicts = (
            index.objective_verdicts
            if isinstance(obj, InferenceObjective)
            else index.rewrite_verdicts
        )
        v = verdicts[obj.key]
        accepted = ("Accepted", v.status, v.reason, v.message)
        rows.append((obj.kind, obj.key, "", obj.spec.pool_ref.name, [accepted]))
    if args.output == "json":
        out = [
            {
                "kind": kind,
                "namespace": key.split("/", 1)[0],
                "name": key.split("/", 1)[1],
                "conditions": (
                    [c.to_dict() for c in statuses[key].conditions]
                    if kind == "InferenceModel"
                    else [
                        dict(zip(("type", "status", "reason", "message"), c, strict=True))
                        for c in conds
                    ]
                ),
            }
            for kind, key, _, _, conds in rows
        ]
        print(json.dumps(out, indent=2))
    else:
        table = Table(title="Status")
        for column in (
            "Kind",
            "Namespace/Name",
            "Model Name",
            "Pool",
            "Type",
            "Status",
            "Reason",
            "Message",
        ):
            table.add_column(column)
        for kind, key, model_name, pool_name, conds in rows:
            for cond in conds:
                table.add_row(*(Text(x) for x in (kind, key, model_name, pool_name, *cond)))
        _console().print(table)
    return 0 if result.ok else 1


def run_crds(args: argparse.Namespace) -> int:
    sys.stdout.write(crds_yaml())
    return 0
