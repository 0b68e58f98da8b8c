"""The Director with upstream v1.x resources (upstream `pkg/epp/requestcontrol/director_test.go`,
v1.5.0): InferenceObjective priority through the trusted `x-gateway-inference-objective` header,
InferenceModelRewrite splits, the `x-gateway-model-name-rewrite` header, and the Passthrough
policy. Client headers change nothing unless the GatewayConfig trusts them."""

from __future__ import annotations

import collections
import json
from typing import Any

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.rewrite import InferenceModelRewrite
from poolkeeper.config.gateway import RequestHandling, TrustedHeader, UnknownModelPolicy
from poolkeeper.datastore.models import ModelResource
from poolkeeper.errors import ModelNotFound, RequestShed
from tests.requestcontrol.test_rc_director import _chat, _model, _rig, _store

OBJECTIVE = TrustedHeader.INFERENCE_OBJECTIVE
REWRITE = TrustedHeader.MODEL_NAME_REWRITE


def objective(name: str, priority: int | None) -> InferenceObjective:
    spec: dict[str, Any] = {"poolRef": {"name": "pool", "group": "inference.networking.x-k8s.io"}}
    if priority is not None:
        spec["priority"] = priority
    return InferenceObjective.model_validate({"metadata": {"name": name}, "spec": spec})


def rewrite(*rules: dict[str, Any]) -> InferenceModelRewrite:
    return InferenceModelRewrite.model_validate(
        {
            "metadata": {"name": "canary", "creationTimestamp": "2025-01-01T00:00:00Z"},
            "spec": {
                "poolRef": {"name": "pool", "group": "inference.networking.x-k8s.io"},
                "rules": list(rules),
            },
        }
    )


SPLIT = rewrite(
    {
        "matches": [{"model": {"value": "food-review"}}],
        "targets": [
            {"modelRewrite": "food-review-v1", "weight": 90},
            {"modelRewrite": "food-review-v2", "weight": 10},
        ],
    }
)
RESOURCES: tuple[ModelResource, ...] = (
    _model("chat", criticality="Sheddable"),
    objective("gold", 10),
    objective("batch", -1),
    objective("default-priority", None),
    SPLIT,
)


def rig(*trusted: TrustedHeader, waiting: int = 0, **handling: Any) -> Any:
    config = RequestHandling(trusted_headers=list(trusted), **handling)
    return _rig(_store(models=RESOURCES, waiting=waiting), config)


def headers(**values: str) -> dict[str, str]:
    return {"content-type": "application/json"} | {
        k.replace("_", "-"): v for k, v in values.items()
    }


@pytest.mark.parametrize(
    ("name", "band", "priority"),
    [
        ("gold", Criticality.CRITICAL, 10),
        ("batch", Criticality.SHEDDABLE, -1),
        ("default-priority", Criticality.STANDARD, 0),
    ],
)
async def test_trusted_objective_header_sets_the_band(
    name: str, band: Criticality, priority: int
) -> None:
    r = rig(OBJECTIVE)
    decision = await r.director.route(
        _chat("chat", headers=headers(x_gateway_inference_objective=name))
    )
    assert (decision.criticality, decision.priority) == (band, priority)
    seen = r.scheduler.seen[-1][0]
    assert (seen.criticality, seen.priority) == (band, priority)
    assert "x-gateway-inference-objective" not in seen.headers  # never reaches plugins


async def test_untrusted_objective_header_is_ignored() -> None:
    r = rig()  # trustedHeaders: [] turns the headers off (the default reads them all)
    decision = await r.director.route(
        _chat("chat", headers=headers(x_gateway_inference_objective="gold"))
    )
    assert (decision.criticality, decision.priority) == (Criticality.SHEDDABLE, None)


async def test_unknown_objective_name_keeps_the_model_band() -> None:
    r = rig(OBJECTIVE)
    decision = await r.director.route(
        _chat("chat", headers=headers(x_gateway_inference_objective="nope"))
    )
    assert decision.criticality is Criticality.SHEDDABLE


async def test_objective_priority_decides_shedding() -> None:
    # Saturated pool (waiting 10 >= 5 on every endpoint): Sheddable is shed, Critical is not.
    r = rig(OBJECTIVE, waiting=10)
    with pytest.raises(RequestShed):
        await r.director.route(
            _chat("chat", headers=headers(x_gateway_inference_objective="batch"))
        )
    decision = await r.director.route(
        _chat("chat", rid="r2", headers=headers(x_gateway_inference_objective="gold"))
    )
    assert decision.criticality is Criticality.CRITICAL


async def test_rewrite_rule_splits_by_weight_and_rewrites_the_body() -> None:
    r = rig()
    counts: collections.Counter[str] = collections.Counter()
    for i in range(400):
        decision = await r.director.route(_chat("food-review", rid=f"r{i}"))
        r.director.complete(decision, status=200, usage=None)
        assert decision.model_name == "food-review"
        assert decision.body is not None
        assert json.loads(decision.body)["model"] == decision.target_model
        assert (decision.criticality, decision.priority) == (Criticality.STANDARD, 0)
        counts[decision.target_model] += 1
    assert set(counts) == {"food-review-v1", "food-review-v2"}
    assert 0.84 < counts["food-review-v1"] / 400 < 0.96  # 90/10, seeded


async def test_rewrite_header_only_when_trusted_and_after_rules() -> None:
    trusted = rig(REWRITE)
    ask = headers(x_gateway_model_name_rewrite="chat-lora")
    decision = await trusted.director.route(_chat("chat", headers=ask))
    assert decision.target_model == "chat-lora"
    assert decision.body is not None
    assert json.loads(decision.body)["model"] == "chat-lora"
    ruled = await trusted.director.route(_chat("food-review", rid="r2", headers=ask))
    assert ruled.target_model.startswith("food-review-v")  # a matching rule wins (upstream)
    untrusted = await rig().director.route(_chat("chat", headers=ask))
    assert untrusted.target_model == "chat"
    assert untrusted.body is None


async def test_passthrough_is_priority_zero_and_generic_rules_apply() -> None:
    with pytest.raises(ModelNotFound):
        await rig().director.route(_chat("anything"))
    r = rig(OBJECTIVE, unknown_model_policy=UnknownModelPolicy.PASSTHROUGH)
    decision = await r.director.route(_chat("anything"))
    assert (decision.target_model, decision.criticality, decision.priority) == (
        "anything",
        Criticality.STANDARD,
        0,
    )
    gold = await r.director.route(
        _chat("anything", rid="r2", headers=headers(x_gateway_inference_objective="gold"))
    )
    assert gold.criticality is Criticality.CRITICAL

    generic = rewrite({"targets": [{"modelRewrite": "base"}]})
    store = _store(models=(generic,))
    director = _rig(store, RequestHandling(unknown_model_policy=UnknownModelPolicy.PASSTHROUGH))
    routed = await director.director.route(_chat("whatever"))
    assert routed.target_model == "base"
