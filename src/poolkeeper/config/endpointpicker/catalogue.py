"""Every plugin type llm-d-router v0.10 registers, and what poolkeeper does with each (and
poolkeeper's own `udp-cross-replica-syncer`, which upstream's config shape can name).

    SCHEDULING   a poolkeeper scheduling plugin of the same name (filters, scorers, pickers,
                 profile handlers); parameters checked against upstream's names
    SETTING      folded into a poolkeeper setting (prefix producer, data sources, detector,
                 flow-control policies, the openai parser)
    ACCEPTED     upstream creates it by default and poolkeeper has its own equivalent built
                 in (in-flight accounting, token estimation): accepted, no effect
    MISSING      not implemented: naming it is a startup error that lists the alternatives

Parameter models mirror upstream's JSON keys and refuse unknown ones (upstream decodes plugin
parameters strictly since v0.9). Types upstream does not know but poolkeeper's registry does
(`inflight-load-scorer`, `saturation-filter`, ...) are passed through with poolkeeper's own
parameters, so an EndpointPickerConfig can use them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field


class Use(StrEnum):
    SCHEDULING = "scheduling"
    SETTING = "setting"
    ACCEPTED = "accepted"
    MISSING = "missing"


class Role(StrEnum):
    FILTER = "filter"
    SCORER = "scorer"
    PICKER = "picker"
    PROFILE_HANDLER = "profile handler"
    PRODUCER = "producer"
    PARSER = "parser"
    DATA = "data layer"
    DETECTOR = "saturation detector"
    FAIRNESS = "fairness policy"
    ORDERING = "ordering policy"
    USAGE_LIMIT = "usage-limit policy"
    DECIDER = "disaggregation decider"
    SYNCER = "cross-replica syncer"
    OTHER = "request control"


class Params(BaseModel):
    """Upstream parameter names exactly (camelCase JSON keys); unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)


class NoParams(Params):
    pass


class PrefixScorerParams(Params):
    prefix_match_info_producer_name: str = Field(default="", alias="prefixMatchInfoProducerName")
    match_length_weight: float = Field(default=0.0, ge=0, le=1, alias="matchLengthWeight")
    match_length_scale_tokens: int = Field(default=8192, ge=1, alias="matchLengthScaleTokens")


class PickerParams(Params):
    max_num_of_endpoints: int = Field(default=1, alias="maxNumOfEndpoints")


class ApproxPrefixParams(Params):
    auto_tune: bool = Field(default=True, alias="autoTune")
    block_size_tokens: int | None = Field(default=None, ge=1, alias="blockSizeTokens")
    block_size: int | None = Field(default=None, ge=1, alias="blockSize")  # characters
    max_prefix_tokens_to_match: int | None = Field(
        default=None, ge=1, alias="maxPrefixTokensToMatch"
    )
    max_prefix_blocks_to_match: int | None = Field(
        default=None, ge=1, alias="maxPrefixBlocksToMatch"
    )
    lru_capacity_per_server: int | None = Field(default=None, ge=1, alias="lruCapacityPerServer")


class MetricsSourceParams(Params):
    scheme: Literal["http", "https"] = "http"
    path: str = "/metrics"
    port: int | None = Field(default=None, ge=1, le=65535)
    insecure_skip_verify: bool = Field(default=True, alias="insecureSkipVerify")
    ca_cert_path: str = Field(default="", alias="caCertPath")
    client_cert_path: str = Field(default="", alias="clientCertPath")
    client_key_path: str = Field(default="", alias="clientKeyPath")
    interval: str | None = None


class ModelsSourceParams(Params):
    scheme: Literal["http", "https"] = "http"
    path: str = "/v1/models"
    insecure_skip_verify: bool = Field(default=True, alias="insecureSkipVerify")
    ca_cert_path: str = Field(default="", alias="caCertPath")
    client_cert_path: str = Field(default="", alias="clientCertPath")
    client_key_path: str = Field(default="", alias="clientKeyPath")
    interval: str | None = None


class CoreMetricsExtractorParams(Params):
    engine_label_key: str | None = Field(default=None, alias="engineLabelKey")
    default_engine: str = Field(default="vllm", alias="defaultEngine")
    engine_configs: list[dict[str, Any]] = Field(default_factory=list, alias="engineConfigs")


class UtilizationDetectorParams(Params):
    queue_depth_threshold: float = Field(default=5, gt=0, alias="queueDepthThreshold")
    kv_cache_util_threshold: float = Field(default=0.8, gt=0, le=1, alias="kvCacheUtilThreshold")
    metrics_staleness_threshold: str = Field(default="200ms", alias="metricsStalenessThreshold")
    headroom: float = Field(default=0.0, ge=0)


class StaticUsageLimitParams(Params):
    threshold: float = Field(default=1.0, gt=0)


