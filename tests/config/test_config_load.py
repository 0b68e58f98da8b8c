"""The config package's loader: the API kinds plus GatewayConfig, composed from above."""

from __future__ import annotations

from poolkeeper.api import load as api_load
from poolkeeper.api.kinds import default_registry
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.config.load import kind_registry, load_text

DOC = "apiVersion: poolkeeper.dev/v1alpha1\nkind: GatewayConfig\nmetadata: {name: gw}\nspec: {}\n"


def test_the_config_registry_is_the_api_registry_plus_gateway_config() -> None:
    api_kinds = {(e.api_version, e.kind): e.target for e in default_registry().entries()}
    ours = {(e.api_version, e.kind): e.target for e in kind_registry().entries()}
    assert ours == api_kinds | {("poolkeeper.dev/v1alpha1", "GatewayConfig"): GatewayConfig}


def test_only_the_composed_loader_reads_a_gateway_config() -> None:
    (loaded,) = load_text(DOC).resources
    assert isinstance(loaded.obj, GatewayConfig)
    skipped = api_load.load_text(DOC)
    assert skipped.ok
    assert skipped.resources == []
    assert "(not a poolkeeper kind)" in skipped.notices[0]
