"""Exponential backoff with jitter, for re-listing after a failed watch (pure: the random
generator is injected; the caller sleeps)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Backoff"]


@dataclass(slots=True)
class Backoff:
    """Delays of initial·2ⁿ capped at `maximum`, each drawn from [½, 1] of that ("equal
    jitter"), so replicas that lost the API server together do not come back in lockstep."""

    initial_s: float = 0.5
    maximum_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def next(self) -> float:
        """The delay before the next attempt (and count one more failure)."""
        ceiling = min(self.maximum_s, self.initial_s * (2 ** min(self.failures, 30)))
        self.failures += 1
        return float(ceiling * self.rng.uniform(0.5, 1.0))

    def after(self, retry_after_s: float) -> float:
        """The delay for a server that said when to come back (429 Retry-After): that, plus up
        to 10% jitter; the exponential count is left as it was."""
        return float(retry_after_s * self.rng.uniform(1.0, 1.1))

    def reset(self) -> None:
        """After a success: the next failure starts from `initial_s` again."""
        self.failures = 0