class SyncerParams(Params):
    """poolkeeper's `udp-cross-replica-syncer` (spec.replicaSync, docs/kubernetes.md)."""

    port: int = Field(default=9010, ge=1, le=65535)
    address: str = "0.0.0.0"
    peers: list[str] = Field(default_factory=list)
    peer_service: str | None = Field(default=None, alias="peerService")
    key_file: str = Field(default="", alias="keyFile")
    key_optional: bool = Field(default=False, alias="keyOptional")
    resolve_interval: str = Field(default="5s", alias="resolveInterval")
    max_age: str = Field(default="10s", alias="maxAge")
    peer_wake_spread: str = Field(default="20ms", alias="peerWakeSpread")
    # None: the section's own default (`ReplicaSyncConfig.claim_grace_ms`, its one home).
    claim_grace: str | None = Field(default=None, alias="claimGrace")
    reconcile_interval: str = Field(default="1s", alias="reconcileInterval")
    max_datagram_bytes: int = Field(default=1232, ge=1024, le=65_000, alias="maxDatagramBytes")
    origin: str | None = None
    send_at_once: bool = Field(default=True, alias="sendAtOnce")
    peer_unseen: bool = Field(default=True, alias="peerUnseen")


class AnyParams(Params):
    """ACCEPTED plugins: poolkeeper does its own thing; their parameters are not read."""

    model_config = ConfigDict(extra="allow", frozen=True)


@dataclass(frozen=True, slots=True)
class UpstreamPlugin:
    type_name: str
    role: Role
    use: Use
    params: type[Params] = NoParams
    alpha: bool = False
    note: str = ""


_U = UpstreamPlugin
F, SC, PK, PH = Role.FILTER, Role.SCORER, Role.PICKER, Role.PROFILE_HANDLER
PR, PA, DA, DE, OT = Role.PRODUCER, Role.PARSER, Role.DATA, Role.DETECTOR, Role.OTHER
DC = Role.DECIDER
S, T, A, M = Use.SCHEDULING, Use.SETTING, Use.ACCEPTED, Use.MISSING

