"""The `prefix-cache-scorer`: share of the prompt's leading blocks an endpoint probably caches.

Owns a `PrefixIndex`. Scoring hashes the prompt once per decision (kept in the cycle state, so
several profiles share it); after the decision, PostCycle records the primary pick as holding
every block of the prompt. Score = matched leading blocks / max(prompt blocks, minScoredBlocks)
(0 for prompts shorter than one block).

Why `minScoredBlocks`: a hit is worth the prefill it saves, which grows with the matched length.
Upstream scores a one-block prompt that hits as 1.0, the same as a 4k-token shared system prompt,
so identical short prompts (health checks, canned questions) herd onto one server however loaded
it is. With a floor of N blocks, a hit on a short prompt earns at most its share of N blocks.
The plugin default (1) keeps upstream's rule; poolkeeper's default profile sets 8 (512 chars).

Exact mode (`kvEvents: true`): the scorer also keeps an `ExactPrefixIndex` fed by the
engines' KV-cache events (`exact_prefix.py`, which states the staleness rule). For an endpoint
whose exact view is fresh, its match is the longer of the engine-reported one and the
approximate guess (`_with_exact` says why); for the others, the approximate guess alone.
Matches are in prompt characters, so the two block sizes mix. Live, the index is fed by a
`KVEventSubscriber` that follows each decision's candidates (`kvsubscriber.py`).

Cold affinity (`coldAffinity` > 0): a prompt of at least `coldAffinityBlocks` blocks that no
endpoint is known to cache (not even those first blocks) gives that score to one candidate,
the owner of the hash of those blocks on a consistent-hash ring of the endpoints
(`scheduling/hashring.py`). Why:
several EPP replicas each know only the prefixes they routed (and with KV events, those the
engines already scheduled); a new shared prefix arriving at all of them at once is a miss
everywhere, and a random pick prefills it once per replica. Every replica ranks the endpoints
for one prefix the same way, so while the load scorers see them about equal, the replicas
agree without talking. A prompt that never recurs gets a uniformly random push instead, which
costs load balance: hence only long prompts (where a shared prefix saves a real prefill; the
default 32 blocks is 512 tokens) and a small score, so that load still decides.

Balanced cold affinity (`coldAffinityBalance` = c >= 1, needs `kvEvents`): the owner is the
first candidate clockwise on the ring whose chain heads (distinct prompt beginnings: those its
engine reported, plus those this EPP sent it that are not reported yet) number fewer than
c x (all candidates' heads + 1) / candidates (bounded-load consistent hashing). Why: with few
new prefixes the plain ring is a multinomial draw (16 prefixes on 4 servers: 4 +- 1.7 each,
one replica places them 4 each by load); the engines' reports are the same in every replica,
so the replicas still agree, and this EPP's own unreported sends keep it from stacking a burst
of new prefixes on one server before its engine has scheduled any of them. With several
replicas, give it a large `coldAffinity` (1): the load scorers' inputs differ per replica
(own in-flight requests, observed speeds), and a small push that they overrule in some
replicas and not others splits a new group at its second request (live, 4 replicas: 2.1
groups per cold start at 0.2, 0.7 at 1).

Cold affinity with peers only (`coldAffinityPeersOnly`, needs `kvEvents`): the rule applies only
while the KV events show that other routers send traffic to the same engines, i.e. within the
last `coldAffinityPeerWindowS` an engine stored the first block of a prompt this EPP did not
send it (`ExactPrefixIndex.foreign_at`). Why: with one replica the approximate index already
knows every prefix it placed, and placing new prefixes by hash instead of by load costs
balance (shared-prefix chat: +13 % p90 at 0.9x); with several, that agreement is what keeps a
new prefix on one server. Several replicas see each other within one engine step of the first
request another sent; one replica never does.

Cold spread (`coldSpread` > 0): the same cold prompt also gives every candidate `coldSpread` x
(1 - its index blocks / the most any candidate has), so a new shared prefix goes to the endpoint
the index credits with the least cached content, as sglang-router's cache_aware sends a miss to
its smallest tree. Why: in a cold start every server is busy prefilling, so the load scorers see
them about equal and a random tie-break can stack several new system prompts on one server
(whose next steps then serve all of them); the index size counts prefixes already placed there,
and, since each request adds its own blocks, the traffic it got. With the index full on every
endpoint (its LRU capacity) the scores are equal and change nothing.

With the scheduler's stats attached it reports, like upstream, the index size and, after each
pick, the picked endpoint's matched prefix in characters ("bytes" upstream) and as a ratio.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from pydantic import Field, model_validator

from poolkeeper.datastore.columns import MIN_CACHED, Positions
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.hashring import HashRing
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, Scores, TypedName
from poolkeeper.scheduling.kvsubscriber import KVEventSubscriber, events_address
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.prefix import PrefixIndex, prefix_hashes
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.tokens import CHARS_PER_TOKEN


class PrefixCacheParams(PluginParams):
    block_size: int = Field(
        default=64,
        ge=1,
        le=65536,
        description="Hash block size in characters (default 64 = 16 "
        "tokens of 4 characters, GIE hashBlockSize).",
    )
    max_prefix_blocks: int = Field(
        default=256,
        ge=1,
        description="Most leading blocks hashed and matched per prompt (default "
        "256, GIE maxPrefixBlocksToMatch).",
    )
    min_scored_blocks: int = Field(
        default=1,
        ge=1,
        description="Denominator floor of the score: matched / max(prompt blocks, this) "
        "(default 1 = upstream's matched / prompt blocks). Larger values stop short prompts "
        "from earning a full score for a hit that saves little prefill.",
    )
    lru_capacity_per_server: int = Field(
        default=31_250,
        ge=1,
        description="Blocks remembered per endpoint, LRU (default 31,250: "
        "500K tokens of KV cache / 16 tokens per block, GIE lruCapacityPerServer).",
    )
    cold_affinity: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Score given, for a prompt of at least coldAffinityBlocks blocks that no "
        "endpoint is known to cache, to the candidate a consistent-hash ring of the "
        "endpoints assigns those blocks to, so that EPP replicas send a new prefix to the "
        "same endpoint (default 0: off, upstream's rule).",
    )
    cold_affinity_blocks: int = Field(
        default=32,
        ge=1,
        description="Leading blocks that key cold affinity; shorter prompts get none "
        "(default 32: 512 tokens).",
    )
    cold_spread: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="For a prompt of at least coldAffinityBlocks blocks that no endpoint is "
        "known to cache, each candidate scores this x (1 - its index blocks / the most any "
        "candidate has), so a new prefix goes where the least is cached (default 0: off).",
    )
    cold_affinity_balance: float = Field(
        default=0.0,
        ge=0.0,
        description="Bounded-load cold affinity (needs kvEvents): the owner is the first "
        "candidate clockwise on the ring whose engine-reported chain heads are below this x "
        "(all candidates' heads + 1) / candidates, so that no endpoint gets far more than its "
        "share of the new prefixes (default 0: off, the plain ring). Must be 0 or >= 1.",
    )
    cold_affinity_peers_only: bool = Field(
        default=False,
        description="Apply coldAffinity only while the KV events show other routers: within "
        "the last coldAffinityPeerWindowS an engine stored the first block of a prompt this "
        "EPP did not send it (needs kvEvents). With one replica the rule stays off and costs "
        "nothing.",
    )
    cold_affinity_peer_window_s: float = Field(
        default=600.0,
        gt=0,
        description="How long one sighting of another router's traffic keeps "
        "coldAffinityPeersOnly's rule on (sightings come only from new prefixes, which may "
        "be rare once the common ones are cached everywhere).",
    )
    kv_events: bool = Field(
        default=False,
        description="Keep an exact block index from the engines' KV-cache events (vLLM's "
        "BlockStored / BlockRemoved / AllBlocksCleared) and prefer it over the approximate "
        "index for endpoints whose event feed is fresh.",
    )
    kv_events_block_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Engine KV block size in tokens until the first BlockStored event says.",
    )
    kv_events_port: int = Field(
        default=5557,
        ge=1,
        le=65535,
        description="Port of each endpoint's KV-event PUB socket (vLLM's kv-events-config "
        "endpoint tcp://*:5557), connected at the endpoint's IP.",
    )
    kv_events_port_offset: int | None = Field(
        default=None,
        ge=-65535,
        le=65535,
        description="If set, the KV-event port is the endpoint's HTTP port plus this (several "
        "servers on one host, as the simulator's --kv-events-port-offset runs them).",
    )
    kv_events_subscribe: bool = Field(
        default=True,
        description="Subscribe to the endpoints' KV events over ZMQ (false: the index is fed "
        "in-process, as the virtual-time fleet does).",
    )
    kv_events_stale_after_s: float = Field(
        default=5.0,
        gt=0,
        description="An endpoint's exact view is distrusted when a request routed to it this "
        "long ago has been followed by no event batch, or this long after a sequence gap.",
    )

    @model_validator(mode="after")
    def _peers_need_events(self) -> PrefixCacheParams:
        if self.cold_affinity_balance and not self.kv_events:
            raise ValueError(
                "coldAffinityBalance needs kvEvents: true (it counts the prefixes each engine "
                "reported)"
            )
        if 0 < self.cold_affinity_balance < 1:
            raise ValueError("coldAffinityBalance must be 0 (off) or >= 1")
        if self.cold_affinity_peers_only and not self.kv_events:
            raise ValueError(
                "coldAffinityPeersOnly needs kvEvents: true (other routers' traffic is seen "
                "only in the engines' KV events)"
            )
        return self


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
            )
            if params.kv_events_subscribe:
                port, offset = params.kv_events_port, params.kv_events_port_offset
                self._subscriber = KVEventSubscriber(
                    self.exact,
                    lambda hp: events_address(hp, port=port, port_offset=offset),
                    clock=clock,  # the decisions' clock: the index compares its stamps
                )

    def attach_stats(self, stats: SchedulingStats) -> None:
        self._stats = stats
        index = self.index
        stats.add_prefix_index(lambda: index.size)

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
        found = exact.match(
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
