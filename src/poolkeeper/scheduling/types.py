"""The values the scheduler works on besides endpoints: the request and the result.

`LLMRequest` is built by the request path (the Director, the simulator's fleet, the benchmarks);
`SchedulingResult` is what the scheduler returns. The endpoint values they refer to live in
`poolkeeper.datastore.endpoint`. Hot-path values: frozen, slotted dataclasses; no pydantic here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.endpoint import EndpointState, empty_labels

_EMPTY_SCORES: Mapping[str, float] = MappingProxyType({})


# dataclasses reject unhashable defaults (a mappingproxy is one): handed out by a factory.
def _empty_scores() -> Mapping[str, float]:
    return _EMPTY_SCORES


@dataclass(frozen=True, slots=True)
class LLMRequest:
    """One inference request as the scheduler sees it."""

    request_id: str
    model: str  # the client-facing modelName
    target_model: str  # after the traffic split (base model or LoRA adapter name)
    criticality: Criticality = Criticality.STANDARD
    priority: int | None = None  # InferenceObjective priority (upstream v1.x), when one applies
    prompt: str = ""  # text used for prefix-cache hashing (chat rendered by poolkeeper.tokens)
    prompt_tokens: int = 0
    max_tokens: int | None = None
    stream: bool = False
    headers: Mapping[str, str] = field(default_factory=empty_labels, compare=False, hash=False)
    subset: frozenset[str] | None = None  # ip:port allowed by the proxy's subset hint, if any
    # This send's own identity (the Director's `id#seq` ticket key): clients choose request
    # ids, so two live sends may share one; "" where the caller's ids are unique (benches).
    send_key: str = ""

    @property
    def key(self) -> str:
        """What learners key this send's state by (the first byte and the end the Director
        reports carry the same): `send_key`, else `request_id`."""
        return self.send_key or self.request_id


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """The decision: endpoints in order of preference (primary first, then fallbacks)."""

    targets: tuple[EndpointState, ...]
    profile: str = "default"
    scores: Mapping[str, float] = field(default_factory=_empty_scores, compare=False, hash=False)

    @property
    def primary(self) -> EndpointState:
        return self.targets[0]
