"""Per-request outcomes and the summary figures the benchmarks report.

Definitions (stated once, used by every table):

- TTFT = first token time - arrival time at the router (includes router queueing), over every
  request that received a first token.
- ITL = mean inter-token latency of one request = (finish - first token) / (output tokens - 1),
  over requests with at least 2 output tokens; percentiles are over requests.
- E2E = finish - arrival.
- Throughput = output tokens of completed requests / seconds from first arrival to last finish.
- Goodput under the SLO = completed requests with TTFT <= `ttft_slo` and ITL <= `itl_slo`,
  divided by the arrival window (the workload duration), in requests/s. The default SLO is
  TTFT <= 2 s and mean ITL <= 100 ms: an interactive-chat target loose enough that a healthy
  fleet meets it for nearly every request, so goodput falls only when routing or load hurts.
- Prefix hit rate = cached prompt tokens / prompt tokens, over completed requests.
- Shed = refused by the router (429); unfinished = still running when the run's time limit hit.
- Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from poolkeeper.api.criticality import Criticality


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float = 2.0
    itl_s: float = 0.100

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s:g} s and mean ITL <= {self.itl_s * 1000:g} ms"


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What happened to one request."""

    request_id: str
    criticality: Criticality
    arrival: float
    prompt_tokens: int
    output_tokens: int
    server: str | None = None
    first_token: float | None = None
    finish: float | None = None
    cached_tokens: int = 0
    shed: bool = False
    expired: bool = False  # held by the router's queue until its TTL (a kind of shed)
    router_queue_s: float = 0.0  # time held in the router's own queue before dispatch
    server_queue_s: float = 0.0  # time between reaching the server and its first step
    group: str = ""
    model: str = ""  # client-facing model name

    @property
    def completed(self) -> bool:
        return self.finish is not None and not self.shed

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def itl(self) -> float | None:
        if self.finish is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _dist(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": (sum(values) / len(values)) if values else math.nan,
    }


def meets_slo(o: RequestOutcome, slo: SLO) -> bool:
    if not o.completed or o.ttft is None or o.ttft > slo.ttft_s:
        return False
    itl = o.itl
    return itl is None or itl <= slo.itl_s


def summarize(outcomes: Iterable[RequestOutcome], *, duration: float, slo: SLO) -> dict[str, Any]:
    """Summary figures of one run (see the module docstring for definitions)."""
    items = list(outcomes)
    done = [o for o in items if o.completed]
    # TTFT counts every request that got a first token (a live run may stop streams early).
    ttfts = [t for o in items if not o.shed and (t := o.ttft) is not None]
    itls = [t for o in done if (t := o.itl) is not None]
    e2es = [t for o in done if (t := o.e2e) is not None]
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens for o in done)
    out_tokens = sum(o.output_tokens for o in done)
    start = min((o.arrival for o in items), default=0.0)
    end = max((o.finish for o in done if o.finish is not None), default=start)
    span = end - start
    good = sum(1 for o in done if meets_slo(o, slo))
    by_crit: dict[str, dict[str, Any]] = {}
    for crit in Criticality:
        mine = [o for o in items if o.criticality is crit]
        if not mine:
            continue
        mine_done = [o for o in mine if o.completed]
        mine_ttft = [t for o in mine_done if (t := o.ttft) is not None]
        by_crit[str(crit)] = {
            "requests": len(mine),
            "completed": len(mine_done),
            "shed": sum(1 for o in mine if o.shed),
            "expired": sum(1 for o in mine if o.expired),
            "router_queued": sum(1 for o in mine if o.router_queue_s > 0),
            "server_queued": sum(1 for o in mine_done if o.server_queue_s > 0),
            "goodput_rps": sum(1 for o in mine_done if meets_slo(o, slo)) / duration,
            "ttft_p90_s": percentile(mine_ttft, 90),
            "ttft_p99_s": percentile(mine_ttft, 99),
        }
    return {
        "requests": len(items),
        "completed": len(done),
        "shed": sum(1 for o in items if o.shed),
        "unfinished": sum(1 for o in items if not o.shed and o.finish is None),
        "ttft_s": _dist(ttfts),
        "itl_s": _dist(itls),
        "e2e_s": _dist(e2es),
        "throughput_tok_s": out_tokens / span if span > 0 else 0.0,
        "completed_rps": len(done) / duration,
        "goodput_rps": good / duration,
        "slo_attainment": good / len(items) if items else math.nan,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "router_queued": sum(1 for o in items if o.router_queue_s > 0),
        "server_queued": sum(1 for o in done if o.server_queue_s > 0),
        "by_criticality": by_crit,
    }


def ttft_values(outcomes: Iterable[RequestOutcome]) -> list[float]:
    return [t for o in outcomes if not o.shed and (t := o.ttft) is not None]
