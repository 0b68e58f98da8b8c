"""Every module the docs name exists: file paths (`controller/files.py`, `tests/...py`) and
dotted references (`poolkeeper.config.docs`, `datastore.endpoint.EndpointState`).

Dated notes (docs/notes/) describe the code as it was, so they are not checked.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "poolkeeper"
DOCS = sorted(p for p in (ROOT / "docs").rglob("*.md") if "notes" not in p.parts)
DOCS.append(ROOT / "README.md")
TOP = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {
    p.stem for p in PACKAGE.glob("*.py")
}
PY_FILES = {p.name for d in ("src", "tests") for p in (ROOT / d).rglob("*.py")}
PATH = re.compile(r"(?<![\w./-])([\w./-]+\.py)\b")
DOTTED = re.compile(r"`((?:poolkeeper\.)?[a-z_]+(?:\.[A-Za-z_]\w*)+)(?:\(|`)")


def _path_exists(ref: str) -> bool:
    ref = ref.removeprefix("./")
    if "/" not in ref:  # a bare file name, read in its section's context
        return ref in PY_FILES
    return any((base / ref).exists() for base in (ROOT, ROOT / "src", PACKAGE, ROOT / "tests"))


def _dotted_resolves(ref: str) -> bool:
    prefixed = ref.startswith("poolkeeper.")
    parts = ref.removeprefix("poolkeeper.").split(".")
    if parts[0] not in TOP or "__mutmut_" in ref:  # mutant names in docs/testing.md
        return True
    for split in range(len(parts), 0, -1):
        path = PACKAGE.joinpath(*parts[:split])
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            break
    if split == 1 and not prefixed:
        return True  # `config.spec.edge`: a runtime attribute path, not a module reference
    obj: object = importlib.import_module("poolkeeper." + ".".join(parts[:split]))
    for attr in parts[split:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_module_references_in_docs_exist(doc: Path) -> None:
    missing = []
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        missing += [f"{number}: {m}" for m in PATH.findall(line) if not _path_exists(m)]
        missing += [f"{number}: {m}" for m in DOTTED.findall(line) if not _dotted_resolves(m)]
    assert not missing, f"{doc.relative_to(ROOT)} names modules that do not exist: {missing}"


def test_the_checks_catch_a_stale_reference() -> None:
    assert not _path_exists("backend/mappings.py")
    assert not _dotted_resolves("poolkeeper.backend.mappings.mapping_for")
    assert not _dotted_resolves("datastore.endpoint.EndpointStats")
    assert not _dotted_resolves("poolkeeper.api.status.resolve_model_names")
    assert _dotted_resolves("datastore.endpoint.EndpointState")
    assert _path_exists("controller/files.py")
