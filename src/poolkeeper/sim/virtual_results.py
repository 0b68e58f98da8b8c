"""What goes into and comes out of a virtual-time fleet run (`sim/virtual.py`).

`Arrival` (one request entering the fleet), `RequestResult` (what became of it: server, status,
token times, TTFT, e2e, ITL), `ServerResult` (one server's routed count and engine counters),
and `FleetResult` with its `summary()` (the aggregates the benchmarks report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from poolkeeper.sim.stats import EngineCounters


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request entering the fleet at virtual time `time`."""

    time: float
    request_id: str
    model: str
    prompt: str = ""
    max_tokens: int | None = None
    prompt_tokens: int | None = None
    payload: object = field(default=None, compare=False)


@dataclass(slots=True)
class RequestResult:
    request_id: str
    model: str
    arrival: float
    server: int = -1
    server_name: str = ""
    status: str = "ok"  # ok | rejected | error
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    adapter_loaded: bool = False
    itl_max: float = 0.0
    token_times: list[float] | None = None
    payload: object = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def itl_mean(self) -> float | None:
        """Mean inter-token latency (time per output token after the first)."""
        if self.finish is None or self.first_token is None or self.completion_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.completion_tokens - 1)


@dataclass(slots=True)
class ServerResult:
    name: str
    routed: int
    counters: EngineCounters


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class FleetResult:
    requests: list[RequestResult]
    servers: list[ServerResult]
    end_time: float

    def summary(self) -> dict[str, float]:
        done = [r for r in self.requests if r.finish is not None]
        ttft = [r.ttft for r in done if r.ttft is not None]
        e2e = [r.e2e for r in done if r.e2e is not None]
        itl = [r.itl_mean for r in done if r.itl_mean is not None]
        start = min((r.arrival for r in self.requests), default=0.0)
        span = max(self.end_time - start, 1e-9)
        out: dict[str, float] = {
            "requests": float(len(self.requests)),
            "completed": float(len(done)),
            "rejected": float(sum(r.status == "rejected" for r in self.requests)),
            "errors": float(sum(r.status == "error" for r in self.requests)),
            "output_tokens_per_s": sum(r.completion_tokens for r in done) / span,
            "prefix_hit_rate": sum(r.cached_tokens for r in done)
            / max(1, sum(r.prompt_tokens for r in done)),
            "preemptions": float(sum(r.preemptions for r in done)),
            "adapter_loads": float(sum(r.adapter_loaded for r in done)),
            "itl_mean": sum(itl) / len(itl) if itl else math.nan,
        }
        for name, values in (("ttft", ttft), ("e2e", e2e)):
            out[f"{name}_mean"] = sum(values) / len(values) if values else math.nan
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = _percentile(values, q)
        return out
