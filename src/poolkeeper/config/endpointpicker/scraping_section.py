"""The `scraping` section an EndpointPickerConfig means: its data layer's sources and extractors.

`metrics-data-source` gives the scheme, path, TLS verification and interval;
`core-metrics-extractor` the default engine and its label. What poolkeeper does not implement
(file discovery, client certificates, custom engine metrics) is a problem, not a silent skip.
"""

from __future__ import annotations

from typing import Any

from poolkeeper.config.endpointpicker.catalogue import (
    CoreMetricsExtractorParams,
    MetricsSourceParams,
)
from poolkeeper.config.endpointpicker.document import EndpointPickerConfig
from poolkeeper.config.endpointpicker.translation_work import TranslationWork, duration_ms


def scraping_section(config: EndpointPickerConfig, work: TranslationWork) -> dict[str, Any]:
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
                interval = duration_ms(params.interval, f"{name}.parameters.interval", work)
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
