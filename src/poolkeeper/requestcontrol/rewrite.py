"""Rewriting a request body: the target model, and the streaming usage option.

Pure. The body is re-serialised from the decoded object (compact separators, UTF-8, key order
kept), the way upstream re-marshals it; every field other than `model` and, when asked,
`stream_options.include_usage` is carried over unchanged in value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from poolkeeper.requestcontrol.body import ApiKind, ParsedRequest

# Only these APIs stream chunks that can carry a final usage chunk.
USAGE_STREAMING_APIS = frozenset({ApiKind.CHAT_COMPLETIONS, ApiKind.COMPLETIONS})


def should_inject_usage(parsed: ParsedRequest, *, enabled: bool) -> bool:
    """Whether to add `stream_options.include_usage=true`: a streaming chat or completions
    request that did not ask for usage itself, and whose `stream_options` (if any) is an object.
    """
    if not enabled or not parsed.stream or parsed.include_usage:
        return False
    if parsed.api not in USAGE_STREAMING_APIS:
        return False
    options = parsed.payload.get("stream_options")
    return options is None or isinstance(options, dict)


def rewrite_body(
    payload: Mapping[str, Any], *, model: str | None = None, include_usage: bool = False
) -> bytes:
    """The body with `model` replaced (when given) and usage requested (when asked).

    `payload` is not modified: the top level and `stream_options` are copied before editing.
    """
    out = dict(payload)  # keeps key order; replacing a key keeps its position
    if model is not None:
        out["model"] = model
    if include_usage:
        options = out.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options["include_usage"] = True
        out["stream_options"] = options
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
