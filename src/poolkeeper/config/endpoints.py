"""`spec.endpoints[]`: the model servers of standalone mode, standing in for Pods.

The document's own section: no package below reads it; the file source's reader
(`controller/resource_files.py`) turns each entry into a datastore endpoint, its engine
resolved by the engine registry (`poolkeeper.backend.engines`).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from poolkeeper.api.fielderrors import checked, go_value, rule_error
from poolkeeper.api.meta import label_key_errors
from poolkeeper.api.names import dns1123_subdomain_errors, host_errors, label_value_errors
from poolkeeper.backend.engines import Engine
from poolkeeper.schema import CamelModel, Port

__all__ = ["StaticEndpoint"]


class StaticEndpoint(CamelModel, use_attribute_docstrings=True):
    """One model server, standing in for a pod in standalone mode."""

    name: str
    """Unique name (like a pod name: lower-case alphanumerics, '-' and '.')."""
    address: str
    """IPv4 or IPv6 address, or hostname. Envoy's original-destination cluster needs an IP, so
    prefer IPs when Envoy carries the traffic."""
    port: Port | None = None
    """Serving port; when unset, the target port of the pool that selects this endpoint."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels that InferencePool selectors match (Kubernetes label rules)."""
    engine: Engine | None = None
    """Engine of the server (a name or alias from the engine table); unset means the scraping
    section's default engine."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return checked(value, dns1123_subdomain_errors(value))

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return checked(value, host_errors(value, ipv6=True))

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        issues = [
            ("", f"Invalid value: {go_value(text)}: {msg}")
            for key, label in value.items()
            for text, msg in [(key, m) for m in label_key_errors(key)]
            + [(label, m) for m in label_value_errors(label)]
        ]
        if issues:
            raise rule_error(*issues)
        return value
