"""Workload generators: determinism, pairing across loads, distribution shape, file round trip."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.bench.workload.workload_files import load_jsonl, save_jsonl
from poolkeeper.bench.workload.workload_spec import WorkloadKind, WorkloadSpec, default_spec
from poolkeeper.bench.workload.workloads import generate, mean_request_shape
from poolkeeper.errors import ConfigError


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_same_seed_same_workload_and_different_seed_differs(kind: WorkloadKind) -> None:
    spec = default_spec(kind, servers=4)
    a = generate(spec, rate=20, duration=10, seed=7)
    b = generate(spec, rate=20, duration=10, seed=7)
    c = generate(spec, rate=20, duration=10, seed=8)
    assert a == b
    assert [x.user for x in a] != [x.user for x in c]


def test_contents_are_paired_across_rates() -> None:
    spec = default_spec(WorkloadKind.HEAVY_TAIL, servers=4)
    slow = generate(spec, rate=10, duration=30, seed=3)
    fast = generate(spec, rate=40, duration=30, seed=3)
    n = min(len(slow), len(fast))
    assert n > 100
    assert [a.user for a in slow[:n]] == [a.user for a in fast[:n]]
    assert [a.output_tokens for a in slow[:n]] == [a.output_tokens for a in fast[:n]]


def test_poisson_rate_and_window() -> None:
    arrivals = generate(default_spec("heavy-tail", 4), rate=50, duration=40, seed=1)
    assert all(0 < a.time < 40 for a in arrivals)
    assert all(x.time <= y.time for x, y in itertools.pairwise(arrivals))
    # 2000 expected; a Poisson count is within 5 standard deviations (~224) of it.
    assert abs(len(arrivals) - 2000) < 224


def test_sharegpt_like_lengths_match_published_means_and_are_heavy_tailed() -> None:
    spec = default_spec("heavy-tail", 4)
    prompt, output = mean_request_shape(spec, seed=5, samples=4000)
    # Targets: ShareGPT means 161 (input) and 338 (output) tokens; chat markup adds ~8 tokens.
    assert 140 < prompt < 200
    assert 290 < output < 380
    lengths = sorted(a.output_tokens for a in generate(spec, rate=100, duration=40, seed=5))
    median = lengths[len(lengths) // 2]
    p99 = lengths[int(len(lengths) * 0.99)]
    assert p99 > 5 * median  # heavy tail: a log-normal with sigma 1 has p99/median ~ 10


def test_shared_prefix_groups_share_the_system_prompt_only() -> None:
    spec = WorkloadSpec(WorkloadKind.SHARED_PREFIX, num_groups=5, system_tokens=300)
    arrivals = generate(spec, rate=50, duration=10, seed=2)
    by_group: dict[str, set[str]] = {}
    for a in arrivals:
        by_group.setdefault(a.group, set()).add(a.system)
    assert len(by_group) == 5
    assert all(len(systems) == 1 for systems in by_group.values())
    systems = [next(iter(s)) for s in by_group.values()]
    assert len(set(systems)) == 5
    assert all(abs(len(s) - 1200) < 60 for s in systems)
    assert len({a.user for a in arrivals}) == len(arrivals)  # questions never repeat


def test_multi_lora_popularity_is_zipf() -> None:
    spec = WorkloadSpec(WorkloadKind.MULTI_LORA, num_adapters=20, zipf_s=1.0)
    arrivals = generate(spec, rate=200, duration=50, seed=4)
    counts = Counter(a.target_model for a in arrivals)
    assert counts.most_common(1)[0][0] == "adapter-000"
    assert len(counts) == 20
    harmonic = sum(1 / k for k in range(1, 21))
    share0 = counts["adapter-000"] / len(arrivals)
    assert math.isclose(share0, 1 / harmonic, rel_tol=0.1)
    assert counts["adapter-000"] > 3 * counts["adapter-004"]
    assert all(a.model == a.target_model for a in arrivals)


def test_mixed_criticality_fractions() -> None:
    spec = WorkloadSpec(WorkloadKind.MIXED_CRITICALITY, criticality_mix=(0.2, 0.5, 0.3))
    arrivals = generate(spec, rate=200, duration=30, seed=9)
    counts = Counter(a.criticality for a in arrivals)
    n = len(arrivals)
    assert abs(counts[Criticality.CRITICAL] / n - 0.2) < 0.03
    assert abs(counts[Criticality.SHEDDABLE] / n - 0.3) < 0.03
    assert {a.model for a in arrivals if a.criticality is Criticality.CRITICAL} == {"chat-critical"}


def test_jsonl_round_trip(tmp_path: Path) -> None:
    arrivals = generate(default_spec("mixed-criticality", 2), rate=20, duration=5, seed=1)
    path = tmp_path / "w.jsonl"
    save_jsonl(path, arrivals, {"kind": "mixed-criticality", "seed": 1})
    meta, loaded = load_jsonl(path)
    assert meta == {"kind": "mixed-criticality", "seed": 1}
    assert [(a.request_id, a.criticality, a.user, a.output_tokens) for a in loaded] == [
        (a.request_id, a.criticality, a.user, a.output_tokens) for a in arrivals
    ]
    assert all(abs(x.time - y.time) < 1e-5 for x, y in zip(loaded, arrivals, strict=True))


def test_jsonl_errors_name_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"request_id": "a", "time": 0, "model": "m", "user": "hi"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: missing field 'output_tokens'"):
        load_jsonl(path)
    path.write_text('{"request_id": "a", "time": "soon", "model": "m", "user": "u", '
                    '"output_tokens": 3}\n{oops\n')  # fmt: skip
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: bad value"):
        load_jsonl(path)


def test_rejects_non_positive_rate() -> None:
    with pytest.raises(ConfigError, match="rate and duration"):
        generate(default_spec("heavy-tail", 1), rate=0, duration=1, seed=1)
