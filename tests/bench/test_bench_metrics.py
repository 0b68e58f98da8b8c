"""Summary metrics: percentiles, ITL, goodput under the SLO, hit rate, counts by criticality."""

from __future__ import annotations

import math

from poolkeeper.api.criticality import Criticality
from poolkeeper.bench.results.metrics import SLO, RequestOutcome, meets_slo, percentile, summarize


def _done(
    rid: str, arrival: float, ttft: float, dur: float, out: int, **kw: object
) -> RequestOutcome:
    return RequestOutcome(
        rid, kw.pop("crit", Criticality.STANDARD), arrival, kw.pop("prompt", 100), out,  # type: ignore[arg-type]
        server="s0", first_token=arrival + ttft, finish=arrival + ttft + dur,
        cached_tokens=kw.pop("cached", 0),  # type: ignore[arg-type]
    )  # fmt: skip


def test_percentile_interpolates_like_numpy() -> None:
    data = [1.0, 2.0, 3.0, 4.0]
    assert percentile(data, 50) == 2.5
    assert percentile(data, 90) == 3.7
    assert percentile(data, 0) == 1.0
    assert percentile(data, 100) == 4.0
    assert math.isnan(percentile([], 50))


def test_itl_and_slo() -> None:
    slo = SLO(ttft_s=1.0, itl_s=0.05)
    ok = _done("a", 0.0, 0.5, 0.4, 11)  # ITL 40 ms
    slow_itl = _done("b", 0.0, 0.5, 0.6, 11)  # ITL 60 ms
    slow_ttft = _done("c", 0.0, 1.5, 0.1, 11)
    single = _done("d", 0.0, 0.2, 0.0, 1)  # no ITL: judged on TTFT alone
    assert ok.itl is not None
    assert math.isclose(ok.itl, 0.04)
    assert [meets_slo(o, slo) for o in (ok, slow_itl, slow_ttft, single)] == [
        True, False, False, True,
    ]  # fmt: skip


def test_summary_counts_goodput_hits_and_criticality() -> None:
    outcomes = [
        _done("a", 0.0, 0.5, 1.0, 11, prompt=100, cached=50),
        _done("b", 1.0, 3.0, 1.0, 11, prompt=300, cached=0, crit=Criticality.CRITICAL),
        RequestOutcome("c", Criticality.SHEDDABLE, 2.0, 100, 10, shed=True),
        RequestOutcome("d", Criticality.STANDARD, 3.0, 100, 10, server="s1", first_token=4.0),
    ]
    s = summarize(outcomes, duration=10.0, slo=SLO(ttft_s=2.0, itl_s=0.2))
    assert s["requests"] == 4
    assert s["completed"] == 2
    assert s["shed"] == 1
    assert s["unfinished"] == 1
    assert math.isclose(s["goodput_rps"], 0.1)  # only "a" meets the SLO
    assert math.isclose(s["prefix_hit_rate"], 50 / 400)
    assert math.isclose(s["throughput_tok_s"], 22 / 5.0)  # 0 .. 5 s (b finishes at 5)
    assert s["by_criticality"]["Sheddable"]["shed"] == 1
    assert s["by_criticality"]["Critical"]["completed"] == 1
    # TTFT covers every request with a first token, finished ("a", "b") or not ("d").
    assert math.isclose(s["ttft_s"]["p50"], 1.0)
