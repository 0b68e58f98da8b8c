"""Named scheduling configurations: poolkeeper's default and upstream baselines for parity.

Plain data: each preset is the YAML-equivalent dict documented in docs/scheduling.md. Pick one
with `scheduling: {preset: <name>}`; SchedulingConfig (config.py) validates the preset's dict
exactly like a user's document. `config.preset_config(name)` gives it as a SchedulingConfig.
The candidates for the default measured beside them are `candidate_presets.py`'s, built from
the documents and builders here.
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
CLASSIC: dict[str, Any] = {
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


def with_scorer(doc: dict[str, Any], scorer: str, weight: float, **params: Any) -> dict[str, Any]:
    """`doc` plus `scorer` (a type taking `prefixScorer`) reading its prefix index, at
    `weight`, with `params`, just before its picker."""
    doc["plugins"].insert(
        -1, {"type": scorer, "parameters": {"prefixScorer": "prefix-cache-scorer", **params}}
    )
    doc["schedulingProfiles"][0]["plugins"].insert(-1, {"pluginRef": scorer, "weight": weight})
    return doc


def default_plus(scorer: str, weight: float, **params: Any) -> dict[str, Any]:
    """The `classic` profile plus `scorer` (`with_scorer`): the `predicted-ttft` and
    `prefill-backlog` presets and the candidates for the default measured beside them."""
    return with_scorer(copy.deepcopy(CLASSIC), scorer, weight, **params)


def answered_wait(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its queue-scorer counting unseen requests that answered as waiting."""
    for plugin in doc["plugins"]:
        if plugin["type"] == "queue-scorer":
            plugin.setdefault("parameters", {})["answeredRun"] = False
    return doc


def cold_spread(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its prefix-cache-scorer's `coldSpread` 0.5: a new long prefix scored towards
    the endpoint the index credits with the least content (sglang's smallest tree)."""
    for plugin in doc["plugins"]:
        if plugin["type"] == "prefix-cache-scorer":
            plugin.setdefault("parameters", {})["coldSpread"] = 0.5
    return doc


def with_full_batch(doc: dict[str, Any], miss_gate: bool = False) -> dict[str, Any]:
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


def speed_weight(doc: dict[str, Any], weight: float) -> dict[str, Any]:
    """`doc` with its observed-speed-scorer at `weight`."""
    for ref in doc["schedulingProfiles"][0]["plugins"]:
        if ref["pluginRef"] == "observed-speed-scorer":
            ref["weight"] = weight
    return doc


def prefix_affinity(miss_gate: bool = False, **backlog: Any) -> dict[str, Any]:
    """The `prefix-affinity` preset: the default profile plus the `prefill-backlog-scorer`
    (weight 2); its stale filter keeps a prefix's late holders; then a `saturation-filter`
    that drops an endpoint whose full batch (learned) has 2 or more waiting while another
    has fewer (slot-bound engines); then the `prefix-affinity-filter` (always on; a new long
    prefix to the least placed endpoints or those with one more, where the backlog picks one
    not busy prefilling). Live: docs/notes/2026-12-06-live-routing-fifth-round.md.
    `backlog`: more parameters of the backlog scorer (a candidate's fade)."""
    doc = default_plus("prefill-backlog-scorer", 2, **backlog)
    stale = doc["plugins"][0]
    assert stale["type"] == "stale-metrics-filter"
    stale["parameters"] = {"prefixScorer": "prefix-cache-scorer"}
    with_full_batch(doc, miss_gate)
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
DEFAULT: dict[str, Any] = with_full_batch(
    answered_wait(default_plus("prefill-backlog-scorer", 2, fadeFrom=0.5, fadeTo=0.8)),
    miss_gate=True,
)

PRESETS: dict[str, dict[str, Any]] = {
    "default": DEFAULT,
    "classic": CLASSIC,
    "predicted-ttft": default_plus("predicted-ttft-scorer", 2),
    "prefill-backlog": default_plus("prefill-backlog-scorer", 2),
    "prefix-affinity": prefix_affinity(),
    "gie-v1-default": _gie_v1(2, 2, 3),  # GIE v1.2+ / v1.5 built-in default
    "gie-v1.0-default": _gie_v1(1, 1, 1),  # GIE v1.0 chart / v0.5 plugins-v2.yaml
    "gie-v0.3-decision-tree": _V03,
    "random": _RANDOM,
}


def preset_document(name: str) -> dict[str, Any]:
    """The YAML-equivalent dict of a preset (a copy); raises KeyError naming the known presets."""
    if name not in PRESETS:
        raise KeyError(f"unknown scheduling preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return copy.deepcopy(PRESETS[name])
