"""What every InferencePool version shares: the label and port field types, the selector-key
rule (its CEL text for the CRDs and the same check in Python), `selector_matches`, the
endpoint picker a pool names (`EndpointPickerTarget`, `BUILT_IN_EPP`), status conditions and
the parent reference. The versions' specs are `pool_specs`; the pools themselves `pool`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Final, Literal

from pydantic import Field, StrictInt, StrictStr, field_validator

from poolkeeper.api.fielderrors import go_value, rule_error
from poolkeeper.api.meta import ApiModel, Condition, duplicate_condition_issues
from poolkeeper.api.model import GROUP_PATTERN, KIND_PATTERN

FailureMode = Literal["FailOpen", "FailClose"]
AppProtocol = Literal["http", "kubernetes.io/h2c"]

LABEL_KEY_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)
LABEL_KEY_MAX: Final = 253
LABEL_VALUE_PATTERN: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
MAX_SELECTOR_LABELS: Final = 64
MAX_TARGET_PORTS: Final = 8

SELECTOR_KEY_MESSAGE: Final = (
    "selector keys must be valid label keys: an optional DNS subdomain prefix and '/', then a "
    "name of at most 63 characters (alphanumeric, '-', '_' or '.', alphanumeric at both ends), "
    f"at most {LABEL_KEY_MAX} characters in all"
)
PORTS_UNIQUE_RULE: Final = "self.all(p1, self.exists_one(p2, p1.number == p2.number))"
PORTS_UNIQUE_MESSAGE: Final = "port number must be unique"
EPP_PORT_RULE: Final = "self.kind != 'Service' || has(self.port)"
EPP_PORT_MESSAGE: Final = (
    "port is required when kind is 'Service' or unspecified (defaults to 'Service')"
)

_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)


def cel_string(value: str) -> str:
    """A CEL single-quoted string literal for `value` (regexes need their backslashes kept)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


SELECTOR_KEY_RULE: Final = (
    f"self.all(key, size(key) <= {LABEL_KEY_MAX} && key.matches({cel_string(LABEL_KEY_PATTERN)}))"
)

LabelValue = Annotated[StrictStr, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
PortNumber = Annotated[StrictInt, Field(ge=1, le=65535, json_schema_extra={"format": "int32"})]
Group = Annotated[StrictStr, Field(max_length=253, pattern=GROUP_PATTERN)]
Kind = Annotated[StrictStr, Field(min_length=1, max_length=63, pattern=KIND_PATTERN)]
ObjectName = Annotated[StrictStr, Field(min_length=1, max_length=253)]

SELECTOR_EXTRA = {
    "x-kubernetes-validations": [{"rule": SELECTOR_KEY_RULE, "message": SELECTOR_KEY_MESSAGE}]
}


def selector_key_issues(selector: Mapping[str, str]) -> list[tuple[str, str]]:
    return [
        ("", f"Invalid value: {go_value(key)}: {SELECTOR_KEY_MESSAGE}")
        for key in selector
        if len(key) > LABEL_KEY_MAX or not _LABEL_KEY.match(key)
    ]


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Equality-based label selection; an empty selector selects everything."""
    return all(labels.get(key) == value for key, value in selector.items())


@dataclass(frozen=True, slots=True)
class EndpointPickerTarget:
    """Where the pool's endpoint picker runs, whichever API version described it."""

    group: str
    kind: str
    name: str
    port: int | None
    failure_mode: str


# A v1 pool without `endpointPickerRef` (allowed since upstream v1.6): poolkeeper's managed
# gateway always routes through its own EPP, so such a pool is picked for by that EPP, and the
# gateway fails closed (the API's default failure mode) when the EPP cannot answer.
BUILT_IN_EPP: Final = EndpointPickerTarget("", "", "", None, "FailClose")


class StatusConditions(ApiModel):
    conditions: Annotated[
        list[Condition],
        Field(
            max_length=8,
            json_schema_extra={
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        ),
    ] = Field(default_factory=list)

    @field_validator("conditions")
    @classmethod
    def _unique_types(cls, value: list[Condition]) -> list[Condition]:
        issues = duplicate_condition_issues(value)
        if issues:
            raise rule_error(*issues)
        return value


class ParentReference(ApiModel):
    """The Gateway (or other parent) a pool status entry is about."""

    group: Group = "gateway.networking.k8s.io"
    kind: Kind = "Gateway"
    name: ObjectName
    namespace: Annotated[StrictStr, Field(min_length=1, max_length=63)] | None = None