_PLUGINS: Final[tuple[UpstreamPlugin, ...]] = (
    # Scheduling: filters
    _U("decode-filter", F, S), _U("prefill-filter", F, S), _U("encode-filter", F, S),
    _U("header-based-testing-filter", F, S),
    _U("label-selector-filter", F, M), _U("by-label", F, M), _U("by-label-selector", F, M),
    _U("session-affinity-filter", F, M, alpha=True),
    _U("endpoint-attribute-filter", F, M, alpha=True),
    _U("topology-affinity-filter", F, M, alpha=True), _U("utilization-filter", F, M, alpha=True),
    _U("prefix-cache-affinity-filter", F, M), _U("slo-headroom-tier-filter", F, M),
    _U("multicluster-session-affinity-filter", F, M, alpha=True),
    # Scheduling: scorers
    _U("queue-scorer", SC, S), _U("kv-cache-utilization-scorer", SC, S),
    _U("prefix-cache-scorer", SC, S, PrefixScorerParams), _U("lora-affinity-scorer", SC, S),
    _U("running-requests-size-scorer", SC, S),
    _U("load-aware-scorer", SC, M), _U("context-length-aware", SC, M),
    _U("token-load-scorer", SC, M), _U("no-hit-lru-scorer", SC, M),
    _U("active-request-scorer", SC, M, note="poolkeeper's inflight-load-scorer is the nearest"),
    _U("precise-prefix-cache-scorer", SC, M), _U("mm-embeddings-cache-scorer", SC, M),
    _U("latency-scorer", SC, M, note="poolkeeper's predicted-ttft-scorer is the nearest"),
    _U("session-affinity-scorer", SC, M, alpha=True),
    _U("header-label-affinity-scorer", SC, M, alpha=True),
    _U("endpoint-attribute-scorer", SC, M, alpha=True),
    _U("topology-affinity-scorer", SC, M, alpha=True),
    _U("multicluster-queue-scorer", SC, M, alpha=True),
    _U("multicluster-kv-cache-utilization-scorer", SC, M, alpha=True),
    _U("multicluster-prefix-cache-scorer", SC, M, alpha=True),
    # Scheduling: pickers and profile handlers
    _U("max-score-picker", PK, S, PickerParams), _U("random-picker", PK, S, PickerParams),
    _U("weighted-random-picker", PK, S, PickerParams),
    _U("single-profile-handler", PH, S),
    _U("disagg-profile-handler", PH, M), _U("pd-profile-handler", PH, M),
    _U("disagg-headers-handler", PH, M), _U("prefill-header-handler", PH, M),
    _U("always-disagg-pd-decider", DC, M), _U("always-disagg-multimodal-decider", DC, M),
    _U("prefix-based-pd-decider", DC, M), _U("data-parallel-profile-handler", PH, M),
    _U("header-profile-handler", PH, M, alpha=True),
    # Request control: producers and others
    _U("approx-prefix-cache-producer", PR, T, ApproxPrefixParams),
    _U("inflight-load-producer", PR, A, AnyParams, note="in-flight accounting is built in"),
    _U("token-producer", PR, A, AnyParams, note="tokens are estimated (4 characters each)"),
    _U("tokenizer", PR, A, AnyParams, note="tokens are estimated (4 characters each)"),
    _U("predicted-latency-producer", PR, A, AnyParams, note="not used by any poolkeeper plugin"),
    _U("session-id-producer", PR, A, AnyParams, note="not used by any poolkeeper plugin"),
    _U("mm-embeddings-cache-producer", PR, A, AnyParams, note="not used by any poolkeeper plugin"),
    _U("multicluster-approx-prefix-cache-producer", PR, M, alpha=True),
    _U("precise-prefix-cache-producer", PR, M),
    _U("burst-prefix-cache-producer", PR, M, alpha=True),
    _U("p2p-source-producer", PR, M, alpha=True),
    _U("latency-slo-admitter", OT, M), _U("probabilistic-admitter", OT, M),
    _U("disaggregatedset-rollout-screener", OT, M, alpha=True),
    _U("request-attribute-reporter", OT, M), _U("agent-identity", OT, M, alpha=True),
    _U("destination-endpoint-served-verifier", OT, T),
    _U("models-responder", OT, M, alpha=True),
    # Parsers
    _U("openai-parser", PA, T), _U("anthropic-parser", PA, M), _U("vllmhttp-parser", PA, M),
    _U("vllmgrpc-parser", PA, M), _U("sglanghttp-parser", PA, M), _U("vertexai-parser", PA, M),
    _U("passthrough-parser", PA, M),
    # Data layer
    _U("metrics-data-source", DA, T, MetricsSourceParams),
    _U("core-metrics-extractor", DA, T, CoreMetricsExtractorParams),
    _U("models-data-source", DA, A, ModelsSourceParams, note="served models come from metrics"),
    _U("models-data-extractor", DA, A, note="served models come from the metrics' labels"),
    _U("k8s-notification-source", DA, M), _U("endpoint-notification-source", DA, M),
    _U("dcgm-data-source", DA, M, alpha=True), _U("dcgm-extractor", DA, M, alpha=True),
    _U("topology-extractor", DA, M, alpha=True), _U("file-discovery", DA, M),
    _U("multicluster-file-discovery", DA, M, alpha=True),
    _U("multicluster-metrics-data-source", DA, M, alpha=True),
    _U("multicluster-metrics-extractor", DA, M, alpha=True),
    # Flow control and saturation
    _U("utilization-detector", DE, T, UtilizationDetectorParams),
    _U("concurrency-detector", DE, M),
    _U("global-strict-fairness-policy", Role.FAIRNESS, T),
    _U("round-robin-fairness-policy", Role.FAIRNESS, M),
    _U("program-aware-fairness", Role.FAIRNESS, M),
    _U("fcfs-ordering-policy", Role.ORDERING, T), _U("edf-ordering-policy", Role.ORDERING, M),
    _U("slo-deadline-ordering-policy", Role.ORDERING, M),
    _U("static-usage-limit-policy", Role.USAGE_LIMIT, T, StaticUsageLimitParams),
    _U("priority-holdback-policy", Role.USAGE_LIMIT, M, alpha=True),
    _U("soft-reflective-ceiling-policy", Role.USAGE_LIMIT, M, alpha=True),
    _U("sheddable-eviction-filter", OT, M, alpha=True),
    _U("priority-then-time-eviction-order-policy", OT, M, alpha=True),
    # poolkeeper's own, for dataLayer.crossReplicaSyncerPluginRef (upstream's are not mirrored)
    _U("udp-cross-replica-syncer", Role.SYNCER, T, SyncerParams),
)  # fmt: skip

UPSTREAM_PLUGINS: Final[Mapping[str, UpstreamPlugin]] = MappingProxyType(
    {p.type_name: p for p in _PLUGINS}
)


def implemented(role: Role) -> list[str]:
    """The upstream types of `role` that poolkeeper honours (for error messages)."""
    return sorted(
        p.type_name for p in _PLUGINS if p.role is role and p.use in (Use.SCHEDULING, Use.SETTING)
    )


def missing_message(plugin: UpstreamPlugin) -> str:
    """Why a MISSING plugin stops the start, and what to use instead."""
    alternatives = implemented(plugin.role)
    instead = (
        f"implemented {plugin.role}s: {', '.join(alternatives)}"
        if alternatives
        else f"no {plugin.role} of this kind is implemented"
    )
    extra = f"; {plugin.note}" if plugin.note else ""
    return f'plugin type "{plugin.type_name}" is not implemented by poolkeeper ({instead}{extra})'
