"""The registry of kinds poolkeeper understands, keyed by (apiVersion, kind).

Entries name either a class or a lazily imported "module:Class" path, so that the API package
does not import the config package (GatewayConfig lives there and may be absent or broken; the
loader then treats it as an unknown kind and says why).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel

from poolkeeper.api import model, objective, pool, rewrite

GATEWAY_CONFIG_API_VERSION = "poolkeeper.dev/v1alpha1"
GATEWAY_CONFIG_KIND = "GatewayConfig"
GATEWAY_CONFIG_TARGET = "poolkeeper.config.gateway:GatewayConfig"
# llm-d-router's EndpointPickerConfig (both groups), translated into a GatewayConfig.
EPP_CONFIG_KIND = "EndpointPickerConfig"
EPP_CONFIG_API_VERSIONS = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
EPP_CONFIG_TARGET = "poolkeeper.config.endpointpicker.checked:CheckedEndpointPickerConfig"


@dataclass(frozen=True, slots=True)
class KindEntry:
    """One (apiVersion, kind) and the pydantic model that validates it."""

    api_version: str
    kind: str
    target: type[BaseModel] | str

    def resolve(self) -> type[BaseModel]:
        """The model class; raises ImportError (with the reason) when a lazy target is missing."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
            cls = getattr(module, attr)
        except ImportError:
            raise
        except Exception as exc:  # a broken module must not crash loading: report it instead
            raise ImportError(f"{self.target}: {type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            raise ImportError(f"{self.target} is not a pydantic model")
        return cls


class KindRegistry:
    """Lookup of kinds; build one with `default_registry()` (no shared global instance)."""

    def __init__(self, entries: Iterable[KindEntry]) -> None:
        self._entries = {(e.api_version, e.kind): e for e in entries}

    def lookup(self, api_version: str, kind: str) -> KindEntry | None:
        return self._entries.get((api_version, kind))

    def api_versions_of(self, kind: str) -> list[str]:
        """Every apiVersion registered for `kind` (to explain an unsupported version)."""
        return [v for (v, k) in self._entries if k == kind]

    def entries(self) -> list[KindEntry]:
        return list(self._entries.values())


def default_registry() -> KindRegistry:
    """InferenceModel (v1alpha1, v1alpha2), InferencePool (v1alpha1-v1), InferenceObjective and
    InferenceModelRewrite (v1alpha2), GatewayConfig."""
    return KindRegistry(
        [
            KindEntry(model.V1ALPHA1, model.KIND, model.InferenceModel),
            KindEntry(model.V1ALPHA2, model.KIND, model.InferenceModel),
            KindEntry(pool.V1ALPHA1, pool.KIND, pool.InferencePoolV1Alpha1),
            KindEntry(pool.V1ALPHA2, pool.KIND, pool.InferencePool),
            KindEntry(pool.V1, pool.KIND, pool.InferencePoolV1),
            KindEntry(objective.V1ALPHA2, objective.KIND, objective.InferenceObjective),
            KindEntry(rewrite.V1ALPHA2, rewrite.KIND, rewrite.InferenceModelRewrite),
            KindEntry(GATEWAY_CONFIG_API_VERSION, GATEWAY_CONFIG_KIND, GATEWAY_CONFIG_TARGET),
            *(KindEntry(v, EPP_CONFIG_KIND, EPP_CONFIG_TARGET) for v in EPP_CONFIG_API_VERSIONS),
        ]
    )
