"""`InflightTracker.apply` from its previous answer (`_patched`) answers as its full pass.

Two trackers told the same sends, first bytes, finishes (some with a speed), forgets and
sweeps between decisions; one applies an evolving pool of 90 endpoints through its kept
answer, the other with the kept answer off (the reference: every position worked out). Their
answers must be equal state for state, in-flight models included. A kept answer that missed
a change (a write the tracker did not mark, another pod at an ip:port) fails here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from itertools import count

from poolkeeper.datastore import inflight
from poolkeeper.datastore.endpoint import Endpoint, EndpointState
from poolkeeper.datastore.inflight import InflightTracker
from tests.scheduling.evolving_pool import endpoint_state, evolve


class _Counting(InflightTracker):
    """Counts the answers `_patched` gave (the kept path taken)."""

    __slots__ = ("patched",)

    def __init__(self) -> None:
        super().__init__()
        self.patched = 0

    def _patched(self, states: Sequence[EndpointState]) -> list[EndpointState] | None:
        out = super()._patched(states)
        self.patched += out is not None
        return out


def _plain_apply(tracker: InflightTracker, pool: list[EndpointState]) -> list[EndpointState]:
    name = "MIN_CACHED"
    saved = getattr(inflight, name)
    setattr(inflight, name, 10**9)
    try:
        return tracker.apply(pool)
    finally:
        setattr(inflight, name, saved)


def test_the_kept_answer_is_the_full_pass_on_an_evolving_pool() -> None:
    rng = random.Random(21)
    now = 1000.0
    ips = count(1)
    pool = [endpoint_state(rng, next(ips), now) for _ in range(90)]
    kept, plain = _Counting(), InflightTracker()
    sent: list[str] = []
    for k in range(700):
        now += 0.001
        pool = evolve(rng, pool, now, ips)
        if rng.random() < 0.05:  # another pod at an ip:port (IP reuse): its counts go
            i = rng.randrange(len(pool))
            ep = pool[i].endpoint
            pool[i] = replace(pool[i], endpoint=Endpoint(f"new{k}", ep.address, ep.port))
        for _ in range(rng.randint(0, 3)):
            op = rng.random()
            target = rng.choice(pool).key
            tokens = rng.randint(0, 900)
            for t in (kept, plain):
                if op < 0.4:
                    t.start(f"r{k}", target, tokens, now, "m")
                elif op < 0.6 and sent:
                    t.first_token(sent[k % len(sent)])
                elif op < 0.85 and sent:
                    t.finish(sent[0], now=now, output_tokens=k % 3)  # (0 tokens: no speed)
                elif op < 0.9:
                    t.forget(target)
                elif op < 0.92:
                    t.sweep(now, 0.2)
            if op < 0.4:
                sent.append(f"r{k}")
            elif 0.6 <= op < 0.85 and sent:
                sent.pop(0)
        got = kept.apply(pool)
        want = _plain_apply(plain, pool)
        assert [repr(s) for s in got] == [repr(s) for s in want], k
    assert kept.patched > 300  # (the kept answer was used, not only the full pass)
