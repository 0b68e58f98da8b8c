"""`poolkeeper quickstart`, bounded: fleet + gateway + load + report, then stop."""

from __future__ import annotations

import argparse
import io

import pytest
from rich.console import Console

from poolkeeper.cli import quickstart as qs

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
    assert await qs.quickstart(_args(), console) == 0
    text = out.getvalue()
    assert "gateway ready" in text
    assert "Where requests went" in text
    assert "Latency per model and criticality" in text
    for name in ("Critical", "Standard", "Sheddable", "food-review-v1", "sim-0"):
        assert name in text
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

    plan = qs._plan(200, random.Random(1))
    crit = {c for _, c, _ in plan}
    assert crit == {"Critical", "Standard", "Sheddable"}
    assert sum(1 for m, _, _ in plan if m == "food-review") == 90
