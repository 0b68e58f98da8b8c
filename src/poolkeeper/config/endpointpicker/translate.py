"""EndpointPickerConfig -> poolkeeper settings: the sections of a GatewayConfig spec.

Upstream's system defaults are applied first (reference/llm-d-router.md §2.3): no profiles
means one `default` profile with every filter, scorer and picker; a profile without a picker
gets `max-score-picker` (one endpoint); one profile gets `single-profile-handler`. Then:

- scheduling plugins keep their names and weights; pickers keep `maxNumOfEndpoints` (default
  1, upstream's); `prefix-cache-scorer` takes its block size, match length and LRU size from the
  `approx-prefix-cache-producer` that feeds it (tokens -> poolkeeper's 4-character tokens);
- `metrics-data-source` / `core-metrics-extractor` -> `scraping`; the saturation detector
  (`utilization-detector`) -> `admission` thresholds and `scraping.stalenessMs`;
- feature gate `flowControl` (default off, as upstream) -> `flowControl.enabled`; with it on,
  `flowControl.priorityBands` fold into poolkeeper's three bands (> 0, 0, < 0), first come first
  served with upstream's TTL and bounds; with it off, admission sheds only negative priorities
  at saturation (upstream's legacy admission);
- `dataLayer.crossReplicaSyncerPluginRef` naming a `udp-cross-replica-syncer` -> `replicaSync`
  (`replicasync.py`).

Every problem is collected and reported at once as a ConfigError; what is accepted but only
approximated comes back as notices for the startup log.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from poolkeeper.api.fielderrors import from_pydantic
from poolkeeper.config.endpointpicker.catalogue import (
    UPSTREAM_PLUGINS,
    ApproxPrefixParams,
    CoreMetricsExtractorParams,
    MetricsSourceParams,
    Params,
    PickerParams,
    PrefixScorerParams,
    Role,
    UpstreamPlugin,
    Use,
    UtilizationDetectorParams,
    missing_message,
)
from poolkeeper.config.endpointpicker.document import (
    DEPRECATED_API_VERSION,
    EndpointPickerConfig,
    FlowControl,
    PluginSpec,
)
from poolkeeper.config.endpointpicker.replicasync import replica_sync_section, written_at
from poolkeeper.config.endpointpicker.values import parse_duration, parse_size
from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.plugins.builtins import builtin_registry
from poolkeeper.scheduling.registry import PluginKind

FEATURE_GATES: Mapping[str, bool] = {"flowControl": False, "haPopulateNonLeaderDatastore": True}
REMOVED_GATES = ("dataLayer", "enableLegacyMetrics")
_ROLE_OF_KIND = {
    PluginKind.FILTER: Role.FILTER,
    PluginKind.SCORER: Role.SCORER,
    PluginKind.PICKER: Role.PICKER,
    PluginKind.PROFILE_HANDLER: Role.PROFILE_HANDLER,
}
_PROFILE_ROLES = (Role.FILTER, Role.SCORER, Role.PICKER)
_TOKEN_CHARS = 4  # poolkeeper's approximate tokenizer (tokens.py)


class InvalidEndpointPickerConfig(ConfigError):
    """Every problem of one EndpointPickerConfig (`problems`, one line each)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid EndpointPickerConfig:\n  " + "\n  ".join(problems))
        self.problems = tuple(problems)


@dataclass(frozen=True, slots=True)
class Translation:
    """The GatewayConfig spec sections an EndpointPickerConfig means, and what to tell."""

    sections: Mapping[str, Any]
    notices: tuple[str, ...]
    feature_gates: Mapping[str, bool]
    served_verifier: bool = False  # destination-endpoint-served-verifier configured
    # Where the replicaSync section's key file was written (the syncer's parameter): the key
    # is read at start, and its errors name this rather than spec.replicaSync.keyFile.
    key_file_at: str | None = None


