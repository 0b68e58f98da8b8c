"""Findings 1, 3 and 7 inside the EPP (no Envoy): the inference-path allowlist for EPPs behind
another proxy, the per-request and global in-flight body budgets, and an empty POST body that
must get the model check rather than a random pod."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from poolkeeper.errors import BadRequest
from poolkeeper.extproc.contracts import BodyBudget, ExtProcSettings
from poolkeeper.extproc.state import Exchange
from poolkeeper.requestcontrol.types import IncomingRequest
from poolkeeper.server.envoy_bootstrap import fail_open_split_targets
from tests.extproc.extproc_fakes import FakeRouter, body_msg, headers_msg, post_headers
from tests.requestcontrol.test_rc_director import _rig
from tests.server.test_server_runtime import _start, _write

CHAT = b'{"model":"base","messages":[]}'


def _status(replies: list[Any]) -> int:
    (reply,) = replies
    return int(reply.immediate_response.status.code)


def _first(replies: list[Any]) -> Any:
    """The first reply (a protobuf message: only body mutations come in wire form)."""
    return replies[0]


async def test_epp_refuses_paths_outside_the_allowlist() -> None:
    settings = ExtProcSettings(inference_paths=frozenset({"/v1/chat/completions", "/v1/models"}))
    router = FakeRouter()
    for path in ("/v1/unload_lora_adapter", "/metrics", "/v1/chat/completionsX"):
        ex = Exchange(router, settings=settings)
        replies = await ex.handle(headers_msg(post_headers(**{":path": path})))
        assert _status(replies) == 404
        body = json.loads(_first(replies).immediate_response.body)
        assert body["error"]["code"] == "not_found"
    ok = Exchange(router, settings=settings)
    # Allowed (trailing slash and query ignored): FULL_DUPLEX holds the reply for the body.
    assert (
        await ok.handle(headers_msg(post_headers(**{":path": "/v1/chat/completions/?a=1"}))) == []
    )
    assert _first(await ok.handle(body_msg(CHAT, eos=True))).HasField("request_headers")


async def test_epp_refuses_an_encoded_body_with_415() -> None:
    """Round 2, finding 6, for EPPs behind another proxy: a gzip body got a misleading "not
    valid UTF-8", a plain body labelled gzip reached the server (500)."""
    router = FakeRouter()
    for encoding in ("gzip", "br", "GZIP"):
        ex = Exchange(router)
        replies = await ex.handle(headers_msg(post_headers(**{"content-encoding": encoding})))
        assert _status(replies) == 415
        body = json.loads(_first(replies).immediate_response.body)
        assert body["error"]["code"] == "unsupported_media_type"
    ok = Exchange(router)
    assert await ok.handle(headers_msg(post_headers(**{"content-encoding": "identity"}))) == []
    assert _first(await ok.handle(body_msg(CHAT, eos=True))).HasField("request_headers")


async def test_global_body_budget_refuses_and_is_given_back() -> None:
    budget = BodyBudget(100_000)
    router = FakeRouter()
    held = Exchange(router, budget=budget)
    await held.handle(headers_msg(post_headers()))
    await held.handle(body_msg(b"x" * 90_000, eos=False))
    assert budget.used == 90_000
    second = Exchange(router, budget=budget)
    await second.handle(headers_msg(post_headers()))
    replies = await second.handle(body_msg(b"y" * 20_000, eos=False))
    assert _status(replies) == 503
    assert b"server_busy" in _first(replies).immediate_response.body
    assert budget.used == 90_000  # the refused one took nothing
    held.close()  # the client went away: its bytes come back
    assert budget.used == 0
    third = Exchange(router, budget=budget)
    await third.handle(headers_msg(post_headers()))
    replies = await third.handle(body_msg(CHAT, eos=True))
    assert _first(replies).HasField("request_headers")
    assert budget.used == 0  # routed: the body is released at once


async def test_per_request_limit_refuses_before_holding_the_chunk() -> None:
    budget = BodyBudget(1 << 30)
    ex = Exchange(
        FakeRouter(), settings=ExtProcSettings(max_request_body_bytes=1000), budget=budget
    )
    await ex.handle(headers_msg(post_headers()))
    await ex.handle(body_msg(b"x" * 900, eos=False))
    replies = await ex.handle(body_msg(b"x" * 200, eos=False))
    assert _status(replies) == 413
    assert budget.used == 0
    assert len(ex.body) == 0


async def test_empty_post_body_gets_the_model_check() -> None:
    """Finding 7: a POST with no body was routed to a random pod, skipping the model check."""
    rig = _rig()
    empty = IncomingRequest("e", "POST", "/v1/chat/completions", {}, b"")
    with pytest.raises(BadRequest, match="request body is empty"):
        await rig.director.route(empty)
    bodyless = await rig.director.route(IncomingRequest("g", "GET", "/health", {}, b""))
    assert bodyless.endpoints  # GET without a body still goes to the default pool


@pytest.mark.parametrize(("mode", "expected"), [("FailOpen", {"split": "m-v1"}), ("FailClose", {})])
async def test_fail_open_split_names_are_reported(
    tmp_path: Path, mode: str, expected: dict[str, str]
) -> None:
    """Finding 5: under FailOpen with the EPP down a split name reached servers unrewritten
    (404 from the server); the managed Envoy now holds this table (round 2 R5)."""
    directory, _ = _write(tmp_path, mode)
    (directory / "split.yaml").write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceModel\n"
        "metadata: {name: split, namespace: default}\n"
        "spec: {modelName: split, poolRef: {name: pool}, targetModels: [{name: m-v1}]}\n"
    )
    _, store = await _start([directory])
    assert fail_open_split_targets(store.snapshot()) == expected
