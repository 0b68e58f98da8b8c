"""One list of engines: every place that names an engine agrees with the registry.

The places: the scrapers (`mapping_for`), `spec.endpoints[].engine` (its schema and its
validation), `spec.scraping.defaultEngine`, the engine-type endpoint label, the engine modules
of `poolkeeper.backend.engines`, and the engine table of docs/configuration.md.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import poolkeeper.backend.engines as engines_package
from poolkeeper.backend.config import ENGINE_TYPE_LABEL, ScrapingConfig
from poolkeeper.backend.engines import (
    BUILTIN_MAPPINGS,
    ENGINE_ALIASES,
    Engine,
    EngineType,
    known_engines,
    mapping_for,
    resolve_engine,
)
from poolkeeper.config.docs import engines_markdown
from poolkeeper.config.gateway import GatewayConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SPELLINGS = [
    (spelling, engine)
    for engine in Engine
    for name in (engine.value, *engine.definition.aliases)
    for spelling in (name, name.upper(), f" {name} ")
]


def _endpoint_engine(name: str) -> Any:
    config = GatewayConfig.model_validate(
        {"spec": {"endpoints": [{"name": "a", "address": "10.0.0.1", "engine": name}]}}
    )
    return config.spec.endpoints[0].engine


@pytest.mark.parametrize(("spelling", "engine"), SPELLINGS, ids=[s for s, _ in SPELLINGS])
def test_every_place_resolves_every_spelling_to_the_same_engine(
    spelling: str, engine: Engine
) -> None:
    scraping = ScrapingConfig(default_engine=spelling)
    assert resolve_engine(spelling) is engine
    assert mapping_for(spelling) is engine.mapping
    assert scraping.default_engine == engine.value
    assert ScrapingConfig().engine_for({ENGINE_TYPE_LABEL: spelling}) == engine.value
    assert ScrapingConfig().engine_for({}, explicit=spelling) == engine.value
    assert _endpoint_engine(spelling) is engine


@pytest.mark.parametrize("name", ["tgi", "", "vllm-router", "trt"])
def test_every_place_rejects_an_unknown_engine(name: str) -> None:
    with pytest.raises(ValueError, match="unknown engine type"):
        resolve_engine(name)
    with pytest.raises(ValidationError, match="unknown engine type"):
        ScrapingConfig(default_engine=name)
    with pytest.raises(ValueError, match="unknown engine type"):
        ScrapingConfig().engine_for({ENGINE_TYPE_LABEL: name or "?"})
    with pytest.raises(ValidationError):
        _endpoint_engine(name)


def test_the_config_schema_lists_exactly_the_registry() -> None:
    schema = GatewayConfig.model_json_schema()
    assert schema["$defs"]["Engine"]["enum"] == [engine.value for engine in Engine]
    assert list(BUILTIN_MAPPINGS) == [engine.value for engine in Engine]
    assert set(ENGINE_ALIASES.values()) <= set(BUILTIN_MAPPINGS)
    assert len(known_engines()) == len(set(known_engines()))  # no alias shadows a name


def test_every_engine_module_is_registered() -> None:
    declared: set[str] = set()
    for info in pkgutil.iter_modules(engines_package.__path__):
        module = importlib.import_module(f"{engines_package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, EngineType) and value.__class__ is EngineType:
                declared.add(value.name)
    assert declared == {engine.value for engine in Engine}
    assert all(engine.definition.mapping.name == engine.value for engine in Engine)


def test_the_docs_engine_table_is_current() -> None:
    assert engines_markdown() in DOC.read_text(encoding="utf-8"), (
        "docs/configuration.md is out of date: run "
        "`.venv/bin/python -m poolkeeper.config.docs docs/configuration.md`"
    )


def test_an_engine_type_keeps_its_names_consistent() -> None:
    mapping = Engine.VLLM.mapping
    with pytest.raises(ValueError, match="has the mapping of"):
        EngineType(name="other", title="Other", mapping=mapping)
    with pytest.raises(ValueError, match="aliases must be lower case"):
        EngineType(name="vllm", title="vLLM", mapping=mapping, aliases=("VLLM2",))
