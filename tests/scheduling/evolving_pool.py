"""An evolving pool for the kept-values tests: random scrapes, in-flight changes, endpoints
joining, leaving, trading places or replaced, pool-wide changes (seeded)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import replace

from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState


def metrics(rng: random.Random, now: float) -> EndpointMetrics:
    kv = rng.uniform(0.0, 1.0)
    if rng.random() < 0.03:
        kv = rng.choice([math.nan, 1.5, -0.1, math.inf])  # a broken exporter now and then
    fresh = rng.random() < 0.97
    return EndpointMetrics(
        waiting=rng.choice([0, 0, 1, 2, 3, 5, 9]),
        running=rng.choice([4, 6, 8, 8, 8]),  # full batches get confirmed (fullbatch.py)
        kv_cache_usage=kv,
        active_adapters=frozenset(rng.sample(["a", "b", "c"], rng.randint(0, 2))),
        waiting_adapters=frozenset(rng.sample(["b", "c"], rng.randint(0, 1))),
        max_adapters=rng.choice([0, 2, 4]),
        updated_at=now - (rng.uniform(0.0, 0.05) if fresh else rng.uniform(0.3, 2.0)),
        served_model=rng.choice([None, None, "base"]),
        num_gpu_blocks=rng.choice([None, 2000]),  # (known: the unseen tokens count in KV)
        block_size=16,
    )


def endpoint_state(rng: random.Random, ip: int, now: float) -> EndpointState:
    unseen = rng.choice([0, 0, 0, 1, 2])
    return EndpointState(
        Endpoint(f"pod{ip}", f"10.1.{ip // 256}.{ip % 256}", 8000),
        metrics(rng, now),
        inflight_requests=unseen + rng.randint(0, 2),
        inflight_tokens=rng.randint(0, 4000),
        unseen_requests=unseen,
        unseen_tokens=rng.choice([0, 0, 500, 3000]) if unseen else 0,
        seconds_per_output_token=rng.choice([None, None, 0.01, 0.02, 0.05]),
        unseen_answered=rng.randint(0, unseen),
    )


def evolve(
    rng: random.Random, pool: list[EndpointState], now: float, ips: Iterator[int]
) -> list[EndpointState]:
    """The next decision's candidates: a new list (as `InflightTracker.apply` makes), the
    same objects where nothing changed."""
    pool = list(pool)
    n = len(pool)
    kind = rng.random()
    if kind < 0.45:  # a few endpoints scraped again (new metrics, maybe the same loads)
        for i in rng.sample(range(n), rng.randint(1, 4)):
            s = pool[i]
            new = metrics(rng, now) if rng.random() < 0.7 else replace(s.metrics)
            pool[i] = replace(s, metrics=replace(new, updated_at=now - 0.001))
    elif kind < 0.6:  # an in-flight change (sent, answered, finished) at one endpoint
        i = rng.randrange(n)
        unseen = rng.randint(0, 3)
        pool[i] = replace(
            pool[i],
            unseen_requests=unseen,
            unseen_answered=rng.randint(0, unseen),
            unseen_tokens=rng.choice([0, 700]) if unseen else 0,
            seconds_per_output_token=rng.choice([None, 0.01, 0.03]),
        )
    elif kind < 0.67:  # an endpoint joins
        pool.insert(rng.randrange(n + 1), endpoint_state(rng, next(ips), now))
    elif kind < 0.74 and n > 70:  # an endpoint leaves
        del pool[rng.randrange(n)]
    elif kind < 0.8:  # two trade places (the same objects, other positions)
        i, j = rng.sample(range(n), 2)
        pool[i], pool[j] = pool[j], pool[i]
    elif kind < 0.85:  # another endpoint at a position (the length stays)
        pool[rng.randrange(n)] = endpoint_state(rng, next(ips), now)
    elif kind < 0.88:  # the same endpoint again, its metrics an equal copy (a new object)
        i = rng.randrange(n)
        pool[i] = replace(pool[i], metrics=replace(pool[i].metrics))
    elif kind < 0.91:  # pool-wide: every other endpoint scraped again
        for i in range(0, n, 2):
            pool[i] = replace(pool[i], metrics=metrics(rng, now))
    return pool  # (else nothing changed: a new list of the same objects)
