"""llm-d's role filters (`llm-d.ai/role` label) and the conformance test filter.

decode-filter    keeps endpoints whose role can decode; endpoints without the label are kept
prefill-filter   keeps endpoints whose role can prefill (the label is required)
encode-filter    keeps endpoints whose role can encode (the label is required)
header-based-testing-filter
                 keeps exactly the endpoints the `test-epp-endpoint-selection` request header
                 lists (`ip` or `ip:port`, comma-separated, in that order); no header, no
                 endpoints. Upstream's gateway conformance suite steers picks with it; it is
                 only ever in a profile an operator configured for that.

Unlike the load filters these do not fail open: an empty result is the answer (upstream's 429
`rejected-saturated` when filters leave nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import CycleState, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.types import LLMRequest

ROLE_LABEL: Final = "llm-d.ai/role"
TEST_SELECTION_HEADER: Final = "test-epp-endpoint-selection"

_DECODE: Final = frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"})
_PREFILL: Final = frozenset(
    {"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"}
)
_ENCODE: Final = frozenset({"encode", "encode-prefill", "encode-prefill-decode"})


class _RoleFilter(NamedPlugin):
    __slots__ = ()
    roles: frozenset[str] = frozenset()
    unlabelled: bool = False

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        kept = []
        for state in candidates:
            role = state.endpoint.labels.get(ROLE_LABEL)
            if (role is None and self.unlabelled) or (role is not None and role in self.roles):
                kept.append(state)
        return kept


class DecodeFilter(_RoleFilter):
    __slots__ = ()
    roles = _DECODE
    unlabelled = True


class PrefillFilter(_RoleFilter):
    __slots__ = ()
    roles = _PREFILL


class EncodeFilter(_RoleFilter):
    __slots__ = ()
    roles = _ENCODE


def _host(entry: str) -> tuple[str, str | None]:
    """(ip, port or None) of `ip`, `ip:port`, `[v6]`, `[v6]:port` or a bare IPv6 address."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, port
    return entry, None


def selected_endpoints(value: str, candidates: Sequence[EndpointState]) -> list[EndpointState]:
    """The candidates `test-epp-endpoint-selection: value` names, in its order, once each."""
    out: list[EndpointState] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        host, port = _host(entry)
        for state in candidates:
            endpoint = state.endpoint
            matches = endpoint.address == host and (port is None or str(endpoint.port) == port)
            if matches and state not in out:
                out.append(state)
    return out


class HeaderBasedTestingFilter(NamedPlugin):
    __slots__ = ()

    def __init__(self, typed_name: TypedName) -> None:
        super().__init__(typed_name)

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        return selected_endpoints(request.headers.get(TEST_SELECTION_HEADER, ""), candidates)
