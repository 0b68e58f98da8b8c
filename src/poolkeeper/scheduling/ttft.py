"""An online model of time to first token: what a request would wait on each endpoint.

The weighted scorers add normalised signals (queue, running, KV, prefix share) whose exchange
rates are fixed weights; the cost a client feels is one number, the time to its first token.
`TtftModel` predicts it per candidate from what the router knows at decision time and learns the
coefficients from the TTFTs the router itself observes (sent -> first response byte):

    ttft(e, r) ~= w . x(e, r)

with `x` = [1, uncached prompt tokens of r on e (thousands), requests waiting on e, prompt
tokens sent to e since its last scrape (thousands), running requests on e (hundreds), e's KV
use (0..1), 1 if r's adapter is not resident on e]. `w` is fitted by recursive least squares
with a forgetting factor (a ridge prior through the initial covariance; each sample costs a
7 x 7 update, no dependency). One `w` for all endpoints: a per-endpoint speed factor (EWMA
of observed over predicted) was tried and dropped, because in a uniform fleet it ran to its
bounds (0.25 and 4) within seconds: a server holding busy prefixes looks "slow", is avoided,
and its factor never comes back. Mixed GPU generations are the `observed-speed-scorer`'s job.

Pure: no clock, no I/O. The caller records a decision's features (`remember`) and reports the
first byte (`observe`) or the end of a request that never produced one (`drop`); pending
decisions are capped (oldest dropped first), so a client that never reads cannot grow memory.
Until `min_samples` first bytes were observed `ready` is False and the scorer adds nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

FEATURES = ("bias", "uncached_ktok", "waiting", "unseen_ktok", "running_h", "kv", "adapter_miss")
_D = len(FEATURES)

# Observed TTFTs beyond this are outliers (a stalled request, a restarted server): capped, so
# one of them cannot drag `w` far.
MAX_SAMPLE_S = 120.0


@dataclass(slots=True)
class _Pending:
    endpoint: str
    decided_at: float
    x: tuple[float, ...]


@dataclass(slots=True)
class TtftModel:
    """Recursive least squares over `FEATURES` (not thread-safe).

    `forgetting`: weight kept by the past per sample (0.999: the fit follows a change of
    workload over a few thousand requests). `prior`: initial covariance scale (larger = trust
    the first samples more).
    """

    min_samples: int = 50
    forgetting: float = 0.999
    prior: float = 10.0
    max_pending: int = 65_536
    samples: int = 0
    w: list[float] = field(default_factory=lambda: [0.0] * _D)
    p: list[list[float]] = field(default_factory=list)
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.9 <= self.forgetting <= 1.0:
            raise ValueError("forgetting must be in [0.9, 1]")
        if self.min_samples < 1 or self.max_pending < 1 or not self.prior > 0.0:
            raise ValueError("min_samples, max_pending and prior must be positive")
        if not self.p:
            self.p = [[self.prior if i == j else 0.0 for j in range(_D)] for i in range(_D)]

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples

    @property
    def pending(self) -> int:
        return len(self._pending)

    def predict(self, x: Sequence[float]) -> float:
        """w . x, never below 0."""
        v = sum(wi * xi for wi, xi in zip(self.w, x, strict=True))
        return v if v > 0.0 else 0.0

    def remember(
        self, request_id: str, endpoint: str, decided_at: float, x: Sequence[float]
    ) -> None:
        """The features of the endpoint a request was sent to, until its first byte."""
        pending = self._pending
        pending.pop(request_id, None)  # a reused id: the newest decision counts
        if len(pending) >= self.max_pending:
            del pending[next(iter(pending))]
        pending[request_id] = _Pending(endpoint, decided_at, tuple(x))

    def drop(self, request_id: str) -> None:
        """Forget a decision (the request ended without a first byte, or moved)."""
        self._pending.pop(request_id, None)

    def observe(self, request_id: str, now: float, *, endpoint: str | None = None) -> bool:
        """The first byte of `request_id` arrived at `now`: one sample. False if unknown, or
        if it came from another endpoint than the one decided (a retry on a fallback)."""
        entry = self._pending.pop(request_id, None)
        if entry is None or (endpoint is not None and endpoint != entry.endpoint):
            return False
        ttft = now - entry.decided_at
        if not 0.0 <= ttft < math.inf:
            return False
        self.learn(entry.x, min(ttft, MAX_SAMPLE_S))
        return True

    def learn(self, x: Sequence[float], ttft: float) -> None:
        """One (features, observed TTFT) sample."""
        self._rls(x, ttft)
        self.samples += 1

    def _rls(self, x: Sequence[float], y: float) -> None:
        p, w, lam = self.p, self.w, self.forgetting
        px = [sum(pij * xj for pij, xj in zip(row, x, strict=True)) for row in p]
        denom = lam + sum(xi * pxi for xi, pxi in zip(x, px, strict=True))
        if not denom > 1e-12:
            return
        k = [v / denom for v in px]
        err = y - sum(wi * xi for wi, xi in zip(w, x, strict=True))
        for i in range(_D):
            w[i] += k[i] * err
        inv = 1.0 / lam
        for i in range(_D):
            ki, row = k[i], p[i]
            for j in range(_D):
                row[j] = (row[j] - ki * px[j]) * inv
        # A direction no sample excites (an adapter term in a pool without adapters) would
        # grow by 1/forgetting per sample without bound ("windup") and make the next rare
        # sample swing `w`: each variance is capped at the prior by a diagonal rescaling
        # (P <- S P S keeps P symmetric positive definite; the excited directions keep
        # their gain).
        prior = self.prior
        for i in range(_D):
            if p[i][i] > prior:
                f = math.sqrt(prior / p[i][i])
                for j in range(_D):
                    p[i][j] *= f
                    p[j][i] *= f

    def forget_endpoints(self, keep: set[str]) -> None:
        """Drop the pending decisions of endpoints that left the pool."""
        for rid in [r for r, e in self._pending.items() if e.endpoint not in keep]:
            del self._pending[rid]
