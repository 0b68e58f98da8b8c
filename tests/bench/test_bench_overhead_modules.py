"""`bench overhead` runs benchmark modules shipped in the package, so no checkout is needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from poolkeeper.bench.overhead.overhead import DECISION_MODULE, GATEWAY_MODULE


@pytest.mark.integration
def test_decision_benchmark_runs_outside_a_checkout(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", DECISION_MODULE, "--sizes", "10", "--decisions", "20",
         "--warmup", "5"],
        cwd=tmp_path,  # no pyproject.toml, no benchmarks/ folder anywhere above
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "| 10 |" in proc.stdout


@pytest.mark.integration
def test_gateway_benchmark_is_importable_outside_a_checkout(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", GATEWAY_MODULE, "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--rates" in proc.stdout
