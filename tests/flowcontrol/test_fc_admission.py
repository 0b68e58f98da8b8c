"""Saturation detection and admission by criticality."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.datastore.load import STALE, saturations
from poolkeeper.errors import RequestShed
from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.flowcontrol.saturation import SaturationDetector
from poolkeeper.flowcontrol.shedding import AdmissionController, AdmissionDecision
from poolkeeper.scheduling.types import LLMRequest

NOW = 50.0
CRIT, STD, SHED = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE


def ep(
    i: int, waiting: int = 0, kv: float = 0.0, age: float = 0.05, unseen: int = 0
) -> EndpointState:
    updated = 0.0 if age == float("inf") else NOW - age
    return EndpointState(
        Endpoint(f"p{i}", f"10.3.0.{i}", 8000),
        EndpointMetrics(waiting=waiting, kv_cache_usage=kv, updated_at=updated),
        inflight_requests=unseen,
        unseen_requests=unseen,
    )


def req(criticality: Criticality) -> LLMRequest:
    return LLMRequest("rid-1", "chat", "chat", criticality=criticality)


IDLE = [ep(1), ep(2, waiting=1, kv=0.1)]
SATURATED = [ep(1, waiting=6, kv=0.5), ep(2, waiting=2, kv=0.85)]  # (1.2 + 1.0625) / 2
OVERLOADED = [ep(1, waiting=45), ep(2, waiting=41)]  # (9.0 + 8.2) / 2 = 8.6
HALF_STALE = [ep(1, age=0.5), ep(2)]  # (1.0 + 0.0) / 2 = 0.5
STALE_BUSY = [ep(1, age=0.5), ep(2, waiting=5)]  # (1.0 + 1.0) / 2 = 1.0
ALL_STALE = [ep(1, age=0.5), ep(2, age=float("inf"))]


@pytest.mark.parametrize(
    ("pool", "want"),
    [
        (IDLE, (0.0 + 0.2) / 2),
        (SATURATED, (1.2 + 0.85 / 0.8) / 2),
        (OVERLOADED, 8.6),
        (HALF_STALE, 0.5),
        (STALE_BUSY, 1.0),
        (ALL_STALE, 1.0),
        ([], 1.0),
        ([ep(1, waiting=3, unseen=2)], 1.0),  # unseen in-flight requests count as queued
    ],
    ids=[
        "idle", "saturated", "overloaded", "half-stale", "stale-busy", "all-stale", "empty",
        "unseen",
    ],
)  # fmt: skip
def test_saturation_average_of_per_endpoint_max(pool: list[EndpointState], want: float) -> None:
    assert SaturationDetector().saturation(pool, NOW) == pytest.approx(want)


def test_is_saturated_threshold_and_all_stale_policy() -> None:
    d = SaturationDetector()
    assert not d.is_saturated(IDLE, NOW)
    assert d.is_saturated(SATURATED, NOW)
    assert d.is_saturated(STALE_BUSY, NOW)  # exactly 1.0 counts (>=)
    assert not d.is_saturated(ALL_STALE, NOW)  # fails open by default
    assert SaturationDetector(AdmissionConfig(all_stale_policy="shed")).is_saturated(ALL_STALE, NOW)
    assert d.is_saturated(OVERLOADED, NOW, level=8.0)
    assert not d.is_saturated(SATURATED, NOW, level=8.0)


def test_stale_count_and_broken_kv_values() -> None:
    d = SaturationDetector()
    report = d.assess([ep(1, waiting=5), ep(2, age=1.0)], NOW)  # fresh at exactly 1.0, stale
    assert (report.saturation, report.endpoints, report.stale) == (1.0, 2, 1)
    assert not report.all_stale
    assert d.saturation([ep(1, kv=float("nan"))], NOW) == pytest.approx(1.25)  # unknown = full
    assert d.saturation([ep(1, kv=-3.0)], NOW) == 0.0
    values = saturations(
        [ep(1, waiting=10), ep(2, age=1.0)],
        now=NOW,
        staleness_s=d.staleness_s,
        queue_threshold=5,
        kv_threshold=0.8,
    )
    assert values == [pytest.approx(2.0), STALE]  # the one definition the detector averages


def test_custom_thresholds_and_staleness() -> None:
    cfg = AdmissionConfig.model_validate({"queueDepthThreshold": 10, "kvCacheUtilThreshold": 0.5})
    d = SaturationDetector(cfg, staleness_s=1.0)  # the gateway's scraping.stalenessMs
    assert d.saturation([ep(1, waiting=5, kv=0.25, age=0.5)], NOW) == pytest.approx(0.5)
    assert d.saturation([ep(1, kv=0.6)], NOW) == pytest.approx(1.2)
    # With the default 200 ms, the same half-second-old metrics are stale (saturation 1.0).
    assert SaturationDetector(cfg).saturation([ep(1, age=0.5)], NOW) == 1.0


# (pool, criticality) -> admitted?
CASES = [
    (IDLE, CRIT, True), (IDLE, STD, True), (IDLE, SHED, True),
    (SATURATED, CRIT, True), (SATURATED, STD, True), (SATURATED, SHED, False),
    (OVERLOADED, CRIT, True), (OVERLOADED, STD, False), (OVERLOADED, SHED, False),
    (ALL_STALE, SHED, True), (ALL_STALE, STD, True),
    ([], SHED, True),  # no endpoints: not a shed; the scheduler answers 503
]  # fmt: skip


@pytest.mark.parametrize(("pool", "criticality", "admitted"), CASES)
def test_admission_by_criticality(
    pool: list[EndpointState], criticality: Criticality, admitted: bool
) -> None:
    controller = AdmissionController()
    outcome = controller.decide(req(criticality), pool, now=NOW)
    assert (outcome.decision is AdmissionDecision.ADMIT) == admitted
    if admitted:
        controller.admit(req(criticality), pool, now=NOW)
    else:
        with pytest.raises(RequestShed) as info:
            controller.admit(req(criticality), pool, now=NOW)
        assert info.value.http_status == 429
        assert "pool saturated" in info.value.message
        assert f"({criticality})" in info.value.message


def test_critical_is_never_shed_even_when_everything_is_stale_and_shed_policy() -> None:
    controller = AdmissionController(AdmissionConfig(all_stale_policy="shed"))
    controller.admit(req(CRIT), ALL_STALE, now=NOW)
    controller.admit(req(CRIT), [ep(1, waiting=1000, kv=1.0)], now=NOW)
    with pytest.raises(RequestShed, match="metrics of all 2 endpoints are stale"):
        controller.admit(req(SHED), ALL_STALE, now=NOW)


def test_standard_is_never_shed_when_overload_level_is_null() -> None:
    controller = AdmissionController(AdmissionConfig(standard_overload_level=None))
    huge = [ep(1, waiting=10_000)]
    controller.admit(req(STD), huge, now=NOW)
    with pytest.raises(RequestShed):
        controller.admit(req(SHED), huge, now=NOW)


def test_shed_levels_per_criticality() -> None:
    c = AdmissionController(AdmissionConfig(sheddable_saturation_level=0.5))
    assert c.shed_level(CRIT) is None
    assert c.shed_level(STD) == 8.0
    assert c.shed_level(SHED) == 0.5
    c.admit(req(STD), HALF_STALE, now=NOW)
    with pytest.raises(RequestShed, match=r"saturation 0.50 >= 0.5"):
        c.admit(req(SHED), HALF_STALE, now=NOW)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"queueDepthThreshold": 0}, "queueDepthThreshold"),
        ({"kvCacheUtilThreshold": 1.5}, "kvCacheUtilThreshold"),
        ({"standardOverloadLevel": 0.5}, "must be >= sheddableSaturationLevel"),
        ({"allStalePolicy": "maybe"}, "allStalePolicy"),
        ({"queueDepth": 5}, "Extra inputs are not permitted"),
        ({"metricsStalenessMs": 500}, "moved to spec.scraping.stalenessMs"),
    ],
)  # fmt: skip
def test_admission_config_validation(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AdmissionConfig.model_validate(doc)


def test_admission_config_defaults_and_aliases() -> None:
    dumped = AdmissionConfig().model_dump(by_alias=True)
    assert dumped == {
        "queueDepthThreshold": 5,
        "kvCacheUtilThreshold": 0.8,
        "sheddableSaturationLevel": 1.0,
        "standardOverloadLevel": 8.0,
        "countUnseen": True,
        "allStalePolicy": "admit",
    }
    for name, field in AdmissionConfig.model_fields.items():
        assert field.description, name
