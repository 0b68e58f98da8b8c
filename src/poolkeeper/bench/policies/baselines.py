"""Baseline routing policies, re-implemented from their published descriptions.

Every policy picks one endpoint for a request from `EndpointState` snapshots (scheduling/types),
or raises `RequestShed` to refuse it. "Load" below is the router's own in-flight request count
(`EndpointState.inflight_requests`), which is what the proxies in question track themselves;
none of the baselines reads a queue it did not fill, except where stated.

- `round-robin`: a Kubernetes Service with IPVS round-robin (endpoints in a fixed order).
- `random`: uniform choice (kube-proxy's iptables mode behaves like this).
- `least-request`: fewest in-flight requests, random among ties.
- `power-of-two`: two distinct endpoints drawn at random, the less loaded one wins
  (vllm-router / sglang-router `power_of_two`).
- `cache-aware`: sglang-router / vllm-router `cache_aware` (peers.md §3.2): the system is
  *imbalanced* iff max_load - min_load > 64 AND max_load > 1.5 x min_load; then the least
  loaded worker wins. Otherwise the longest prefix match in a shared character radix tree
  decides if matched/prompt characters > 0.3, else the least loaded worker. The chosen
  worker's tree always learns the prompt. Ties in load go to the first worker in list order,
  as in the Rust routers (the "everything lands on worker 0" behaviour users reported).
  Per-worker tree cap 33,554,432 characters, eviction pass every 120 s (vllm-router CLI).
- `dynamo-kv`: NVIDIA Dynamo's KV router cost (peers.md §3.6): cost = overlap_weight x
  prefill_blocks + decode_blocks, with prefill_blocks = prompt blocks not found in the
  worker's (approximate) cache and decode_blocks = blocks of the worker's in-flight requests
  (router-side token count / block size); overlap weight 1.0, temperature 0 (minimum cost,
  random among ties). Blocks of 16 tokens (64 characters); approximate mode keeps block
  hashes 120 s.
- `aibrix-prefix`: AIBrix `prefix-cache` (peers.md §3.5): if max - min in-flight > 16, the
  least loaded pod; otherwise pods ranked by prefix match % (descending) then in-flight
  (ascending), the first whose in-flight <= mean + 2 x stddev wins (least loaded if none).
  128-character blocks, 200,000 blocks per pod.

The GIE presets (v0.3 decision tree, v1 default scorers) and poolkeeper's own default profile
are not here: they are the real scheduler, built in `bench.policies.routers`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from poolkeeper.bench.policies.prefixtrees import ApproxRadixTree, BlockPrefixIndex
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import NoReadyEndpoint
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.tokens import CHARS_PER_TOKEN


class BaselinePolicy:
    """Base class: a name, an injected RNG, and the no-candidate check."""

    name = "baseline"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        if not endpoints:
            raise NoReadyEndpoint(f"{self.name}: no endpoint to route {request.request_id} to")
        return self._pick(request, endpoints, now)

    def _pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        raise NotImplementedError

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        """Called when a routed request completes (no baseline needs it; kept for symmetry)."""

    def on_first_token(self, request_id: str, now: float) -> None:
        """Called at a routed request's first token (no baseline learns from it)."""


def _load(e: EndpointState) -> int:
    return e.inflight_requests


class RoundRobin(BaselinePolicy):
    name = "round-robin"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._next = 0

    def _pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        chosen = endpoints[self._next % len(endpoints)]
        self._next += 1
        return chosen


class RandomPick(BaselinePolicy):
    name = "random"

    def _pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        return self.rng.choice(endpoints)


class LeastRequest(BaselinePolicy):
    name = "least-request"

    def _pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        low = min(_load(e) for e in endpoints)
        return self.rng.choice([e for e in endpoints if _load(e) == low])


class PowerOfTwo(BaselinePolicy):
    name = "power-of-two"

    def _pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        if len(endpoints) == 1:
            return endpoints[0]
        a, b = self.rng.sample(range(len(endpoints)), 2)
        return endpoints[b] if _load(endpoints[b]) < _load(endpoints[a]) else endpoints[a]


@dataclass(frozen=True, slots=True)
class CacheAwareParams:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 33_554_432
    eviction_interval: float = 120.0


