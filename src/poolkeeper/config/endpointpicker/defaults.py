"""Upstream's configuration when neither --config-file nor --config-text is given
(llm-d-router `pkg/epp/config/loader/defaults.go`, reference/llm-d-router.md §2.3)."""

from __future__ import annotations

from typing import Final

DEFAULT_CONFIG_TEXT: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: []
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors:
    - pluginRef: core-metrics-extractor
"""
