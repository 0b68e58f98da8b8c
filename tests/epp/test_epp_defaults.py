"""Upstream's request-handling defaults (llm-d-router): the control headers are read by
default in both spellings, the llm-d one winning; `trustedHeaders: []` turns them off."""

from __future__ import annotations

from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.config.gateway import RequestHandling, TrustedHeader, UnknownModelPolicy
from tests.requestcontrol.test_rc_director import _chat, _rig, _store
from tests.requestcontrol.test_rc_director_objectives import RESOURCES, headers


def _default_rig() -> Any:
    return _rig(_store(models=RESOURCES), RequestHandling())


def test_every_spelling_is_trusted_by_default() -> None:
    assert set(RequestHandling().trusted_headers) == set(TrustedHeader)
    assert TrustedHeader.LLMD_INFERENCE_OBJECTIVE.spellings() == (
        TrustedHeader.LLMD_INFERENCE_OBJECTIVE,
        TrustedHeader.INFERENCE_OBJECTIVE,
    )
    assert TrustedHeader.FAIRNESS_ID.spellings()[0] is TrustedHeader.LLMD_FAIRNESS_ID


async def test_llm_d_objective_header_is_read_by_default() -> None:
    r = _default_rig()
    decision = await r.director.route(
        _chat("chat", headers=headers(x_llm_d_inference_objective="gold"))
    )
    assert (decision.criticality, decision.priority) == (Criticality.CRITICAL, 10)


async def test_gie_spelling_still_works_and_llm_d_wins() -> None:
    r = _default_rig()
    decision = await r.director.route(
        _chat("chat", headers=headers(x_gateway_inference_objective="batch"))
    )
    assert decision.priority == -1
    both = headers(x_gateway_inference_objective="batch", x_llm_d_inference_objective="gold")
    decision = await r.director.route(_chat("chat", headers=both))
    assert decision.priority == 10


async def test_llm_d_rewrite_header_names_the_target() -> None:
    r = _default_rig()
    decision = await r.director.route(
        _chat("chat", headers=headers(x_llm_d_model_name_rewrite="chat-v2"))
    )
    assert decision.target_model == "chat-v2"


def _v1_store() -> Any:
    from poolkeeper.api.pool import InferencePoolV1
    from poolkeeper.datastore.endpoint import EndpointMetrics
    from poolkeeper.datastore.snapshot import EndpointSpec
    from poolkeeper.datastore.store import Datastore

    pool = InferencePoolV1.model_validate(
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "pool"},
            "spec": {
                "selector": {"matchLabels": {"app": "sim"}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
            },
        }
    )
    store = Datastore()
    batch = InferenceObjective.model_validate(
        {
            "metadata": {"name": "batch"},
            "spec": {"priority": -1, "poolRef": {"name": "pool"}},  # group: k8s.io (default)
        }
    )
    store.set_resources([pool], [batch])  # no model is named
    store.set_endpoints([EndpointSpec("sim-1", "10.0.0.1", labels={"app": "sim"})])
    store.update_metrics("10.0.0.1:8000", EndpointMetrics(updated_at=1.0))
    return store


async def test_a_v1_pool_serves_any_model_at_priority_0_and_objectives_set_priority() -> None:
    r = _rig(_v1_store(), RequestHandling())
    decision = await r.director.route(_chat("any-model-at-all"))
    assert (decision.criticality, decision.priority) == (Criticality.STANDARD, 0)
    assert decision.target_model == "any-model-at-all"
    decision = await r.director.route(
        _chat("any-model-at-all", headers=headers(x_llm_d_inference_objective="batch"))
    )
    assert (decision.criticality, decision.priority) == (Criticality.SHEDDABLE, -1)


async def test_an_x_k8s_pool_still_refuses_unknown_models() -> None:
    import pytest

    from poolkeeper.errors import ModelNotFound

    r = _default_rig()
    with pytest.raises(ModelNotFound):
        await r.director.route(_chat("any-model-at-all"))
    r = _rig(_v1_store(), RequestHandling(unknown_model_policy=UnknownModelPolicy.REJECT))
    with pytest.raises(ModelNotFound):
        await r.director.route(_chat("any-model-at-all"))


def test_error_replies_carry_upstreams_dropped_reason() -> None:
    from poolkeeper.errors import NoReadyEndpoint, QueueFull, QueueTimeout, RequestShed
    from poolkeeper.extproc.messages import error_reply

    def reply(error: Exception) -> tuple[int, dict[str, str]]:
        assert isinstance(error, RequestShed | NoReadyEndpoint)
        immediate = error_reply(error).immediate_response
        headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
        return immediate.status.code, headers

    status, headers = reply(QueueTimeout("waited"))
    assert (status, headers["x-llm-d-request-dropped-reason"]) == (429, "rejected-ttl-expired")
    status, headers = reply(QueueFull("full"))
    assert (status, headers["x-llm-d-request-dropped-reason"]) == (429, "rejected-saturated")
    status, headers = reply(NoReadyEndpoint("none"))
    assert (status, headers["x-llm-d-request-dropped-reason"]) == (503, "rejected-no-endpoints")
    status, headers = reply(RequestShed("legacy admission"))  # upstream sends no header here
    assert status == 429
    assert "x-llm-d-request-dropped-reason" not in headers


def test_serve_kubernetes_sends_one_endpoint_unless_configured() -> None:
    from poolkeeper.cli.serve_setup import one_endpoint_unless_set
    from poolkeeper.config.gateway import GatewayConfig

    assert one_endpoint_unless_set(None).spec.request_handling.fallback_endpoints == 0
    kept = GatewayConfig.model_validate(
        {"spec": {"requestHandling": {"fallbackEndpoints": 2}, "listeners": {"extProc": 9100}}}
    )
    assert one_endpoint_unless_set(kept).spec.request_handling.fallback_endpoints == 2
    other = GatewayConfig.model_validate({"spec": {"listeners": {"extProc": 9100}}})
    changed = one_endpoint_unless_set(other)
    assert changed.spec.request_handling.fallback_endpoints == 0
    assert changed.spec.listeners.ext_proc == 9100
    # serve with its own Envoy (and --no-envoy) keeps 3: that Envoy retries on the list.
    assert GatewayConfig.default().spec.request_handling.fallback_endpoints == 3
