"""Counters and latency histograms one engine keeps, in vLLM's units and bucket layouts.

Pure data: the engine updates them as it steps; the HTTP layer renders them as Prometheus text
(sim/metrics_text.py) and the virtual fleet reports them per server.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Bucket upper bounds as vLLM's metrics module defines them (seconds).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class Histogram:
    """Cumulative-on-render histogram: per-bucket counts, sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def observe_many(self, value: float, times: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def observe_linear(self, first: float, step: float, count: int, weight: int) -> None:
        """Observe first + step * j for j in 0..count-1, each `weight` times (step >= 0)."""
        if count <= 0 or weight <= 0:
            return
        last = first + step * (count - 1)
        self.sum += weight * (count * first + step * count * (count - 1) / 2)
        self.count += weight * count
        low, high = bisect_left(self.bounds, first), bisect_left(self.bounds, last)
        if low == high or step <= 0:
            self.counts[low] += weight * count
            return
        # Values are increasing: count how many fall at or below each bound in between.
        done = 0
        for index in range(low, high):
            bound = self.bounds[index]
            upto = min(count, int((bound - first) / step) + 1)
            while upto > 0 and first + step * (upto - 1) > bound:
                upto -= 1  # guard against rounding in the division
            while upto < count and first + step * upto <= bound:
                upto += 1
            self.counts[index] += weight * (upto - done)
            done = upto
        self.counts[high] += weight * (count - done)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le label, cumulative count) pairs, ending with +Inf."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters since the engine started (vLLM's *_total families and more)."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests (once per request)
    generation_tokens: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    preemptions: int = 0
    lora_loads: int = 0  # adapter swaps into a GPU slot
    steps: int = 0
    busy_time: float = 0.0  # modelled seconds spent in steps
    requests_submitted: int = 0
    requests_cancelled: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"length": 0, "stop": 0, "abort": 0})
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What a metrics scrape of the engine shows at one instant."""

    waiting: int
    running: int
    kv_cache_usage: float  # 0..1, referenced blocks / all blocks
    running_adapters: tuple[str, ...]  # adapters of running requests
    waiting_adapters: tuple[str, ...]  # adapters of waiting requests
    resident_adapters: tuple[str, ...]  # adapters loaded in GPU slots
    max_loras: int
    block_size: int
    num_gpu_blocks: int
    waiting_deferred: int  # waiting only for a LoRA slot
