"""`poolkeeper validate | status | crds`: exit codes, error lines, JSON output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from poolkeeper.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

MODEL = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: %s, creationTimestamp: "%s"}
spec:
  modelName: chat
  poolRef: {name: pool}
"""
POOL = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: pool}
spec: {selector: {app: vllm}, targetPortNumber: 8000, extensionRef: {name: epp}}
"""


@pytest.fixture(autouse=True)
def only_resource_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other command modules are developed in parallel; these tests exercise this module alone.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("poolkeeper.cli.resources",))


def test_validate_examples_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(EXAMPLES / "pool.yaml"), str(EXAMPLES / "models.yaml")]) == 0
    out, err = capsys.readouterr()
    assert "5 objects loaded, 0 errors, 1 notices: valid" in out
    assert "food-review-canary" in out
    assert "skipping apps/v1 Deployment/default/vllm-llama3-8b-instruct" in err


def test_validate_reports_each_error_on_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        POOL.replace("targetPortNumber: 8000", "targetPortNumber: 0")
        + "---\n"
        + (MODEL % ("m", "2025-01-01T00:00:00Z")).replace(
            "modelName: chat", "modelName: chat\n  x: 1"
        )
    )
    assert cli.main(["validate", str(bad)]) == 1
    out, _ = capsys.readouterr()
    error_lines = [line for line in out.splitlines() if line.startswith(str(bad))]
    assert error_lines == [
        f"{bad}:0: InferencePool/default/pool: spec.targetPortNumber: Invalid value: 0: "
        "spec.targetPortNumber in body should be greater than or equal to 1",
        f'{bad}:1: InferenceModel/default/m: spec.x: unknown field "spec.x"',
    ]
    assert "0 objects loaded, 2 errors, 0 notices: INVALID" in out


def test_validate_syntax_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("kind: [\n")
    assert cli.main(["validate", str(bad)]) == 1
    assert f"{bad}:2:1: invalid YAML:" in capsys.readouterr().out


def test_missing_path_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(tmp_path / "nope")]) == 2
    assert "nope: no such file or directory" in capsys.readouterr().err


def test_no_path_at_all_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["validate"])
    assert exc.value.code == 2
    assert "required: PATH" in capsys.readouterr().err


def test_status_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", str(EXAMPLES / "pool.yaml"), str(EXAMPLES / "models.yaml")]) == 0
    out, _ = capsys.readouterr()
    canary = next(line for line in out.splitlines() if "default/food-review-canary" in line)
    assert "ModelNameInUse" in canary
    assert "False" in canary


def test_status_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "objs.yaml"
    f.write_text(
        POOL
        + "---\n"
        + MODEL % ("newer", "2025-02-01T00:00:00Z")
        + "---\n"
        + MODEL % ("older", "2025-01-01T00:00:00Z")
    )
    assert cli.main(["status", "-o", "json", str(f)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["namespace"], r["name"]) for r in rows] == [
        ("InferenceModel", "default", "newer"),
        ("InferenceModel", "default", "older"),
    ]
    reasons = {r["name"]: (r["conditions"][0]["type"], r["conditions"][0]["reason"]) for r in rows}
    assert reasons == {"newer": ("Accepted", "ModelNameInUse"), "older": ("Accepted", "Accepted")}
    assert rows[1]["conditions"][0]["status"] == "True"


def test_status_json_keeps_stdout_parseable_on_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "objs.yaml"
    f.write_text(MODEL % ("m", "2025-01-01T00:00:00Z") + "---\nkind: InferenceModel\n")
    assert cli.main(["status", "-o", "json", str(f)]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)[0]["conditions"][0]["reason"] == "PoolNotFound"
    assert "apiVersion: Required value" in err


def test_crds_prints_five_definitions(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["crds"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["metadata"]["name"] for d in docs] == [
        "inferencemodels.inference.networking.x-k8s.io",
        "inferenceobjectives.llm-d.ai",
        "inferencemodelrewrites.llm-d.ai",
        "inferencepools.inference.networking.x-k8s.io",
        "inferencepools.inference.networking.k8s.io",
    ]
    assert all(d["kind"] == "CustomResourceDefinition" for d in docs)


@pytest.mark.integration
def test_installed_entry_point_validates_examples() -> None:
    exe = Path(sys.executable).parent / "poolkeeper"
    proc = subprocess.run(
        [str(exe), "validate", "examples/"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 errors" in proc.stdout
    assert "Traceback" not in proc.stderr
