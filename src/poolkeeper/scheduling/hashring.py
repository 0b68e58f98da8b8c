"""A consistent-hash ring of endpoints: the same owner for a key in every EPP replica.

Each endpoint (ip:port) has `points` positions on a 64-bit ring, xxhash64 of its ip:port seeded
with 0..points-1; a key's owner among a set of candidates is the first candidate clockwise from
the key. Every replica that knows the same endpoints computes the same owner, whatever order it
lists them in, and an endpoint leaving moves only the keys it owned. The prefix-cache scorer's
cold affinity uses it (`plugins/prefix_scorer.py`).

Why a ring and not rendezvous hashing (the highest hash of key and endpoint): rendezvous hashes
every candidate per decision, 0.4 ms at 1,000 endpoints in CPython; the ring hashes an endpoint
once, when first seen, and a decision with the same candidates as the last costs a list
comparison and a bisection.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

import xxhash

_xxh64 = xxhash.xxh64_intdigest


class HashRing:
    """Endpoints' points on the ring, kept sorted; built lazily from the candidates seen."""

    __slots__ = ("_last", "_owners", "_points", "_positions", "_present", "points")

    def __init__(self, points: int = 16) -> None:
        if points < 1:
            raise ValueError("points must be >= 1")
        self.points = points
        self._positions: list[int] = []
        self._owners: list[str] = []
        self._points: dict[str, tuple[int, ...]] = {}  # endpoint -> its positions
        # The last candidate list and its set: the pool's candidates rarely change between
        # decisions, and comparing two lists of the same strings is far cheaper than a set.
        self._last: list[str] = []
        self._present: set[str] = set()

    def _add(self, keys: Iterable[str]) -> None:
        for k in keys:
            encoded = k.encode()
            self._points[k] = tuple(_xxh64(encoded, seed) for seed in range(self.points))
        self._rebuild()

    def _rebuild(self) -> None:
        ring = sorted((p, k) for k, ps in self._points.items() for p in ps)
        self._positions = [p for p, _ in ring]
        self._owners = [k for _, k in ring]

    def owner(
        self, key: int, candidates: Sequence[str], fits: Callable[[str], bool] | None = None
    ) -> str:
        """The first of `candidates` (ip:port, at least one) clockwise from `key`; with `fits`,
        the first for which it holds (bounded-load consistent hashing), else the first."""
        if candidates != self._last:
            present = set(candidates)
            if not self._points.keys() >= present:
                self._add(present.difference(self._points))
            self._last, self._present = list(candidates), present
        present = self._present
        owners, n = self._owners, len(self._owners)
        start = bisect_left(self._positions, key)
        first: str | None = None
        for step in range(n):
            owner = owners[(start + step) % n]
            if owner in present:
                if fits is None or fits(owner):
                    return owner
                if first is None:
                    first = owner
        if first is None:
            raise ValueError("no candidates")
        return first

    def forget(self, keep: set[str]) -> None:
        """Drop the endpoints not in `keep`."""
        gone = [k for k in self._points if k not in keep]
        if gone:
            for k in gone:
                del self._points[k]
            self._last = []
            self._rebuild()