def load_endpoint_picker_config(text: str, source: str) -> EndpointPickerConfig:
    """Parse and validate the document (ConfigError lists every problem with its path)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML or JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: an EndpointPickerConfig must be a mapping")
    try:
        return EndpointPickerConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: {e.path}: {e.message}" for e in from_pydantic(exc)]
        raise ConfigError("invalid EndpointPickerConfig:\n  " + "\n  ".join(lines)) from None


@dataclass(slots=True)
class _Work:
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    params: dict[str, Params] = field(default_factory=dict)  # by instance name
    specs: dict[str, UpstreamPlugin | None] = field(default_factory=dict)  # None: poolkeeper's
    raw: dict[str, PluginSpec] = field(default_factory=dict)


def gates_of(config: EndpointPickerConfig, extra: Iterable[str], work: _Work) -> dict[str, bool]:
    gates = dict(FEATURE_GATES)
    for where, entries in (("featureGates", config.feature_gates), ("--feature-gates", extra)):
        for i, entry in enumerate(entries):
            name, sep, value = entry.partition("=")
            name = name.strip()
            if name in REMOVED_GATES:
                work.notices.append(f"{where}[{i}]: feature gate {name!r} was removed; ignored")
                continue
            if name not in FEATURE_GATES:
                work.problems.append(
                    f"{where}[{i}]: unknown or unregistered feature gate {name!r} "
                    f"(known: {', '.join(FEATURE_GATES)})"
                )
                continue
            if sep and value.strip().lower() not in ("true", "false"):
                work.problems.append(f"{where}[{i}]: {entry!r}: the value must be true or false")
                continue
            gates[name] = not sep or value.strip().lower() == "true"
    return gates


def _check_plugins(config: EndpointPickerConfig, allow_experimental: bool, work: _Work) -> None:
    registry = builtin_registry()
    for i, plugin in enumerate(config.plugins):
        where = f"plugins[{i}]"
        name = plugin.instance_name
        if name in work.raw:
            work.problems.append(f"{where}.name: duplicate plugin name {name!r}")
            continue
        work.raw[name] = plugin
        upstream = UPSTREAM_PLUGINS.get(plugin.type)
        if upstream is None:
            if plugin.type in registry:  # one of poolkeeper's own: its own parameters
                work.specs[name] = None
                continue
            work.problems.append(f'{where}.type: unknown plugin type "{plugin.type}"')
            continue
        work.specs[name] = upstream
        if upstream.use is Use.MISSING:
            work.problems.append(f"{where}.type: {missing_message(upstream)}")
            continue
        if upstream.alpha and not allow_experimental:
            work.problems.append(
                f'{where}.type: "{plugin.type}" is Alpha; it needs --allow-experimental-plugins'
            )
        try:
            work.params[name] = upstream.params.model_validate(plugin.parameters or {})
        except ValidationError as exc:
            for err in from_pydantic(exc):
                work.problems.append(f"{where}.parameters.{err.path}: {err.message}".rstrip("."))
            continue
        if upstream.use is Use.ACCEPTED:
            note = f" ({upstream.note})" if upstream.note else ""
            work.notices.append(f'{where}: "{plugin.type}" accepted, no effect{note}')


def _role(name: str, work: _Work) -> Role | None:
    spec = work.specs.get(name)
    if spec is not None:
        return spec.role
    registered = builtin_registry().get(work.raw[name].type) if name in work.raw else None
    return _ROLE_OF_KIND[registered.kind] if registered is not None else None


def _prefix_params(scorer: PrefixScorerParams, work: _Work) -> dict[str, Any]:
    """poolkeeper prefix-cache-scorer parameters from the producer that feeds the scorer."""
    if scorer.match_length_weight != 0:
        work.problems.append(
            "prefix-cache-scorer: matchLengthWeight > 0 is not implemented by poolkeeper "
            "(its score is matched blocks / prompt blocks, upstream's weight 0)"
        )
    producers = [
        n
        for n, s in work.specs.items()
        if s is not None and s.type_name == "approx-prefix-cache-producer"
    ]
    wanted = scorer.prefix_match_info_producer_name
    if wanted and wanted not in producers:
        work.problems.append(
            f"prefix-cache-scorer: prefixMatchInfoProducerName {wanted!r} is not an "
            "approx-prefix-cache-producer in plugins"
        )
        return {}
    chosen = wanted or (producers[0] if producers else None)
    if chosen is None:
        return {}
    producer = work.params.get(chosen)
    if not isinstance(producer, ApproxPrefixParams):
        return {}
    out: dict[str, Any] = {}
    tokens_per_block = producer.block_size_tokens or 16
    if producer.block_size is not None:  # deprecated, in characters
        out["blockSize"] = producer.block_size
        tokens_per_block = max(1, producer.block_size // _TOKEN_CHARS)
    elif producer.block_size_tokens is not None:
        out["blockSize"] = producer.block_size_tokens * _TOKEN_CHARS
    if producer.max_prefix_tokens_to_match is not None:
        out["maxPrefixBlocks"] = math.ceil(producer.max_prefix_tokens_to_match / tokens_per_block)
    elif producer.max_prefix_blocks_to_match is not None:
        out["maxPrefixBlocks"] = producer.max_prefix_blocks_to_match
    if producer.lru_capacity_per_server is not None:
        out["lruCapacityPerServer"] = producer.lru_capacity_per_server
    if producer.auto_tune:
        work.notices.append(
            f"{chosen}: autoTune is not implemented; the block size stays "
            f"{out.get('blockSize', 64)} characters"
        )
    return out


def _scheduling(config: EndpointPickerConfig, work: _Work) -> dict[str, Any]:
    plugins: list[dict[str, Any]] = []
    for name, spec in work.specs.items():
        raw = work.raw[name]
        if spec is None:
            plugins.append({"type": raw.type, "name": name, "parameters": raw.parameters or {}})
            continue
        if spec.use is not Use.SCHEDULING:
            continue
        params = work.params.get(name)
        parameters: dict[str, Any] = {}
        if isinstance(params, PickerParams):
            count = params.max_num_of_endpoints
            parameters["maxNumOfEndpoints"] = count if 1 <= count <= 64 else 1
        elif isinstance(params, PrefixScorerParams):
            parameters = _prefix_params(params, work)
        plugins.append({"type": spec.type_name, "name": name, "parameters": parameters})
    schedulable = [p["name"] for p in plugins if _role(p["name"], work) in _PROFILE_ROLES]
    profiles: list[dict[str, Any]] = [
        {
            "name": p.name,
            "plugins": [r.model_dump(by_alias=True, exclude_none=True) for r in p.plugins],
        }
        for p in config.scheduling_profiles
    ] or [{"name": "default", "plugins": [{"pluginRef": n} for n in schedulable]}]
    for i, profile in enumerate(profiles):
        refs = [r["pluginRef"] for r in profile["plugins"]]
        for j, ref in enumerate(refs):
            if ref not in work.raw:
                work.problems.append(
                    f"schedulingProfiles[{i}].plugins[{j}]: unknown plugin {ref!r}"
                )
            elif _role(ref, work) not in _PROFILE_ROLES:
                work.problems.append(
                    f"schedulingProfiles[{i}].plugins[{j}]: {ref!r} is not a filter, scorer or "
                    "picker"
                )
        if not any(_role(r, work) is Role.PICKER for r in refs if r in work.raw):
            picker = "max-score-picker"
            if picker not in work.raw:
                plugins.append(
                    {"type": picker, "name": picker, "parameters": {"maxNumOfEndpoints": 1}}
                )
                work.raw[picker] = PluginSpec(type=picker)
                work.specs[picker] = UPSTREAM_PLUGINS[picker]
            profile["plugins"].append({"pluginRef": picker})
    handlers = [n for n in work.raw if _role(n, work) is Role.PROFILE_HANDLER]
    if len(profiles) > 1:
        work.problems.append(
            f"schedulingProfiles: {len(profiles)} profiles need a multi-profile handler "
            "(disagg-profile-handler), which poolkeeper does not implement; use one profile"
        )
    section: dict[str, Any] = {"plugins": plugins, "schedulingProfiles": profiles}
    if len(handlers) > 1:
        work.problems.append("plugins: more than one profile handler")
    elif handlers:
        section["profileHandler"] = handlers[0]
    return section


def _one_of(role: Role, work: _Work, ref: str | None, where: str) -> str | None:
    """The instance a `pluginRef` names (checked), or the only instance of `role`."""
    if ref is not None:
        if ref not in work.raw:
            work.problems.append(f"{where}: unknown plugin {ref!r}")
            return None
        if _role(ref, work) is not role:
            work.problems.append(f"{where}: {ref!r} is not a {role}")
            return None
        return ref
    found = [n for n in work.raw if _role(n, work) is role]
    return found[0] if found else None


def _duration_ms(text: str, where: str, work: _Work) -> int | None:
    try:
        return round(parse_duration(text) * 1000)
    except ValueError as exc:
        work.problems.append(f"{where}: {exc}")
        return None


def _scraping(config: EndpointPickerConfig, work: _Work) -> dict[str, Any]:
    section: dict[str, Any] = {}
    layer = config.data_layer
    if layer is not None:
        for i, source in enumerate(layer.sources):
            where = f"dataLayer.sources[{i}]"
            if source.plugin_ref not in work.raw:
                work.problems.append(f"{where}.pluginRef: unknown plugin {source.plugin_ref!r}")
            for j, extractor in enumerate(source.extractors):
                if extractor.plugin_ref not in work.raw:
                    work.problems.append(
                        f"{where}.extractors[{j}].pluginRef: unknown plugin "
                        f"{extractor.plugin_ref!r}"
                    )
        if layer.discovery is not None or layer.peer_discovery is not None:
            work.problems.append(
                "dataLayer.discovery: file discovery is not implemented here; run "
                "`poolkeeper serve -f` with GatewayConfig spec.endpoints instead"
            )
    for name, params in work.params.items():
        if isinstance(params, MetricsSourceParams):
            section.update(
                scheme=params.scheme,
                path=params.path,
                insecureSkipVerify=params.insecure_skip_verify,
            )
            if params.interval is not None:
                interval = _duration_ms(params.interval, f"{name}.parameters.interval", work)
                if interval is not None:
                    section["intervalMs"] = max(interval, 50)
            if params.port is not None:
                work.notices.append(
                    f"{name}: port is ignored; metrics are read on the serving port"
                )
            if params.ca_cert_path or params.client_cert_path or params.client_key_path:
                work.problems.append(
                    f"{name}: caCertPath / clientCertPath / clientKeyPath are not implemented"
                )
        elif isinstance(params, CoreMetricsExtractorParams):
            section["defaultEngine"] = params.default_engine
            if params.engine_label_key is not None:
                section["engineLabel"] = params.engine_label_key
            if params.engine_configs:
                work.problems.append(
                    f"{name}.parameters.engineConfigs: custom engine metrics are not "
                    "implemented; poolkeeper's built-in engines are vllm, sglang, trtllm-serve "
                    "and triton-trtllm (defaultEngine)"
                )
    return section


def _detector(config: EndpointPickerConfig, work: _Work) -> UtilizationDetectorParams:
    flow = config.flow_control
    ref = flow.saturation_detector if flow is not None else None
    ref = ref or config.saturation_detector
    where = "flowControl.saturationDetector.pluginRef"
    name = _one_of(Role.DETECTOR, work, ref.plugin_ref if ref else None, where)
    params = work.params.get(name) if name is not None else None
    return params if isinstance(params, UtilizationDetectorParams) else UtilizationDetectorParams()


def _quantity(value: int | str | None, default: int, where: str, work: _Work) -> int:
    if value is None:
        return default
    try:
        return value if isinstance(value, int) else parse_size(value)
    except ValueError as exc:
        work.problems.append(f"{where}: {exc}")
        return default


def _flow(
    config: EndpointPickerConfig, gates: Mapping[str, bool], work: _Work
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(admission, flowControl, edge) sections."""
    detector = _detector(config, work)
    admission: dict[str, Any] = {
        "queueDepthThreshold": detector.queue_depth_threshold,
        "kvCacheUtilThreshold": detector.kv_cache_util_threshold,
        # Upstream's legacy admission sheds only negative priorities, at saturation 1.0.
        "sheddableSaturationLevel": 1.0 + detector.headroom,
        "standardOverloadLevel": None,
    }
    flow = config.flow_control
    if not gates["flowControl"]:
        if flow is not None and flow.model_dump(exclude_none=True, exclude={"saturation_detector"}):
            work.notices.append("flowControl: ignored while the flowControl feature gate is off")
        return admission, {"enabled": False}, {}
    flow = flow if flow is not None else FlowControl()
    ttl = _duration_ms(flow.default_request_ttl or "60s", "flowControl.defaultRequestTTL", work)
    ttl = ttl if ttl and ttl > 0 else 60_000
    for i, band in enumerate(flow.priority_bands):
        for key, ref, role in (
            ("fairnessPolicyRef", band.fairness_policy_ref, Role.FAIRNESS),
            ("orderingPolicyRef", band.ordering_policy_ref, Role.ORDERING),
        ):
            if ref is not None and ref not in work.raw and ref not in UPSTREAM_PLUGINS:
                work.problems.append(
                    f"flowControl.priorityBands[{i}].{key}: unknown plugin {ref!r}"
                )
            elif ref is not None:
                spec = work.specs.get(ref) or UPSTREAM_PLUGINS.get(ref)
                if spec is not None and spec.use is Use.MISSING:
                    work.problems.append(
                        f"flowControl.priorityBands[{i}].{key}: {missing_message(spec)}"
                    )
                elif spec is not None and spec.role is not role:
                    work.problems.append(f"flowControl.priorityBands[{i}].{key}: not a {role}")
    if flow.enable_eviction:
        work.problems.append("flowControl.enableEviction: in-flight eviction is not implemented")
    totals: dict[str, dict[str, int]] = {}
    for i, band in enumerate(flow.priority_bands):
        key = "critical" if band.priority > 0 else "standard" if band.priority == 0 else "sheddable"
        entry = totals.setdefault(key, {"maxRequests": 0, "maxBytes": 0})
        entry["maxRequests"] += band.max_requests or 5000
        where = f"flowControl.priorityBands[{i}].maxBytes"
        entry["maxBytes"] += _quantity(band.max_bytes, 10**9, where, work)
    bands: dict[str, Any] = {}
    for key in ("critical", "standard", "sheddable"):
        limits = totals.get(key, {"maxRequests": 5000, "maxBytes": 10**9})
        bands[key] = {
            "mode": "queue",
            "saturationLimit": 1.0 + detector.headroom,
            "ttlMs": ttl,
            "maxRequests": min(limits["maxRequests"], 1_000_000),
            "maxBytes": limits["maxBytes"],
            "lifoAfterMs": None,
            "shortestFirst": False,  # upstream's order: first come first served
            "overloadTtlMs": None,
            "placement": "scheduler",
            "queueDepthThreshold": None,
        }
    work.notices.append(
        "flowControl: bands fold into poolkeeper's three (priority > 0, 0, < 0); flows share "
        "a band by virtual token counts rather than global-strict fairness"
    )
    edge = {"eppTimeoutS": ttl / 1000.0 + 5.0}
    # Upstream has no new-prefix hold: a translated config does what upstream's does.
    return admission, {"enabled": True, "bands": bands, "holdNewPrefixes": None}, edge


