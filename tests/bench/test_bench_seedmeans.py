"""`poolkeeper bench seeds`: mean-of-seeds tables against the best baseline, and bad files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from poolkeeper.bench.results.seedmeans import check_sweep, mean_points, seed_tables
from poolkeeper.cli.main import main


def _sweep(seed: int, points: dict[tuple[str, float], tuple[float, float, int]]) -> dict[str, Any]:
    runs = [
        {"policy": policy, "load": load,
         "summary": {"ttft_s": {"p90": p90}, "goodput_rps": good, "shed": shed}}
        for (policy, load), (p90, good, shed) in points.items()
    ]  # fmt: skip
    return {"workload": {"kind": "heavy-tail"}, "fleet": {"servers": 8}, "seed": seed, "runs": runs}


SEED1 = {
    ("round-robin", 0.3): (0.030, 90.0, 0), ("gie-v1", 0.3): (0.040, 90.0, 0),
    ("poolkeeper", 0.3): (0.031, 90.0, 0),
    ("round-robin", 1.3): (4.0, 250.0, 0), ("gie-v1", 1.3): (0.50, 330.0, 100),
    ("poolkeeper", 1.3): (0.20, 335.0, 90), ("poolkeeper-ttft", 1.3): (0.60, 320.0, 0),
}  # fmt: skip
SEED2 = {
    **SEED1,
    ("round-robin", 0.3): (0.032, 92.0, 0),
    ("gie-v1", 1.3): (0.70, 340.0, 120),
    ("poolkeeper", 1.3): (0.40, 333.0, 110),
}  # fmt: skip


def test_means_over_seeds_and_the_best_baseline_per_load() -> None:
    only_seed1 = {**SEED1, ("random", 1.3): (0.1, 400.0, 0)}  # absent in seed 2: not averaged
    points, seeds = mean_points([_sweep(1, only_seed1), _sweep(2, SEED2)])
    assert seeds == {("heavy-tail", 8): 2}
    row = points[("heavy-tail", 8)][1.3]
    assert "random" not in row
    assert row["poolkeeper"].p90 == pytest.approx(0.30)
    assert row["gie-v1"].goodput == pytest.approx(335.0)
    assert row["gie-v1"].shed == pytest.approx(110.0)
    text = seed_tables([_sweep(1, only_seed1), _sweep(2, SEED2)])
    assert "#### heavy-tail, 8 servers (2 seeds)" in text
    lines = {line.split("|")[1].strip(): line for line in text.splitlines() if line[:3] == "| 0"}
    lines |= {line.split("|")[1].strip(): line for line in text.splitlines() if line[:3] == "| 1"}
    # 1.3x: best p90 gie-v1 0.60; ours 0.30 -> 0.50; the ttft preset 0.60 -> 1.00, a miss.
    # Goodput: best gie-v1 335.0; ours 334.0 is within 0.5 %, the ttft preset's 320 is not.
    assert lines["1.3"].startswith("| 1.3 | 0.600 (gie-v1) | 0.300 | 0.50 | 0.600 | 1.00* |")
    assert "| 335.0 (gie-v1) | 334.0 | 320.0 (<) | 100 / 0 |" in lines["1.3"]
    # 0.3x: round-robin is the floor itself; no ratio is marked there.
    assert lines["0.3"].startswith("| 0.3 | 0.031 (round-robin) floor | 0.031 | 1.00 |")
    assert "*" not in lines["0.3"]


def test_no_poolkeeper_policy_says_so() -> None:
    baselines = {k: v for k, v in SEED1.items() if not k[0].startswith("poolkeeper")}
    assert seed_tables([_sweep(1, baselines)]) == "no sweep with a poolkeeper policy"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.pop("seed"), "seed: missing"),
        (lambda s: s["fleet"].update(servers="8"), "fleet.servers: missing or not a int"),
        (lambda s: s["runs"][1]["summary"].pop("goodput_rps"), "runs[1].summary.goodput_rps"),
        (lambda s: s["runs"][0]["summary"]["ttft_s"].update(p90="x"), "runs[0].summary.ttft_s.p90"),
    ],
)
def test_a_bad_sweep_names_the_file_and_field(mutate: Any, message: str) -> None:
    sweep = _sweep(1, SEED1)
    mutate(sweep)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_sweep(sweep, "s1/sim-heavy-tail-8.json")


def test_the_command_prints_tables_or_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for seed, points in ((1, SEED1), (2, SEED2)):
        (tmp_path / f"s{seed}").mkdir()
        path = tmp_path / f"s{seed}" / "sim-heavy-tail-8.json"
        path.write_text(json.dumps(_sweep(seed, points)))
    assert main(["bench", "seeds", str(tmp_path / "s1"), str(tmp_path / "s2")]) == 0
    assert "| 1.3 | 0.600 (gie-v1) |" in capsys.readouterr().out
    (tmp_path / "s2" / "sim-heavy-tail-8.json").write_text("{not json")
    assert main(["bench", "seeds", str(tmp_path / "s1"), str(tmp_path / "s2")]) == 2
    err = capsys.readouterr().err
    assert "poolkeeper bench seeds:" in err
    assert "sim-heavy-tail-8.json: Expecting property name" in err
    assert "Traceback" not in err
    assert main(["bench", "seeds", str(tmp_path / "nothing")]) == 2
    assert "no sim-*.json" in capsys.readouterr().err


def test_mixed_criticality_gets_a_table_per_criticality() -> None:
    def sweep(seed: int) -> dict[str, Any]:
        def summary(p90: float, crit: dict[str, float]) -> dict[str, Any]:
            by = {
                name: {"ttft_p90_s": p, "goodput_rps": 10.0, "shed": 0} for name, p in crit.items()
            }
            return {"ttft_s": {"p90": p90}, "goodput_rps": 30.0, "shed": 0, "by_criticality": by}

        crit_rr = {"Critical": 0.05, "Standard": 0.05, "Sheddable": 0.05}
        crit_pk = {"Critical": 0.03, "Standard": 0.06, "Sheddable": 0.5}
        runs = [
            {"policy": "round-robin", "load": 0.9, "summary": summary(0.05, crit_rr)},
            {"policy": "poolkeeper", "load": 0.9, "summary": summary(0.2, crit_pk)},
        ]
        return {
            "workload": {"kind": "mixed-criticality"},
            "fleet": {"servers": 8},
            "seed": seed,
            "runs": runs,
        }

    points, seeds = mean_points([sweep(1), sweep(2)])
    assert seeds[("mixed-criticality [Critical]", 8)] == 2
    assert ("mixed-criticality [Sheddable]", 8) not in points
    assert points[("mixed-criticality [Standard]", 8)][0.9]["poolkeeper"].p90 == 0.06
    text = seed_tables([sweep(1), sweep(2)])
    assert "#### mixed-criticality [Critical], 8 servers (2 seeds)" in text
    # Critical: 0.03 against round-robin's 0.05 -> 0.60; Standard 0.06 -> 1.20 (at its floor).
    critical = text.split("[Critical]", 1)[1].split("####", 1)[0]
    standard = text.split("[Standard]", 1)[1].split("####", 1)[0]
    assert "| 0.9 | 0.050 (round-robin) | 0.030 | 0.60 |" in critical
    assert "| 0.9 | 0.050 (round-robin) floor | 0.060 | 1.20 |" in standard
