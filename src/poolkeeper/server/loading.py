"""Loading what `serve` runs from files: pools, models and the one GatewayConfig.

All problems of all files are reported together as one ConfigError (file, object, field path
each), before anything starts listening.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from poolkeeper.api.load import LoadResult, load_paths
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LoadedGateway:
    pools: list[AnyInferencePool]
    models: list[InferenceModel]
    config: GatewayConfig
    notices: list[str]


def load_gateway(paths: Sequence[str | Path]) -> LoadedGateway:
    """Pools, models and the GatewayConfig (default when none is given) from files or dirs."""
    if not paths:
        raise ConfigError("no files given: pass -f PATH (files or directories of YAML)")
    result: LoadResult = load_paths(paths)
    errors = [str(e) for e in result.errors]
    configs = result.objects_of(GatewayConfig)
    if len(configs) > 1:
        errors.append(f"{len(configs)} GatewayConfig documents given; at most one is allowed")
    pools = result.pools()
    if not pools and not errors:
        errors.append("no InferencePool found in the given files")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    config = configs[0] if configs else GatewayConfig.default()
    return LoadedGateway(pools, result.models(), config, list(result.notices))
