"""The OpenAI wire format as vLLM speaks it: request bodies in, completions and SSE chunks out.

Pure functions and small classes; the aiohttp handlers in sim/server.py only move bytes.
Generated text is ASCII letters and spaces (sim/textgen.py), so it is placed into JSON without
escaping; everything else goes through json.dumps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poolkeeper.tokens import chat_prompt_text


class BadRequestBody(ValueError):
    """A request body vLLM would answer with 400."""


def error_body(message: str, *, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error JSON (OpenAI-shaped): type is the exception class name, code the status."""
    kinds = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError"}
    kind = kinds.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    chat: bool
    model: str
    prompt: str  # the text the engine tokenizes and hashes
    prompt_tokens: int | None  # set when the client sent token ids
    max_tokens: int | None
    stream: bool
    include_usage: bool


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestBody(f"'{name}' must be an integer, got {value!r}")
    if value < 1:
        raise BadRequestBody(f"'{name}' must be at least 1, got {value}")
    return value


def parse_request(raw: bytes, *, chat: bool) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestBody(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestBody("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestBody("'model' is required and must be a string.")
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequestBody("The simulator supports only n = 1.")
    # Newer clients send max_completion_tokens; honour either (the smaller if both).
    limits = [
        v for v in (_int_field(body, "max_tokens"), _int_field(body, "max_completion_tokens")) if v
    ]
    max_tokens = min(limits) if limits else None
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequestBody("'stream_options' must be an object.")
    include_usage = bool(stream and options and options.get("include_usage"))
    prompt_tokens: int | None = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequestBody("'messages' is required and must be a non-empty list.")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequestBody("Each message must be an object with 'role' and 'content'.")
        prompt = chat_prompt_text(messages) + "<|im_start|>assistant\n"
    else:
        prompt_value = body.get("prompt")
        if (
            isinstance(prompt_value, list)
            and len(prompt_value) == 1
            and not isinstance(prompt_value[0], int)
        ):
            prompt_value = prompt_value[0]  # a batch of one
        if isinstance(prompt_value, str):
            prompt = prompt_value
        elif (
            isinstance(prompt_value, list)
            and prompt_value
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_value)
        ):
            prompt = " ".join(str(t) for t in prompt_value)
            prompt_tokens = len(prompt_value)
        else:
            raise BadRequestBody(
                "'prompt' must be a string, a list of one string, or a list of token ids."
            )
        if not prompt:
            raise BadRequestBody("'prompt' must not be empty.")
    return ParsedRequest(chat, model, prompt, prompt_tokens, max_tokens, stream, include_usage)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(
    *, chat: bool, response_id: str, created: int, model: str, text: str, finish_reason: str,
    usage: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        kind = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        kind = "text_completion"
    return {
        "id": response_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


class ChunkWriter:
    """Pre-formats the SSE events of one streaming response."""

    __slots__ = ("_head", "_include_usage", "_kind", "chat")

    def __init__(
        self, *, chat: bool, response_id: str, created: int, model: str, include_usage: bool
    ) -> None:
        self.chat = chat
        self._kind = "chat.completion.chunk" if chat else "text_completion"
        self._include_usage = include_usage
        self._head = (
            f'data: {{"id":{json.dumps(response_id)},"object":"{self._kind}",'
            f'"created":{created},"model":{json.dumps(model)},"choices":['
        )

    @property
    def include_usage(self) -> bool:
        return self._include_usage

    def _tail(self) -> str:
        return ',"usage":null}\n\n' if self._include_usage else "}\n\n"

    def role(self) -> str:
        """Chat streams open with the assistant role and empty content, as vLLM does."""
        return (
            self._head + '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            '"finish_reason":null}]' + self._tail()
        )

    def text(self, text: str, finish_reason: str | None = None) -> str:
        reason = "null" if finish_reason is None else f'"{finish_reason}"'
        if self.chat:
            choice = f'{{"index":0,"delta":{{"content":"{text}"}},"logprobs":null,'
        else:
            choice = f'{{"index":0,"text":"{text}","logprobs":null,'
        return (
            self._head + choice + f'"finish_reason":{reason},"stop_reason":null}}]' + self._tail()
        )

    def usage(self, usage: dict[str, Any]) -> str:
        return self._head + '],"usage":' + json.dumps(usage, separators=(",", ":")) + "}\n\n"

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
