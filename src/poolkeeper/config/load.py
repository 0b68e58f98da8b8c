"""Loading poolkeeper's files: the API kinds and the gateway's configuration (GatewayConfig or
an EndpointPickerConfig), through one kind registry.

`poolkeeper.api.load` knows the API kinds only; this module composes its registry with the
GatewayConfig document, so the API package never imports the config package. Everything that
reads the files a gateway runs from (`controller/resource_files.py`, `poolkeeper validate`)
loads here.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from poolkeeper.api import load as api_load
from poolkeeper.api.kinds import KindEntry, KindRegistry, default_registry
from poolkeeper.api.load_results import LoadResult
from poolkeeper.config.endpointpicker import document as epp_document
from poolkeeper.config.endpointpicker.checked import CheckedEndpointPickerConfig
from poolkeeper.config.gateway import API_VERSION, KIND, GatewayConfig

__all__ = ["kind_registry", "load_paths", "load_text"]


def kind_registry() -> KindRegistry:
    """The API kinds plus `poolkeeper.dev/v1alpha1` GatewayConfig and llm-d-router's
    EndpointPickerConfig (both groups), which is translated into a GatewayConfig."""
    return default_registry().with_entries(
        KindEntry(API_VERSION, KIND, GatewayConfig),
        *(
            KindEntry(version, epp_document.KIND, CheckedEndpointPickerConfig)
            for version in epp_document.API_VERSIONS
        ),
    )


def load_paths(paths: Iterable[str | Path]) -> LoadResult:
    """`poolkeeper.api.load.load_paths` with the GatewayConfig registered."""
    return api_load.load_paths(paths, registry=kind_registry())


def load_text(text: str, source: str = "<input>", *, json_format: bool = False) -> LoadResult:
    """`poolkeeper.api.load.load_text` with the GatewayConfig registered."""
    return api_load.load_text(text, source, json_format=json_format, registry=kind_registry())
