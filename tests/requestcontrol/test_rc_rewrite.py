"""Body rewrite: the target model and the injected stream usage option, nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest

from poolkeeper.requestcontrol.body import parse_body
from poolkeeper.requestcontrol.rewrite import rewrite_body, should_inject_usage

_CHAT: dict[str, Any] = {
    "temperature": 0.25,
    "model": "chat",
    "messages": [{"role": "user", "content": "héllo 😀", "name": None}],
    "stream": True,
    "logit_bias": {"50256": -100},
    "seed": 12345678901234567890,
    "extra": {"nested": [1, 2.5, True, None, "x"]},
}


def test_model_rewrite_preserves_everything_else() -> None:
    out = json.loads(rewrite_body(_CHAT, model="llama-lora"))
    assert out["model"] == "llama-lora"
    assert {k: v for k, v in out.items() if k != "model"} == {
        k: v for k, v in _CHAT.items() if k != "model"
    }
    assert list(out) == list(_CHAT)  # key order kept; model stays in its place
    assert _CHAT["model"] == "chat"  # the input is not modified


def test_output_is_utf8_json() -> None:
    raw = rewrite_body(_CHAT, model="m")
    assert "héllo 😀".encode() in raw
    raw.decode("utf-8")


def test_inject_usage_adds_or_merges_stream_options() -> None:
    out = json.loads(rewrite_body(_CHAT, include_usage=True))
    assert out["stream_options"] == {"include_usage": True}
    assert out["model"] == "chat"
    payload = {**_CHAT, "stream_options": {"continuous_usage_stats": True, "include_usage": False}}
    out = json.loads(rewrite_body(payload, include_usage=True))
    assert out["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert payload["stream_options"]["include_usage"] is False  # copied, not edited


@pytest.mark.parametrize(
    ("path", "body", "enabled", "expected"),
    [
        ("/v1/chat/completions", {"stream": True}, True, True),
        ("/v1/completions", {"stream": True, "prompt": "x"}, True, True),
        ("/v1/chat/completions", {"stream": True}, False, False),
        ("/v1/chat/completions", {"stream": False}, True, False),
        ("/v1/chat/completions", {}, True, False),
        (
            "/v1/chat/completions",
            {"stream": True, "stream_options": {"include_usage": True}},
            True,
            False,
        ),
        (
            "/v1/chat/completions",
            {"stream": True, "stream_options": {"include_usage": False}},
            True,
            True,
        ),
        ("/v1/chat/completions", {"stream": True, "stream_options": "bad"}, True, False),
        ("/v1/responses", {"stream": True, "input": "x"}, True, False),
        ("/v1/embeddings", {"stream": True, "input": "x"}, True, False),
    ],
)
def test_should_inject_usage(
    path: str, body: dict[str, Any], enabled: bool, expected: bool
) -> None:
    full = {"model": "m", "messages": [], **body}
    parsed = parse_body(path, json.dumps(full).encode())
    assert should_inject_usage(parsed, enabled=enabled) is expected
