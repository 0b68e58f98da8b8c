"""The `prefix-cache-scorer`'s parameters (`PrefixCacheParams`) and why each rule is there.

Why `minScoredBlocks`: a hit is worth the prefill it saves, which grows with the matched length.
Upstream scores a one-block prompt that hits as 1.0, the same as a 4k-token shared system prompt,
so identical short prompts (health checks, canned questions) herd onto one server however loaded
it is. With a floor of N blocks, a hit on a short prompt earns at most its share of N blocks.
The plugin default (1) keeps upstream's rule; poolkeeper's default profile sets 8 (512 chars).

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

"""

from __future__ import annotations

from pydantic import Field, model_validator

from poolkeeper.scheduling.exact_prefix import MAX_BLOCKS_PER_ENDPOINT
from poolkeeper.scheduling.registry import PluginParams


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
    kv_events_receive_thread: bool = Field(
        default=False,
        description="Read the KV-event sockets on a thread of their own, which stamps each "
        "batch's arrival as it comes off the socket (the batches are still applied on the "
        "event loop). Measured in docs/notes/2026-12-07-kv-events-decode.md.",
    )
    kv_index_max_blocks_per_endpoint: int = Field(
        default=MAX_BLOCKS_PER_ENDPOINT,
        ge=1,
        le=1 << 24,
        description="Most engine-reported blocks the exact index keeps per endpoint, least "
        "recently stored out first (default 31,250: 500K tokens of 16-token blocks, "
        "an H100's cache for an 8B model). Bounds the index's memory (about 164 B a block) "
        "whatever an engine reports; below an engine's cache, its least recently used blocks "
        "are matched by the approximate index only.",
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
