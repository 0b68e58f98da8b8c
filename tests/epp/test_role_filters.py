"""llm-d's role filters and the conformance test filter (scheduling/plugins/role_filters.py)."""

from __future__ import annotations

from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.scheduling.interfaces import CycleState, TypedName
from poolkeeper.scheduling.plugins.role_filters import (
    DecodeFilter,
    HeaderBasedTestingFilter,
    PrefillFilter,
)
from poolkeeper.scheduling.types import LLMRequest


def _state(name: str, address: str, port: int, role: str | None = None) -> EndpointState:
    labels = {"llm-d.ai/role": role} if role else {}
    return EndpointState(Endpoint(name, address, port, labels=labels), EndpointMetrics())


PODS = [
    _state("d", "10.0.0.1", 8000, "decode"),
    _state("p", "10.0.0.2", 8000, "prefill"),
    _state("b", "10.0.0.3", 8000, "both"),
    _state("u", "10.0.0.4", 8000),
    _state("u2", "10.0.0.4", 8001),
]


def _names(kept: object) -> list[str]:
    assert isinstance(kept, list)
    return [s.endpoint.name for s in kept]


def test_role_filters() -> None:
    request = LLMRequest("r", "m", "m")
    decode = DecodeFilter(TypedName("decode-filter", "decode-filter"))
    prefill = PrefillFilter(TypedName("prefill-filter", "prefill-filter"))
    assert _names(decode.filter(CycleState(0.0), request, PODS)) == ["d", "b", "u", "u2"]
    assert _names(prefill.filter(CycleState(0.0), request, PODS)) == ["p", "b"]


def test_the_test_selection_header_picks_in_its_order() -> None:
    plugin = HeaderBasedTestingFilter(TypedName("header-based-testing-filter", "t"))

    def pick(value: str | None) -> list[str]:
        headers = {} if value is None else {"test-epp-endpoint-selection": value}
        request = LLMRequest("r", "m", "m", headers=headers)
        return _names(plugin.filter(CycleState(0.0), request, PODS))

    assert pick("10.0.0.3, 10.0.0.1:8000,10.0.0.3") == ["b", "d"]
    assert pick("10.0.0.4:8001") == ["u2"]
    assert pick("10.0.0.4") == ["u", "u2"]
    assert pick("10.9.9.9") == []
    assert pick(None) == []  # no header: no endpoints (upstream's 429)