class CacheAware(BaselinePolicy):
    """sglang-router / vllm-router `cache_aware`."""

    name = "cache-aware"

    def __init__(self, rng: random.Random, params: CacheAwareParams | None = None) -> None:
        super().__init__(rng)
        self.params = params or CacheAwareParams()
        self.tree = ApproxRadixTree(self.params.max_tree_chars)
        self._next_eviction = self.params.eviction_interval

    def _pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        p = self.params
        if now >= self._next_eviction:
            self.tree.evict()
            self._next_eviction = now + p.eviction_interval
        loads = [_load(e) for e in endpoints]
        hi, lo = max(loads), min(loads)
        least = endpoints[loads.index(lo)]  # first minimum, as the Rust routers do
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            chosen = least
        else:
            chosen = least
            found = self.tree.match(request.prompt)
            ratio = found.matched_chars / len(request.prompt) if request.prompt else 0.0
            if ratio > p.cache_threshold:
                by_key = {e.key: e for e in endpoints}
                holders = [(t, k) for k, t in found.tenants.items() if k in by_key]
                if holders:
                    chosen = by_key[max(holders)[1]]  # most recently used holder
        self.tree.insert(request.prompt, chosen.key, now)
        return chosen


class DynamoKV(BaselinePolicy):
    """Dynamo KV router cost: overlap_weight x uncached prefill blocks + active decode blocks."""

    name = "dynamo-kv"

    def __init__(
        self,
        rng: random.Random,
        *,
        block_tokens: int = 16,
        overlap_weight: float = 1.0,
        ttl: float = 120.0,
    ) -> None:
        super().__init__(rng)
        self.block_tokens = block_tokens
        self.overlap_weight = overlap_weight
        self.index = BlockPrefixIndex(block_tokens * CHARS_PER_TOKEN, 1 << 30, ttl=ttl)

    def cost(self, request: LLMRequest, endpoint: EndpointState, cached_blocks: int) -> float:
        prompt_blocks = request.prompt_tokens / self.block_tokens
        prefill = max(0.0, prompt_blocks - cached_blocks)
        decode = endpoint.inflight_tokens / self.block_tokens
        return self.overlap_weight * prefill + decode

    def _pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        hashes = self.index.hashes(request.target_model, request.prompt)
        cached = self.index.match(hashes, now)
        costs = [
            self.cost(r, e, cached.get(e.key, 0)) for r, e in ((request, e) for e in endpoints)
        ]
        best = min(costs)
        chosen = self.rng.choice([e for e, c in zip(endpoints, costs, strict=True) if c == best])
        self.index.insert(chosen.key, hashes, now)
        return chosen


class AIBrixPrefix(BaselinePolicy):
    """AIBrix `prefix-cache`: prefix match unless running counts are spread by more than 16."""

    name = "aibrix-prefix"

    def __init__(
        self,
        rng: random.Random,
        *,
        block_chars: int = 128,
        capacity_blocks: int = 200_000,
        imbalance: int = 16,
    ) -> None:
        super().__init__(rng)
        self.imbalance = imbalance
        self.index = BlockPrefixIndex(block_chars, capacity_blocks)

    def _least(self, endpoints: Sequence[EndpointState]) -> EndpointState:
        low = min(_load(e) for e in endpoints)
        return self.rng.choice([e for e in endpoints if _load(e) == low])

    def _pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        hashes = self.index.hashes(request.target_model, request.prompt)
        loads = [_load(e) for e in endpoints]
        if max(loads) - min(loads) > self.imbalance:
            chosen = self._least(endpoints)
        else:
            matched = self.index.match(hashes, now)
            total = max(1, len(hashes))
            mean = sum(loads) / len(loads)
            std = math.sqrt(sum((x - mean) ** 2 for x in loads) / len(loads))
            order = sorted(
                endpoints,
                key=lambda e: (-matched.get(e.key, 0) / total, _load(e), self.rng.random()),
            )
            chosen = next((e for e in order if _load(e) <= mean + 2 * std), None) or self._least(
                endpoints
            )
        self.index.insert(chosen.key, hashes, now)
        return chosen


BASELINES: dict[str, type[BaselinePolicy]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        RandomPick,
        LeastRequest,
        PowerOfTwo,
        CacheAware,
        DynamoKV,
        AIBrixPrefix,
    )
}
