"""llm-d-router's `EndpointPickerConfig` (llm-d.ai/v1alpha1, and the deprecated
inference.networking.x-k8s.io/v1alpha1), read as strictly as upstream reads it and translated
into poolkeeper's own settings (a GatewayConfig).

    document.py    the document's shape: top-level keys, profiles, flow control, data layer
    catalogue.py   every upstream plugin type: what poolkeeper does with it, its parameters
    translate.py   EndpointPickerConfig -> GatewayConfig (+ notices), upstream's system defaults;
                   its steps: plugin_checks.py (feature gates, plugins), scheduling_section.py,
                   scraping_section.py, flow_sections.py (admission, flowControl, edge),
                   replicasync.py, over translation_work.py (problems, notices, lookups)
    defaults.py    upstream's default configuration (used when none is given)

A plugin type poolkeeper does not implement is an error naming it and the implemented
alternatives, never a silent skip; docs/kubernetes.md lists what is honoured.
"""

from poolkeeper.config.endpointpicker.defaults import DEFAULT_CONFIG_TEXT
from poolkeeper.config.endpointpicker.document import API_VERSIONS, KIND, EndpointPickerConfig
from poolkeeper.config.endpointpicker.translate import (
    Translation,
    load_endpoint_picker_config,
    translate,
)

__all__ = [
    "API_VERSIONS",
    "DEFAULT_CONFIG_TEXT",
    "KIND",
    "EndpointPickerConfig",
    "Translation",
    "load_endpoint_picker_config",
    "translate",
]
