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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from poolkeeper.api.fielderrors import from_pydantic
from poolkeeper.config.endpointpicker.document import DEPRECATED_API_VERSION, EndpointPickerConfig
from poolkeeper.config.endpointpicker.flow_sections import detector_params, flow_sections
from poolkeeper.config.endpointpicker.plugin_checks import check_plugins, gates_of
from poolkeeper.config.endpointpicker.replicasync import replica_sync_section, written_at
from poolkeeper.config.endpointpicker.scheduling_section import check_parsers, scheduling_section
from poolkeeper.config.endpointpicker.scraping_section import scraping_section
from poolkeeper.config.endpointpicker.translation_work import TranslationWork, duration_ms
from poolkeeper.errors import ConfigError


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


def translate(
    config: EndpointPickerConfig,
    *,
    feature_gates: Iterable[str] = (),
    allow_experimental: bool = False,
) -> Translation:
    """The poolkeeper settings `config` means (ConfigError listing every problem)."""
    work = TranslationWork()
    if config.api_version == DEPRECATED_API_VERSION:
        work.notices.append(
            f"DEPRECATION: apiVersion {DEPRECATED_API_VERSION}; use llm-d.ai/v1alpha1"
        )
    gates = gates_of(config, feature_gates, work)
    check_plugins(config, allow_experimental, work)
    scheduling = scheduling_section(config, work)
    scraping = scraping_section(config, work)
    admission, flow, edge = flow_sections(config, gates, work)
    detector = detector_params(config, work)
    staleness = duration_ms(detector.metrics_staleness_threshold, "metricsStalenessThreshold", work)
    if staleness:
        scraping["stalenessMs"] = staleness
    check_parsers(config, work)
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