def _parsers(config: EndpointPickerConfig, work: _Work) -> None:
    refs = list(config.request_handler.parsers) if config.request_handler else []
    if not refs and config.parser is not None:
        refs = [config.parser]
    for i, ref in enumerate(refs):
        where = f"requestHandler.parsers[{i}].pluginRef"
        _one_of(Role.PARSER, work, ref.plugin_ref, where)


def translate(
    config: EndpointPickerConfig,
    *,
    feature_gates: Iterable[str] = (),
    allow_experimental: bool = False,
) -> Translation:
    """The poolkeeper settings `config` means (ConfigError listing every problem)."""
    work = _Work()
    if config.api_version == DEPRECATED_API_VERSION:
        work.notices.append(
            f"DEPRECATION: apiVersion {DEPRECATED_API_VERSION}; use llm-d.ai/v1alpha1"
        )
    gates = gates_of(config, feature_gates, work)
    _check_plugins(config, allow_experimental, work)
    scheduling = _scheduling(config, work)
    scraping = _scraping(config, work)
    admission, flow, edge = _flow(config, gates, work)
    detector = _detector(config, work)
    staleness = _duration_ms(
        detector.metrics_staleness_threshold, "metricsStalenessThreshold", work
    )
    if staleness:
        scraping["stalenessMs"] = staleness
    _parsers(config, work)
    types = {name: spec.type for name, spec in work.raw.items()}
    used = [r["pluginRef"] for p in scheduling["schedulingProfiles"] for r in p["plugins"]]
    replica_sync = replica_sync_section(config.data_layer, work.params, types, work.problems, used)
    if work.problems:  # a bad detector reference is met twice: each problem said once
        raise InvalidEndpointPickerConfig(list(dict.fromkeys(work.problems)))
    sections: dict[str, Any] = {
        "scheduling": scheduling,
        "scraping": scraping,
        "admission": admission,
        "flowControl": flow,
    }
    if edge:
        sections["edge"] = edge
    key_file_at = None
    if replica_sync is not None:
        sections["replicaSync"] = replica_sync
        syncer = config.data_layer.cross_replica_syncer_plugin_ref if config.data_layer else None
        key_file_at = written_at("keyFile", syncer or "")
    served = any(
        s is not None and s.type_name == "destination-endpoint-served-verifier"
        for s in work.specs.values()
    )
    if served:
        sections["requestHandling"] = {"conformanceServedEndpointHeader": True}
    return Translation(sections, tuple(work.notices), gates, served, key_file_at)
