"""Built-in pickers: max-score (random tie-break), random, weighted-random (A-Res).

A picker returns indices into the candidates: the primary first, then up to
`maxNumOfEndpoints - 1` fallbacks (the proxy tries them in order when the primary fails).
Ties are broken with the injected RNG, never by position: "cache misses always land on
worker 0" is a known failure of routers that break ties by index.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

from pydantic import Field

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.registry import PluginParams


class PickerParams(PluginParams):
    max_num_of_endpoints: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Endpoints returned: the pick plus fallbacks (default 4 = "
        "1 + 3 fallbacks; GIE's default is 1).",
    )


class MaxScorePicker(NamedPlugin):
    """Highest weighted score first; equal scores in random order."""

    __slots__ = ("k", "rng")

    def __init__(self, typed_name: TypedName, params: PickerParams, rng: random.Random) -> None:
        super().__init__(typed_name)
        self.k = params.max_num_of_endpoints
        self.rng = rng

    def pick(self, candidates: Sequence[EndpointState], scores: Sequence[float]) -> list[int]:
        n = len(scores)
        if n == 0:
            return []
        k = min(self.k, n)
        rng = self.rng
        # Scores are compared exactly: equal inputs give bit-identical weighted sums, so an
        # exact tie is a real tie, and a near tie is a real (if small) difference.
        if k == 1:
            top = max(scores)
            if scores.count(top) == 1:
                return [scores.index(top)]
            return [rng.choice([i for i, v in enumerate(scores) if v == top])]
        kth = heapq.nlargest(k, scores)[-1]
        # The (usually few) indices at or above the k-th best score (a comprehension: cheaper
        # than `compress` over `map(ge, ...)`, a C call per score).
        contenders = [i for i, v in enumerate(scores) if v >= kth]
        above = [i for i in contenders if scores[i] > kth]
        rng.shuffle(above)
        above.sort(key=scores.__getitem__, reverse=True)  # stable: shuffled order within ties
        at = [i for i in contenders if scores[i] == kth]
        return above + rng.sample(at, k - len(above))


class RandomPicker(NamedPlugin):
    """Uniformly random endpoints, scores ignored."""

    __slots__ = ("k", "rng")

    def __init__(self, typed_name: TypedName, params: PickerParams, rng: random.Random) -> None:
        super().__init__(typed_name)
        self.k = params.max_num_of_endpoints
        self.rng = rng

    def pick(self, candidates: Sequence[EndpointState], scores: Sequence[float]) -> list[int]:
        n = len(candidates)
        return self.rng.sample(range(n), min(self.k, n))


class WeightedRandomPicker(NamedPlugin):
    """Random endpoints with probability proportional to score (A-Res: key = u^(1/score)).

    Endpoints scoring 0 come only after every positive one; all zero -> uniform.
    """

    __slots__ = ("k", "rng")

    def __init__(self, typed_name: TypedName, params: PickerParams, rng: random.Random) -> None:
        super().__init__(typed_name)
        self.k = params.max_num_of_endpoints
        self.rng = rng

    def pick(self, candidates: Sequence[EndpointState], scores: Sequence[float]) -> list[int]:
        n = len(scores)
        k = min(self.k, n)
        rand = self.rng.random
        positive = [i for i, v in enumerate(scores) if v > 0.0]
        # u in (0, 1]; a higher key wins; u ** (1 / w) is the A-Res key of weight w.
        keyed = [((1.0 - rand()) ** (1.0 / scores[i]), i) for i in positive]
        chosen = [i for _key, i in heapq.nlargest(k, keyed)]
        if len(chosen) < k:
            zero = [i for i, v in enumerate(scores) if not v > 0.0]
            chosen += self.rng.sample(zero, k - len(chosen))
        return chosen
