"""The client-facing model name restored in responses (upstream `TestRewriteModelName`,
`pkg/epp/handlers/response_test.go@v1.5.0`, plus the cases upstream's byte replace misses)."""

from __future__ import annotations

import json

import pytest

from poolkeeper.extproc.model_name import rewriter_for
from poolkeeper.extproc.usage import SseUsageFilter
from poolkeeper.requestcontrol.types import model_renamed

TARGET, CLIENT = "vllm-backend-01", "gpt-4-proxy"


@pytest.mark.parametrize(
    ("body", "target", "client", "want"),
    [
        (  # non-streaming response with model rewrite
            b'{"id":"cmpl-123","model":"vllm-backend-01","choices":[]}',
            TARGET,
            CLIENT,
            b'{"id":"cmpl-123","model":"gpt-4-proxy","choices":[]}',
        ),
        (  # streaming SSE chunk with model rewrite
            b'data: {"id":"cmpl-123","model":"vllm-backend-01","choices":[]}\n\n',
            TARGET,
            CLIENT,
            b'data: {"id":"cmpl-123","model":"gpt-4-proxy","choices":[]}\n\n',
        ),
        (b'{"model":"same-model"}', "same-model", "same-model", b'{"model":"same-model"}'),
        (b'{"model":"some-model"}', "", CLIENT, b'{"model":"some-model"}'),
        (b'{"model":"some-model"}', "some-model", "", b'{"model":"some-model"}'),
        (  # model field with space after colon
            b'{"model": "vllm-backend-01"}',
            TARGET,
            CLIENT,
            b'{"model": "gpt-4-proxy"}',
        ),
        (b'{"id":"cmpl-123","choices":[]}', TARGET, CLIENT, b'{"id":"cmpl-123","choices":[]}'),
        (b"data: [DONE]\n", TARGET, CLIENT, b"data: [DONE]\n"),
    ],
    ids=[
        "non-streaming",
        "sse-chunk",
        "same-names",
        "target-empty",
        "incoming-empty",
        "space-after-colon",
        "no-model-field",
        "done-marker",
    ],
)
def test_response_test_go_rewrite_model_name(
    body: bytes, target: str, client: str, want: bytes
) -> None:
    rewrite = rewriter_for(target, client)
    assert (rewrite(body) if rewrite is not None else body) == want


def test_only_the_structural_key_and_the_exact_name_are_rewritten() -> None:
    rewrite = rewriter_for("lora-a", 'client "x"')
    assert rewrite is not None
    text = json.dumps({"model": "lora-a", "text": 'say "model":"lora-a"', "m": "lora-ab"})
    out = json.loads(rewrite(text.encode()))
    assert out == {"model": 'client "x"', "text": 'say "model":"lora-a"', "m": "lora-ab"}
    assert rewrite(b'{"model":"lora-ab"}') == b'{"model":"lora-ab"}'


def test_non_ascii_target_in_either_spelling() -> None:
    rewrite = rewriter_for("modèle-1", "modèle")
    assert rewrite is not None
    for spelled in (
        json.dumps({"model": "modèle-1"}),
        json.dumps({"model": "modèle-1"}, ensure_ascii=False),
    ):
        assert json.loads(rewrite(spelled.encode())) == {"model": "modèle"}


def test_sse_events_split_anywhere_are_rewritten_whole() -> None:
    stream = (
        b'data: {"model":"vllm-backend-01","choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"model":"vllm-backend-01","choices":[{"delta":{"content":"b"}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    want = stream.replace(b"vllm-backend-01", b"gpt-4-proxy")
    for cut in range(len(stream) + 1):
        f = SseUsageFilter(strip_injected_usage=False, rewrite=rewriter_for(TARGET, CLIENT))
        assert f.feed(stream[:cut]) + f.feed(stream[cut:]) + f.finish() == want, cut


@pytest.mark.parametrize(
    ("target", "client", "renamed"),
    [
        ("food-review-v1", "food-review", True),
        ("m", "m", False),
        ("", "m", False),
        ("m", "", False),
    ],
)
def test_one_rule_says_when_a_response_carries_another_name(
    target: str, client: str, renamed: bool
) -> None:
    """The Director (usage injection) and ext_proc (rewrite, the response path) share it."""
    assert model_renamed(target, client) is renamed
    assert (rewriter_for(target, client) is not None) is renamed


def test_a_server_naming_responses_itself_gets_any_name_replaced() -> None:
    """llama.cpp answers under its alias or model file, whatever the request said: with
    `any_name` every structural `"model"` string becomes the client's name, even when the
    target and the client's name are the same, and string contents are still left alone."""
    rewrite = rewriter_for("smol-a", "smol-split", any_name=True)
    assert rewrite is not None
    body = json.dumps(
        {"model": '/m/SmolLM2 "135M".gguf', "choices": [{"text": 'a "model": "x" b'}]}
    ).encode()
    assert json.loads(rewrite(body)) == {
        "model": "smol-split",
        "choices": [{"text": 'a "model": "x" b'}],
    }
    same = rewriter_for("smollm2", "smollm2", any_name=True)
    assert same is not None
    assert same(b'data: {"model":"SmolLM2-135M-Instruct.Q4_1.gguf"}\n\n') == (
        b'data: {"model":"smollm2"}\n\n'
    )
    assert rewriter_for("smollm2", "", any_name=True) is None  # no client name to give back
