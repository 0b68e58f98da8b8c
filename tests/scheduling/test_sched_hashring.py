"""The consistent-hash ring behind the prefix-cache scorer's cold affinity."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from poolkeeper.scheduling.hashring import HashRing

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 9)]
KEYS = tuple(random.Random(n).getrandbits(64) for n in range(2000))


def test_every_ring_gives_a_key_the_same_owner_whatever_the_candidate_order() -> None:
    first, second = HashRing(), HashRing()
    shuffled = ENDPOINTS[3:] + ENDPOINTS[:3]
    assert [first.owner(k, ENDPOINTS) for k in KEYS] == [second.owner(k, shuffled) for k in KEYS]


def test_keys_spread_over_every_endpoint() -> None:
    ring = HashRing()
    shares = Counter(ring.owner(k, ENDPOINTS) for k in KEYS)
    assert set(shares) == set(ENDPOINTS)
    # 16 points per endpoint: no endpoint owns more than twice or less than half its share.
    assert all(125 < n < 500 for n in shares.values()), shares


def test_a_missing_candidate_moves_only_its_own_keys() -> None:
    ring = HashRing()
    before = {k: ring.owner(k, ENDPOINTS) for k in KEYS}
    gone = ENDPOINTS[2]
    rest = [e for e in ENDPOINTS if e != gone]
    after = {k: ring.owner(k, rest) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved
    assert all(before[k] == gone for k in moved)
    assert all(after[k] != gone for k in KEYS)
    # Forgetting it changes nothing for the others either.
    ring.forget(set(rest))
    assert {k: ring.owner(k, rest) for k in KEYS} == after


def test_a_new_endpoint_joins_the_ring_when_first_a_candidate() -> None:
    ring = HashRing()
    ring.owner(1, ENDPOINTS[:4])
    wider = {k: ring.owner(k, ENDPOINTS) for k in KEYS}
    assert {k: HashRing().owner(k, ENDPOINTS) for k in KEYS} == wider
    with pytest.raises(ValueError, match="points"):
        HashRing(points=0)


def test_a_bounded_owner_is_the_first_clockwise_that_fits_else_the_plain_owner() -> None:
    ring, other = HashRing(), HashRing()
    for k in KEYS[:200]:
        plain = ring.owner(k, ENDPOINTS)
        # Every ring with the same test agrees, and skips exactly the endpoints that fail it.
        not_plain = plain.__ne__
        bounded = ring.owner(k, ENDPOINTS, not_plain)
        assert bounded != plain
        assert other.owner(k, ENDPOINTS[::-1], not_plain) == bounded
        assert ring.owner(k, ENDPOINTS, lambda e: True) == plain
        assert ring.owner(k, ENDPOINTS, lambda e: False) == plain
