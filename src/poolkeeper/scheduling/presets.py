"""Named scheduling configurations: poolkeeper's default and upstream baselines for parity.

Plain data: each preset is the YAML-equivalent dict documented in docs/scheduling.md. Pick one
with `scheduling: {preset: <name>}`; SchedulingConfig (config.py) validates the preset's dict
exactly like a user's document. `config.preset_config(name)` gives it as a SchedulingConfig.
"""

from __future__ import annotations

import copy
from typing import Any


def _no_inflight(**extra: Any) -> dict[str, Any]:
    """Parameters of a load plugin that sees only scraped metrics, as upstream did."""
    return {**extra, "countUnseen": False}


# `classic`: poolkeeper's default until issue 38's switch (docs/scheduling.md §4): prefix
# affinity, effective load, LoRA affinity; every candidate below is measured as an addition to it.
# - stale-metrics-filter: endpoints whose metrics are older than 200 ms are skipped while any
#   other endpoint is fresh (fails open).
# - queue-scorer / running-requests-size-scorer with a minimum span, so a difference of one or
#   two requests costs a little (not the whole range, as plain min-max does); both count
#   requests sent since the last scrape, so bursts between scrapes spread.
# - prefix-cache-scorer with minScoredBlocks 8: a hit on a prompt shorter than 512 characters
#   earns only its share of 8 blocks, so identical short prompts do not herd onto one server.
# - observed-speed-scorer (tolerance 0.3): endpoints the router measured as slower per output
#   token than the fastest (beyond 1.3x) score less, so a mixed-speed fleet sends more to its
#   fast servers; in a uniform fleet the noise stays inside the tolerance.
# - max-score-picker: random tie-break spreads cache misses; 3 fallbacks for the proxy.
# Weights chosen with the virtual-time fleet simulator (docs/scheduling.md §3).
_CLASSIC: dict[str, Any] = {
    "plugins": [
        {"type": "stale-metrics-filter"},
        {"type": "queue-scorer", "parameters": {"minSpan": 8}},
        {"type": "running-requests-size-scorer", "parameters": {"minSpan": 16}},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefix-cache-scorer", "parameters": {"minScoredBlocks": 8}},
        {"type": "lora-affinity-scorer"},
        {"type": "observed-speed-scorer", "parameters": {"tolerance": 0.3}},
        {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 4}},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "stale-metrics-filter"},
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "running-requests-size-scorer", "weight": 1},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "lora-affinity-scorer", "weight": 2},
                {"pluginRef": "observed-speed-scorer", "weight": 2},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


def _default_plus(scorer: str, weight: float, **params: Any) -> dict[str, Any]:
    """The `classic` profile plus `scorer` (a type taking `prefixScorer`) reading its
    prefix index, at `weight`, with `params`: the `predicted-ttft` and `prefill-backlog`
    presets and the candidates for the default measured beside them."""
    doc = copy.deepcopy(_CLASSIC)
    doc["plugins"].insert(
        -1, {"type": scorer, "parameters": {"prefixScorer": "prefix-cache-scorer", **params}}
    )
    doc["schedulingProfiles"][0]["plugins"].insert(-1, {"pluginRef": scorer, "weight": weight})
    return doc


