"""Upstream's request-handling defaults (llm-d-router): the control headers are read by
default in both spellings, the llm-d one winning; `trustedHeaders: []` turns them off."""

from __future__ import annotations

from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.config.gateway import RequestHandling, TrustedHeader
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
