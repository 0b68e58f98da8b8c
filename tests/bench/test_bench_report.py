"""Report tables: the acceptance-targets table and the policy x load matrices."""

from __future__ import annotations

from typing import Any

from poolkeeper.bench.fleet.sweep import targets_table
from poolkeeper.bench.results.report import matrix_table, sweep_table


def _run(policy: str, load: float, p90: float, goodput: float) -> dict[str, Any]:
    dist = {"p50": p90 / 2, "p90": p90, "p99": p90 * 2, "mean": p90}
    return {
        "policy": policy,
        "load": load,
        "summary": {
            "ttft_s": dist, "itl_s": dist, "e2e_s": dist, "goodput_rps": goodput,
            "throughput_tok_s": 1000.0, "prefix_hit_rate": 0.5, "shed": 0,
        },
    }  # fmt: skip


SWEEP = {
    "workload": {"kind": "shared-prefix"},
    "policies": ["round-robin", "cache-aware", "poolkeeper"],
    "runs": [
        _run("round-robin", 0.5, 1.0, 10.0),
        _run("cache-aware", 0.5, 0.2, 12.0),
        _run("poolkeeper", 0.5, 0.1, 12.0),
        _run("round-robin", 0.9, 4.0, 5.0),
        _run("cache-aware", 0.9, 0.5, 15.0),
        _run("poolkeeper", 0.9, 0.4, 14.0),
    ],
}


def test_targets_table_ratios_and_goodput_check() -> None:
    table = targets_table([SWEEP])
    row = table.splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "shared-prefix"
    assert cells[1:4] == ["0.400", "4.000", "0.10"]  # vs round-robin at 0.9x
    assert cells[4] == "0.500 (cache-aware)"
    assert cells[5] == "0.80"
    assert cells[6] == "no: 0.9x: 14.0 < 15.0"  # goodput below the best baseline at 0.9x


def test_matrices_and_sweep_table() -> None:
    goodput = matrix_table(SWEEP, "goodput").splitlines()
    assert goodput[0] == "| policy | 0.5x | 0.9x |"
    assert goodput[2] == "| round-robin | 10 | 5 |"
    p90 = matrix_table(SWEEP, "ttft_p90").splitlines()
    assert p90[4] == "| poolkeeper | 0.1 | 0.4 |"
    rows = sweep_table(SWEEP, loads=[0.9]).splitlines()
    assert len(rows) == 2 + 3
    assert rows[2].startswith("| 0.9 | ")
