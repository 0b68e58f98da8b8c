"""Paired comparison of interleaved live runs: a quantile ratio with a bootstrap interval.

Live runs on a shared machine drift with its load; interleaving the variants round by round
(each round runs every variant once, back to back) pairs them under about the same conditions.
Two estimates of "variant's p90 TTFT over the baseline's", each with a percentile bootstrap
interval that resamples whole rounds (so a pair stays a pair):

- `pooled`: the quantile of all the variant's TTFTs over the rounds, over the same quantile of
  the baseline's (the rounds' requests pooled: a quantile of ~N x 400 requests, steadier than
  any one run's);
- `paired`: the geometric mean of the per-round ratios (each round's own ratio, so a round the
  machine slowed for both variants counts like any other).

Why rounds and not requests as the resampling unit: the TTFTs of one run are strongly
correlated (a cold start that stacks two prefixes on a server delays tens of requests), so the
round is the independent unit; resampling requests would give a far too narrow interval.

The bootstrap is deterministic (seeded): the same runs give the same interval.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile by linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be in [0, 1]")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class RatioEstimate:
    """A ratio and its bootstrap interval (`level`, e.g. 0.95)."""

    value: float
    low: float
    high: float
    level: float

    def __str__(self) -> str:
        return f"{self.value:.3f}x [{self.low:.3f}, {self.high:.3f}]"


@dataclass(frozen=True, slots=True)
class PairedComparison:
    rounds: int
    pooled: RatioEstimate
    paired: RatioEstimate
    per_round: tuple[float, ...]  # each round's variant / baseline quantile


def _pooled(base: Sequence[Sequence[float]], var: Sequence[Sequence[float]], q: float) -> float:
    return quantile([t for r in var for t in r], q) / quantile([t for r in base for t in r], q)


def _geomean(ratios: Sequence[float]) -> float:
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def compare(
    base: Sequence[Sequence[float]],
    variant: Sequence[Sequence[float]],
    *,
    q: float = 0.9,
    resamples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> PairedComparison:
    """`base[i]` and `variant[i]`: the TTFTs (s) of round i's two runs. Raises ValueError on
    unpaired input or an empty or non-positive run."""
    if len(base) != len(variant):
        raise ValueError(f"{len(base)} baseline rounds against {len(variant)} variant rounds")
    if not base:
        raise ValueError("no rounds to compare")
    if not 0.0 < level < 1.0:
        raise ValueError("level must be in (0, 1)")
    per_round = []
    for i, (b, v) in enumerate(zip(base, variant, strict=True)):
        if not b or not v:
            raise ValueError(f"round {i} has a run without TTFTs")
        qb, qv = quantile(b, q), quantile(v, q)
        if qb <= 0 or qv <= 0:
            raise ValueError(f"round {i}: quantile {qb if qb <= 0 else qv} is not positive")
        per_round.append(qv / qb)
    rng = random.Random(seed)
    n = len(base)
    pooled_bs, paired_bs = [], []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        pooled_bs.append(_pooled([base[i] for i in pick], [variant[i] for i in pick], q))
        paired_bs.append(_geomean([per_round[i] for i in pick]))
    tail = (1.0 - level) / 2.0

    def estimate(value: float, samples: list[float]) -> RatioEstimate:
        return RatioEstimate(value, quantile(samples, tail), quantile(samples, 1.0 - tail), level)

    return PairedComparison(
        rounds=n,
        pooled=estimate(_pooled(base, variant, q), pooled_bs),
        paired=estimate(_geomean(per_round), paired_bs),
        per_round=tuple(per_round),
    )