def _answered_wait(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its queue-scorer counting unseen requests that answered as waiting."""
    for plugin in doc["plugins"]:
        if plugin["type"] == "queue-scorer":
            plugin.setdefault("parameters", {})["answeredRun"] = False
    return doc


def _cold_spread(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its prefix-cache-scorer's `coldSpread` 0.5: a new long prefix scored towards
    the endpoint the index credits with the least content (sglang's smallest tree)."""
    for plugin in doc["plugins"]:
        if plugin["type"] == "prefix-cache-scorer":
            plugin.setdefault("parameters", {})["coldSpread"] = 0.5
    return doc


def _with_full_batch(doc: dict[str, Any], miss_gate: bool = False) -> dict[str, Any]:
    """`doc` with a `saturation-filter` right after its first plugin (the stale filter) that
    drops an endpoint whose full batch (learned from its gauges) has 2 or more waiting while
    another has fewer (slot-bound engines; docs/notes/2026-12-06-live-routing-fifth-round.md);
    `miss_gate`: unless it holds the prompt and its queue costs less than a miss elsewhere
    (docs/notes/2026-12-06-live-routing-sixth-round.md)."""
    full_batch: dict[str, Any] = {
        "queueDepthThreshold": 1, "kvCacheUtilThreshold": 1.0, "headroom": 1,
        "learnMaxNumSeqs": True,
    }  # fmt: skip
    if miss_gate:
        full_batch |= {"missGate": True, "prefixScorer": "prefix-cache-scorer"}
    doc["plugins"].insert(1, {"type": "saturation-filter", "parameters": full_batch})
    doc["schedulingProfiles"][0]["plugins"].insert(1, {"pluginRef": "saturation-filter"})
    return doc


def _speed_weight(doc: dict[str, Any], weight: float) -> dict[str, Any]:
    """`doc` with its observed-speed-scorer at `weight`."""
    for ref in doc["schedulingProfiles"][0]["plugins"]:
        if ref["pluginRef"] == "observed-speed-scorer":
            ref["weight"] = weight
    return doc


def _prefix_affinity(miss_gate: bool = False, **backlog: Any) -> dict[str, Any]:
    """The `prefix-affinity` preset: the default profile plus the `prefill-backlog-scorer`
    (weight 2); its stale filter keeps a prefix's late holders; then a `saturation-filter`
    that drops an endpoint whose full batch (learned) has 2 or more waiting while another
    has fewer (slot-bound engines); then the `prefix-affinity-filter` (always on; a new long
    prefix to the least placed endpoints or those with one more, where the backlog picks one
    not busy prefilling). Live: docs/notes/2026-12-06-live-routing-fifth-round.md.
    `backlog`: more parameters of the backlog scorer (a candidate's fade)."""
    doc = _default_plus("prefill-backlog-scorer", 2, **backlog)
    stale = doc["plugins"][0]
    assert stale["type"] == "stale-metrics-filter"
    stale["parameters"] = {"prefixScorer": "prefix-cache-scorer"}
    _with_full_batch(doc, miss_gate)
    doc["plugins"].insert(
        2,
        {"type": "prefix-affinity-filter", "parameters": {"coldBalance": True, "coldSlack": 1.0}},
    )
    doc["schedulingProfiles"][0]["plugins"].insert(2, {"pluginRef": "prefix-affinity-filter"})
    return doc


def _gie_v1(queue: float, kv: float, prefix: float) -> dict[str, Any]:
    return {
        "plugins": [
            {"type": "queue-scorer", "parameters": _no_inflight()},
            {"type": "kv-cache-utilization-scorer", "parameters": _no_inflight()},
            {"type": "prefix-cache-scorer"},
            {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 1}},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": queue},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": kv},
                    {"pluginRef": "prefix-cache-scorer", "weight": prefix},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def _chain(*names: str) -> dict[str, Any]:
    """A -> B -> C on success or failure (the v0.3 building block)."""
    node: dict[str, Any] = {"current": {"pluginRef": names[-1]}}
    for name in reversed(names[:-1]):
        node = {"current": {"pluginRef": name}, "nextOnSuccessOrFailure": {"decisionTree": node}}
    return node


# GIE v0.3.0's tree, thresholds as shipped (queueingThresholdLoRA 128 with strict <, queue 5,
# KV 0.8, LoRA affinity 0.999), then a uniformly random pick among the survivors.
_V03: dict[str, Any] = {
    "plugins": [
        {"type": "critical-request-filter", "name": "critical"},
        {
            "type": "low-queue-filter",
            "name": "low-queue",
            "parameters": _no_inflight(threshold=128, inclusive=False),
        },
        {
            "type": "lora-affinity-filter",
            "name": "lora-affinity",
            "parameters": {"threshold": 0.999},
        },
        {"type": "least-queue-filter", "name": "least-queue", "parameters": _no_inflight()},
        {"type": "least-kv-cache-filter", "name": "least-kv-cache", "parameters": _no_inflight()},
        {
            "type": "has-capacity-filter",
            "name": "has-capacity",
            "parameters": _no_inflight(queueThreshold=5, kvCacheThreshold=0.8),
        },
        {"type": "drop-request-filter", "name": "drop"},
        {
            "type": "decision-tree-filter",
            "name": "v0.3-tree",
            "parameters": {
                "current": {"pluginRef": "critical"},
                "nextOnSuccess": {
                    "decisionTree": {
                        "current": {"pluginRef": "low-queue"},
                        "nextOnSuccess": {
                            "decisionTree": _chain("lora-affinity", "least-queue", "least-kv-cache")
                        },
                        "nextOnFailure": {
                            "decisionTree": _chain("least-queue", "lora-affinity", "least-kv-cache")
                        },
                    }
                },
                "nextOnFailure": {
                    "decisionTree": {
                        "current": {"pluginRef": "has-capacity"},
                        "nextOnSuccess": {
                            "decisionTree": _chain("least-queue", "lora-affinity", "least-kv-cache")
                        },
                        "nextOnFailure": {"pluginRef": "drop"},
                    }
                },
            },
        },
        {"type": "random-picker", "parameters": {"maxNumOfEndpoints": 1}},
    ],
    "schedulingProfiles": [
        {"name": "default", "plugins": [{"pluginRef": "v0.3-tree"}, {"pluginRef": "random-picker"}]}
    ],
}

_RANDOM: dict[str, Any] = {
    "plugins": [{"type": "random-picker", "parameters": {"maxNumOfEndpoints": 1}}],
}

# poolkeeper's default (docs/scheduling.md §3; issue 38's switch, measured in
# docs/notes/2026-12-07-default-switch.md): `classic` plus
# - saturation-filter right after the stale filter, learning each endpoint's batch from its
#   gauges: an endpoint whose full batch has 2 or more waiting is dropped while another has
#   fewer, unless it holds the prompt and its queue costs less than a miss elsewhere (the
#   miss gate). Slot-bound engines (live, 8 batch slots) stop queueing behind a full batch.
# - prefill-backlog-scorer (weight 2): prompt tokens sent whose first byte has not come back,
#   its say fading from a pool busy share of 0.5 to none at 0.8, so the load scorers place
#   near saturation (selfish routing onto fast servers lost the heterogeneous fleet at 1.1x).
# - queue-scorer with `answeredRun: false`: unseen requests that answered count as waiting.
# Flow control's `holdNewPrefixes` (on by default, flowcontrol/config.py) reads the backlog.
_DEFAULT: dict[str, Any] = _with_full_batch(
    _answered_wait(_default_plus("prefill-backlog-scorer", 2, fadeFrom=0.5, fadeTo=0.8)),
    miss_gate=True,
)

PRESETS: dict[str, dict[str, Any]] = {
    "default": _DEFAULT,
    "classic": _CLASSIC,
    "predicted-ttft": _default_plus("predicted-ttft-scorer", 2),
    "prefill-backlog": _default_plus("prefill-backlog-scorer", 2),
    "prefix-affinity": _prefix_affinity(),
    "gie-v1-default": _gie_v1(2, 2, 3),  # GIE v1.2+ / v1.5 built-in default
    "gie-v1.0-default": _gie_v1(1, 1, 1),  # GIE v1.0 chart / v0.5 plugins-v2.yaml
    "gie-v0.3-decision-tree": _V03,
    "random": _RANDOM,
}


# Candidates for the default profile (issue 38; measured in
# docs/notes/2026-12-06-routing-quality-third-round.md), kept by name so that each can be
# compared in the benchmarks (`bench.policies.schedpolicy.CANDIDATE_PRESETS`); not user presets.
CANDIDATES: dict[str, dict[str, Any]] = {
    # the backlog as a wait in seconds, each endpoint's tokens over its measured drain rate.
    "prefill-backlog-drain": _default_plus(
        "prefill-backlog-scorer", 2, drainRate=True, speedTolerance=None
    ),
    # ... scored by a fixed span (2,048 tokens ahead halve the score) instead of the ratio.
    "prefill-backlog-span": _default_plus("prefill-backlog-scorer", 2, spanTokens=2048),
    "prefill-backlog-span4k": _default_plus("prefill-backlog-scorer", 2, spanTokens=4096),
    # ... at weight 1 (half the backlog's say against the load and affinity scorers).
    "prefill-backlog-w1": _default_plus("prefill-backlog-scorer", 1),
    # ... at weight 0: the default's choices, but the router learns each first byte (which
    # unseen requests already answered), as every backlog candidate does.
    "prefill-backlog-w0": _default_plus("prefill-backlog-scorer", 0),
    "prefill-backlog-drain-span": _default_plus(
        "prefill-backlog-scorer", 2, drainRate=True, speedTolerance=None, spanTokens=2048
    ),
    # ... scored relative to the pool's mean backlog (span = lowest cost + mean backlog).
    "prefill-backlog-mean-span": _default_plus("prefill-backlog-scorer", 2, meanSpan=True),
    # ... each cost over 1 - the endpoint's utilisation (the M/M/1 marginal cost's factor).
    "prefill-backlog-busy": _default_plus("prefill-backlog-scorer", 2, busyPenalty=True),
    "prefill-backlog-drain-busy": _default_plus(
        "prefill-backlog-scorer", 2, drainRate=True, speedTolerance=None, busyPenalty=True
    ),
    # ... as the marginal cost: the request's wait plus the wait it adds to the backlog's.
    "prefill-backlog-marginal": _default_plus("prefill-backlog-scorer", 2, marginal=True),
    "prefill-backlog-drain-marginal": _default_plus(
        "prefill-backlog-scorer", 2, drainRate=True, speedTolerance=None, marginal=True
    ),
    # issue 38, fourth round (docs/notes/2026-12-06-routing-quality-fourth-round.md): the
    # backlog's say fading from a pool busy share of 0.6 to none at 0.9, and the queue scorer
    # counting unseen requests that answered as waiting (as a profile without first bytes does).
    "prefill-backlog-fade": _answered_wait(
        _default_plus("prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9)
    ),
    # ... the same without the fade, and the fade with the queue scorer as it was.
    "prefill-backlog-answered-wait": _answered_wait(_default_plus("prefill-backlog-scorer", 2)),
    "prefill-backlog-fade-only": _default_plus(
        "prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9
    ),
    # ... fading from 0.5 to 0.8: screened on four points only (fourth round's note).
    "prefill-backlog-fade-early": _answered_wait(
        _default_plus("prefill-backlog-scorer", 2, fadeFrom=0.5, fadeTo=0.8)
    ),
    # fifth round (docs/notes/2026-12-06-routing-quality-fifth-round.md): `prefill-backlog-fade`
    # with the busy share rising with a 0.1 s (0.3 s) time constant and falling with 1 s, so a
    # burst that fills the pool at once is placed without the backlog.
    "prefill-backlog-fade-rise": _answered_wait(
        _default_plus("prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9, fadeRiseS=0.1)
    ),
    "prefill-backlog-fade-rise3": _answered_wait(
        _default_plus("prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9, fadeRiseS=0.3)
    ),
    # sixth round (docs/notes/2026-12-06-routing-quality-sixth-round.md): new shared prefixes
    # spread by index content (`coldSpread` 0.5) on the default and on the two fades, for the
    # cold start of shared-prefix below capacity.
    "default-cold-spread": _cold_spread(copy.deepcopy(_CLASSIC)),
    "prefill-backlog-fade-early-cold-spread": _cold_spread(
        _answered_wait(_default_plus("prefill-backlog-scorer", 2, fadeFrom=0.5, fadeTo=0.8))
    ),
    "prefill-backlog-fade-cold-spread": _cold_spread(
        _answered_wait(_default_plus("prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9))
    ),
    # issue 38, fifth round: the default with the prefix-affinity preset's learned full-batch
    # filter (live 8 slots: docs/notes/2026-12-06-live-routing-fifth-round.md).
    "default-full-batch": _with_full_batch(copy.deepcopy(_CLASSIC)),
    # issue 38, sixth round: the same filter with the cost-of-a-miss gate (a prefix holder
    # stays unless its queue costs more than a miss elsewhere; live and three seeds:
    # docs/notes/2026-12-06-live-routing-sixth-round.md).
    "default-miss-gate": _with_full_batch(copy.deepcopy(_CLASSIC), miss_gate=True),
    # ... with the queue scorer counting unseen requests that answered as waiting, as the
    # default does without first bytes: the gate learns from first bytes, and that alone
    # moved the default's choices (heterogeneous 1.1x seed 1: 0.111 -> 0.134 s). With the
    # seventh round's gate (holders only, where dearer than every kept endpoint) this is the
    # candidate for the default: docs/notes/2026-12-06-live-routing-seventh-round.md.
    "default-miss-gate-aw": _answered_wait(_with_full_batch(copy.deepcopy(_CLASSIC), True)),
    # ... and the `prefix-affinity` preset with its filter gated the same way.
    "prefix-affinity-miss-gate": _prefix_affinity(miss_gate=True),
    # issue 38, the default switch (docs/notes/2026-12-07-default-switch.md): the gated preset's
    # filters (full batch with the miss gate, prefix affinity) on `prefill-backlog-fade-early`'s
    # profile (the backlog fading from a busy share of 0.5 to none at 0.8, the queue scorer
    # counting answered unseen requests as waiting): the gate for the live regimes, the fade
    # for heavy-tail and the heterogeneous fleet at 1.1x.
    "prefix-affinity-miss-gate-fade-early": _answered_wait(
        _prefix_affinity(miss_gate=True, fadeFrom=0.5, fadeTo=0.8)
    ),
    # ... and `prefill-backlog-fade-early` with only the gated full-batch filter (no prefix
    # affinity filter, whose holders-first rule lost the heterogeneous fleet at 1.1x and
    # multi-LoRA's goodput at 0.9x in the screen): the filter for live 8 slots, the fade's
    # placement everywhere else. With `holdNewPrefixes` it won the switch: now the default.
    "prefill-backlog-fade-early-miss-gate": _with_full_batch(
        _answered_wait(_default_plus("prefill-backlog-scorer", 2, fadeFrom=0.5, fadeTo=0.8)),
        miss_gate=True,
    ),
    # The default with its observed-speed-scorer at 1.5 instead of 2: the backlog scorer
    # already scales its costs by observed speed, so the default counts a slow server's
    # slowness twice. Heterogeneous 1.1x, 8 servers: 0.82x aibrix-prefix's p90 (the default
    # 0.89x; lower on 7 of 9 seed and tie-break streams), but below capacity 2-12 % higher p90
    # and, where the speed scorer fires on identical servers, heavy-tail 1.1x goodput -0.6 %:
    # not the default (docs/notes/2026-12-07-heterogeneous-overload.md).
    "default-speed15": _speed_weight(copy.deepcopy(_DEFAULT), 1.5),
}


def candidate_document(name: str) -> dict[str, Any]:
    """The YAML-equivalent dict of a candidate (a copy); KeyError for an unknown name."""
    return copy.deepcopy(CANDIDATES[name])


def preset_document(name: str) -> dict[str, Any]:
    """The YAML-equivalent dict of a preset (a copy); raises KeyError naming the known presets."""
    if name not in PRESETS:
        raise KeyError(f"unknown scheduling preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return copy.deepcopy(PRESETS[name])
