"""The `prefix-cache-scorer`: share of the prompt's leading blocks an endpoint probably caches.

Owns a `PrefixIndex`. Scoring hashes the prompt once per decision (kept in the cycle state, so
several profiles share it); after the decision, PostCycle records the primary pick as holding
every block of the prompt. Score = matched leading blocks / max(prompt blocks, minScoredBlocks)
(0 for prompts shorter than one block).

Exact mode (`kvEvents: true`): the scorer also keeps an `ExactPrefixIndex` fed by the
engines' KV-cache events (`exact_prefix.py`, which states the staleness rule). For an endpoint
whose exact view is fresh, its match is the longer of the engine-reported one and the
approximate guess (`_with_exact` says why); for the others, the approximate guess alone.
Matches are in prompt characters, so the two block sizes mix. Live, the index is fed by a
`KVEventSubscriber` that follows each decision's candidates (`kvsubscriber.py`).

Cold affinity, its balanced and peers-only variants and cold spread place a long prompt no
endpoint is known to cache (`_cold_scores`); `prefix_params.py` says what each parameter does
and why.

With the scheduler's stats attached it reports, like upstream, the index size and, after each
pick, the picked endpoint's matched prefix in characters ("bytes" upstream) and as a ratio.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from poolkeeper.datastore.columns import MIN_CACHED, Positions
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.hashring import HashRing
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, Scores, TypedName
from poolkeeper.scheduling.kvsubscriber import KVEventSubscriber, events_address
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.prefix_params import PrefixCacheParams
from poolkeeper.scheduling.prefix import PrefixIndex, prefix_hashes
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.tokens import CHARS_PER_TOKEN


class PrefixCacheScorer(NamedPlugin):
    """Scorer + PostCycle + EndpointForgetter around one approximate prefix index."""

    __slots__ = (
        "_match_key",
        "_positions",
        "_state_key",
        "_stats",
        "_subscriber",
        "_tokens_key",
        "exact",
        "hashring",
        "index",
        "params",
    )
    bounded = True

    def __init__(
        self,
        typed_name: TypedName,
        params: PrefixCacheParams,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(typed_name)
        self.params = params
        self.index = PrefixIndex(params.lru_capacity_per_server)
        self.hashring = HashRing()
        self._state_key = f"prefix-hashes/{typed_name.name}"
        self._match_key = f"prefix-match/{typed_name.name}"
        self._tokens_key = f"prefix-tokens/{typed_name.name}"
        self._positions = Positions()  # (the few holders written into a list of 0.0)
        self._stats: SchedulingStats | None = None
        self.exact: ExactPrefixIndex | None = None
        self._subscriber: KVEventSubscriber | None = None
        if params.kv_events:
            self.exact = ExactPrefixIndex(
                block_size=params.kv_events_block_size,
                stale_after_s=params.kv_events_stale_after_s,
                max_blocks_per_endpoint=params.kv_index_max_blocks_per_endpoint,
            )
            if params.kv_events_subscribe:
                port, offset = params.kv_events_port, params.kv_events_port_offset
                self._subscriber = KVEventSubscriber(
                    self.exact,
                    lambda hp: events_address(hp, port=port, port_offset=offset),
                    clock=clock,  # the decisions' clock: the index compares its stamps
                    thread=params.kv_events_receive_thread,
                )

    def attach_stats(self, stats: SchedulingStats) -> None:
        self._stats = stats
        index = self.index
        stats.add_prefix_index(lambda: index.size)
        if self._subscriber is not None:  # the KV-event families (telemetry/kv_collector.py)
            stats.add_kv_events(self.typed_name.name, self._subscriber.reading)

    def hashes(self, cycle: CycleState, request: LLMRequest) -> list[int]:
        """The request's block hashes, computed once per decision."""
        cached = cycle.get(self._state_key)
        if isinstance(cached, list):
            return cached
        hashes = prefix_hashes(
            request.target_model,
            request.prompt,
            block_size=self.params.block_size,
            max_blocks=self.params.max_prefix_blocks,
        )
        cycle.put(self._state_key, hashes)
        return hashes

    def matched(self, cycle: CycleState, request: LLMRequest) -> dict[str, int]:
        """ip:port -> prompt characters it (probably) caches, once per decision (the
        predicted-TTFT and backlog scorers read the same match)."""
        cached = cycle.get(self._match_key)
        if isinstance(cached, dict):
            return cached
        hashes = self.hashes(cycle, request)
        size = self.params.block_size
        matched = {k: b * size for k, b in self.index.match(hashes).items()} if hashes else {}
        if self.exact is not None and hashes:
            matched = self._with_exact(matched, request, len(hashes) * size, cycle.now)
        cycle.put(self._match_key, matched)
        return matched

    def cached_tokens(self, cycle: CycleState, request: LLMRequest) -> dict[str, int]:
        """ip:port -> prompt tokens it probably caches (the whole prompt at most): `matched`
        in tokens, at the request's own characters per token, once per decision."""
        done = cycle.get(self._tokens_key)
        if isinstance(done, dict):
            return done
        chars, tokens = len(request.prompt), request.prompt_tokens
        per_char = tokens / chars if chars else 0.0
        matched = self.matched(cycle, request) if chars else {}
        cached = {k: min(tokens, int(c * per_char)) for k, c in matched.items()}
        cycle.put(self._tokens_key, cached)
        return cached

    def _with_exact(
        self, approx: dict[str, int], request: LLMRequest, upto: int, now: float
    ) -> dict[str, int]:
        """Per endpoint, the longer of the engine-reported match (where fresh) and the
        approximate one. Why not the engine's alone: an engine stores a prompt's blocks only
        when it schedules the request, so a burst routed to it and still queued there is
        invisible to its events; the approximate index has it from this replica's decisions.
        What the engine reports that this replica never routed (other replicas' requests)
        is what exact mode adds."""
        exact = self.exact
        assert exact is not None
        chunk = exact.block_size * CHARS_PER_TOKEN
        found = exact.lookup(  # (counted: the lookup families of /metrics)
            engine_block_hashes(request.target_model, request.prompt[:upto], exact.block_size)
        )
        out = dict(approx)
        for key, blocks in found.items():
            chars = blocks * chunk
            if chars > out.get(key, 0) and exact.fresh(key, now):
                out[key] = chars
        return out

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        if self._subscriber is not None:
            self._subscriber.follow(s.endpoint.hostport for s in candidates)
        hashes = self.hashes(cycle, request)
        if not hashes:
            return 0.0
        matched = self.matched(cycle, request)
        params = self.params
        cold = params.cold_affinity_blocks
        if (
            (params.cold_affinity or params.cold_spread)
            and len(hashes) >= cold
            and max(matched.values(), default=0) < cold * params.block_size
        ):
            return self._cold_scores(candidates, hashes[cold - 1], cycle.now)
        if not matched:
            return 0.0
        total = max(len(hashes), params.min_scored_blocks) * params.block_size
        where = self._positions.of(cycle, candidates) if len(candidates) >= MIN_CACHED else None
        if where is not None:
            out = [0.0] * len(candidates)
            for key, chars in matched.items():
                if (i := where.get(key)) is not None:
                    out[i] = min(1.0, chars / total)
            return out
        get = {key: min(1.0, chars / total) for key, chars in matched.items()}.get
        return [get(s.endpoint.hostport, 0.0) for s in candidates]

    def peers_seen(self, now: float) -> bool:
        """Whether another router's traffic was sighted within coldAffinityPeerWindowS."""
        seen = self.exact.foreign_at if self.exact is not None else float("-inf")
        return now - seen < self.params.cold_affinity_peer_window_s

    def _cold_scores(
        self, candidates: Sequence[EndpointState], key: int, now: float
    ) -> list[float]:
        """`coldAffinity` for the candidate owning `key` on the ring, plus `coldSpread` scaled
        by how little the index holds on each candidate (capped at 1). Partial matches shorter
        than the cold key are dropped: too short to matter."""
        keys = [s.endpoint.hostport for s in candidates]
        out = [0.0] * len(keys)
        spread = self.params.cold_spread
        if spread:
            sizes = [self.index.blocks(k) for k in keys]
            most = max(sizes)
            if most:
                out = [spread * (1.0 - b / most) for b in sizes]
        params = self.params
        if params.cold_affinity and (not params.cold_affinity_peers_only or self.peers_seen(now)):
            i = keys.index(self.hashring.owner(key, keys, self._fits(keys, now)))
            out[i] = min(1.0, out[i] + self.params.cold_affinity)
        return out

    def _fits(self, keys: list[str], now: float) -> Callable[[str], bool] | None:
        """coldAffinityBalance's test: the endpoint's reported chain heads are under the bound
        (None: the plain ring)."""
        balance, exact = self.params.cold_affinity_balance, self.exact
        if not balance or exact is None:
            return None
        heads = {k: exact.heads(k, now) for k in keys}
        bound = math.ceil(balance * (sum(heads.values()) + 1) / len(keys))
        return lambda k: heads[k] < bound

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        if result.targets:
            hashes = self.hashes(cycle, request)
            picked = result.targets[0].endpoint.hostport
            if self._stats is not None:
                matched = cycle.get(self._match_key)
                chars = matched.get(picked, 0) if isinstance(matched, dict) else 0
                self._stats.prefix_match(chars, len(hashes) * self.params.block_size)
            if hashes:
                self.index.insert(picked, hashes)
            exact = self.exact
            if exact is not None:
                exact.routed(picked, cycle.now)
                chunk = exact.block_size * CHARS_PER_TOKEN
                head = engine_block_hashes(
                    request.target_model, request.prompt[:chunk], exact.block_size
                )
                if head:
                    exact.sent(picked, head[0], cycle.now)

    @property
    def follows(self) -> bool:
        """Whether it subscribes to the endpoints' KV events (`kvEvents` and
        `kvEventsSubscribe`): only then does the runtime tell it the pool's endpoints."""
        return self._subscriber is not None

    @property
    def subscriber(self) -> KVEventSubscriber | None:
        """The KV-event subscription (kvEvents, subscribing), for its per-batch observer."""
        return self._subscriber

    def follow_endpoints(self, endpoints: Iterable[str]) -> None:
        """Subscribe to the pool's endpoints' KV events as soon as they are known. Why not
        only at decisions: an engine reports a block once, when it stores it, and a ZMQ SUB
        socket receives only what is published after it connects; subscribing at the first
        decision loses the cold start's first prefixes for good."""
        if self._subscriber is not None:
            self._subscriber.follow(endpoints)

    async def stop_following(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.close()

    def enable_exact(self, exact: ExactPrefixIndex) -> None:
        """Use `exact` (fed by the caller) from now on; the virtual-time fleet's hook."""
        self.exact = exact

    def forget_endpoints(self, keep: set[str]) -> None:
        self.index.forget_endpoints(keep)
        self.hashring.forget(keep)
        if self.exact is not None:
            self.exact.forget_endpoints(keep)
        if self._subscriber is not None:
            self._subscriber.forget(keep)
