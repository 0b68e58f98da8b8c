"""`poolkeeper quickstart`, bounded: fleet + gateway + load + report, then stop."""

from __future__ import annotations

import argparse
import io
import math
from collections import Counter

import pytest
from rich.console import Console

from poolkeeper.cli import quickstart as qs, quickstart_demo

pytestmark = pytest.mark.e2e


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    qs.register(parser.add_subparsers())
    args = parser.parse_args(["quickstart", "--requests", "40", "--no-serve"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


async def test_quickstart_demo_reports_where_requests_went() -> None:
    out = io.StringIO()
    console = Console(file=out, width=140, force_terminal=False)
    record = quickstart_demo.DemoRecord()
    # Servers twice as slow as the default calibration: the 48-wide burst queues on the
    # 3 x 4 running slots on any machine, so the pool saturates and flow control holds
    # Sheddable requests back, which is what makes "Critical is never held or shed" a check
    # rather than a given.
    args = _args(requests=200, time_scale=2.0)
    assert await qs.quickstart(args, console, record) == 0
    outcomes = record.outcomes
    assert len(outcomes) == 200
    # errors: 0 (a Sheddable request may get 429 queue_full or 503 at its 1.5 s TTL)
    assert [o for o in outcomes if o.status not in (200, 429, 503)] == []
    by_criticality: dict[str, Counter[int]] = {}
    for o in outcomes:
        by_criticality.setdefault(o.criticality, Counter())[o.status] += 1
    assert by_criticality["Critical"] == Counter({200: 50})  # never shed
    # Standard may wait (30 s TTL), far beyond this burst: it is always served.
    assert by_criticality["Standard"] == Counter({200: 90})
    assert record.flow[("Sheddable", "queued")] >= 1  # the pool did saturate
    assert record.flow[("Critical", "queued")] == 0  # never held
    assert sum(by_criticality["Sheddable"].values()) == 60
    refused = by_criticality["Sheddable"][429] + by_criticality["Sheddable"][503]
    assert (
        refused
        == record.flow[("Sheddable", "RejectedCapacity")] + record.flow[("Sheddable", "EvictedTTL")]
    )  # every refusal is one the gate counted
    # The 70/30 split, within 4 binomial standard deviations (n = 90: +-17 requests).
    targets = record.split  # counted by the gateway: responses carry the client's model name
    assert set(targets) == {"food-review-v1", "food-review-v2"}
    n = targets.total()
    assert abs(targets["food-review-v1"] - 0.7 * n) <= 4 * math.sqrt(n * 0.7 * 0.3), targets
    text = out.getvalue()
    assert "gateway ready" in text
    assert "Where requests went" in text
    assert "Latency per model and criticality" in text
    for name in ("Critical", "Standard", "Sheddable", "food-review-v1", "sim-0"):
        assert name in text
    for column in ("queued", "shed 429", "expired 429"):  # flow control, per criticality
        assert column in text
    assert "weighted split" in text


async def test_quickstart_serves_for_a_bounded_duration() -> None:
    out = io.StringIO()
    console = Console(file=out, width=140)
    args = _args(no_serve=False, duration=0.2, requests=5)
    assert await qs.quickstart(args, console) == 0
    assert "curl -s http://127.0.0.1:" in out.getvalue()


def test_bad_arguments() -> None:
    assert qs.run_quickstart(_args(requests=0)) == 2


def test_plan_has_all_criticalities_in_configured_shares() -> None:
    import random

    plan = quickstart_demo.demo_plan(200, random.Random(1))
    crit = {c for _, c, _ in plan}
    assert crit == {"Critical", "Standard", "Sheddable"}
    assert sum(1 for m, _, _ in plan if m == "food-review") == 90
