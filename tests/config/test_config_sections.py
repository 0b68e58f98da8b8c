"""The GatewayConfig only gathers: each section is declared by the package that reads it."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from poolkeeper.config.gateway import GatewayConfigSpec


def _section(name: str) -> type[BaseModel]:
    annotation = GatewayConfigSpec.model_fields[name].annotation
    args = getattr(annotation, "__args__", ())
    model = args[0] if args else annotation  # list[StaticEndpoint] -> StaticEndpoint
    assert isinstance(model, type)
    assert issubclass(model, BaseModel)
    return model


@pytest.mark.parametrize("field", list(GatewayConfigSpec.model_fields))
def test_sections_are_declared_by_their_packages(field: str) -> None:
    module = _section(field).__module__
    # Only `spec.endpoints[]` is the document's own (its reader, the file source, sits above).
    assert module.startswith("poolkeeper.config.") == (field == "endpoints"), module


def test_listeners_and_edge_belong_to_envoy_and_request_handling_to_the_director() -> None:
    assert _section("listeners").__module__ == "poolkeeper.envoy.config"
    assert _section("edge").__module__ == "poolkeeper.envoy.config"
    assert _section("request_handling").__module__ == "poolkeeper.requestcontrol.config"
