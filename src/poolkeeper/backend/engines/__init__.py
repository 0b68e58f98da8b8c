"""Model-server engines: one module per engine (how its metrics page is read) and the registry.

`registry.Engine` is the one list every place that names an engine derives from; `mapping.py`
holds the machinery the engine modules fill in (`EngineMapping`, `MetricSpec`).
"""

from poolkeeper.backend.engines.mapping import (
    EngineMapping,
    EngineType,
    IntField,
    MetricSpec,
    MissingMetrics,
)
from poolkeeper.backend.engines.registry import (
    BUILTIN_MAPPINGS,
    ENGINE_ALIASES,
    Engine,
    known_engines,
    mapping_for,
    names_responses_itself,
    resolve_engine,
)

__all__ = [
    "BUILTIN_MAPPINGS",
    "ENGINE_ALIASES",
    "Engine",
    "EngineMapping",
    "EngineType",
    "IntField",
    "MetricSpec",
    "MissingMetrics",
    "known_engines",
    "mapping_for",
    "names_responses_itself",
    "resolve_engine",
]
