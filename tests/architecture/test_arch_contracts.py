"""The import contracts hold the design of docs/architecture.md, not today's imports.

Each case copies the source tree, adds one import the design forbids, and runs import-linter
with the project's own contracts on the copy: the run must fail. A control run on the unchanged
copy must pass, so a failure cannot come from the set-up. Import-linter cannot see imports made
through `importlib`, so a second check keeps those to the command table of `cli/main.py`.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "poolkeeper"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

# (module file that gains the import, module it imports): each edge the design forbids.
FORBIDDEN = [
    # the three edges issue 31 found passing under the old contract
    ("backend/scraper.py", "poolkeeper.scheduling"),  # siblings: scrapers never schedule
    ("sim/engine.py", "poolkeeper.extproc"),  # the simulator is below the wire layers
    ("flowcontrol/dispatcher.py", "poolkeeper.scheduling.profile"),  # whether/when vs where
    # the rest of the picture
    ("flowcontrol/headroom.py", "poolkeeper.scheduling.types"),
    ("scheduling/scheduler.py", "poolkeeper.flowcontrol"),
    ("sim/engine.py", "poolkeeper.scheduling"),
    ("datastore/store.py", "poolkeeper.scheduling"),  # the views sit below both
    ("api/kinds.py", "poolkeeper.config.gateway"),  # api registers API kinds only
    ("requestcontrol/director.py", "poolkeeper.config.gateway"),  # sections, not the document
    ("envoy/params.py", "poolkeeper.config.gateway"),
    ("extproc/server.py", "poolkeeper.envoy"),
    ("sim/virtual.py", "poolkeeper.server"),
    ("bench/fleet/simrun.py", "poolkeeper.server.wiring"),  # bench is a tool, from outside
    ("bench/workload/workloads.py", "poolkeeper.bench.fleet"),
]

# importlib is allowed only where the top layer loads its own command modules.
IMPORTLIB_ALLOWED = {"cli/main.py"}


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copytree(
        SRC, tmp_path / "src" / "poolkeeper", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


def test_the_unchanged_copy_keeps_every_contract(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module_file", "target"), FORBIDDEN, ids=[f"{m}->{t}" for m, t in FORBIDDEN]
)
def test_a_forbidden_import_breaks_a_contract(tree: Path, module_file: str, target: str) -> None:
    path = tree / "src" / "poolkeeper" / module_file
    assert path.exists(), f"{module_file} moved: update FORBIDDEN"
    path.write_text(path.read_text() + f"\nimport {target}  # noqa: injected by the test\n")
    result = _lint(tree)
    assert result.returncode != 0, f"{module_file} -> {target} was not refused:\n{result.stdout}"
    assert "BROKEN" in result.stdout


def _hides_an_import(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name == "importlib" for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.module == "importlib"
    return isinstance(node, ast.Name) and node.id == "__import__"


def _importlib_uses(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt | ast.expr) and _hides_an_import(node)
    ]


def test_no_module_hides_an_import_from_the_contracts() -> None:
    offenders = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if str(path.relative_to(SRC)) not in IMPORTLIB_ALLOWED
        for line in _importlib_uses(path)
    ]
    assert offenders == [], "imports through importlib are invisible to import-linter"
