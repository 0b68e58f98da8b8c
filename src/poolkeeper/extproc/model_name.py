"""Give responses the model name the client asked for (upstream v1.x restores it too).

When the gateway sent a request to a target model (`food-review` -> `food-review-v1`), the
model server answers with `"model": "food-review-v1"`. `ModelNameRewriter` puts the client-facing
name back, in whole JSON bodies and in each complete SSE event. Only the structural `"model"`
key matches: inside JSON strings quotes are escaped, so a prompt or a completion that mentions
`"model":"food-review-v1"` stays as it is. Both the ASCII-escaped and the raw UTF-8 spelling of
the target are recognised, and whitespace around the colon is kept.

A server that answers under its own name whatever the request said (llama.cpp: its `--alias`
or its model file's name; `EngineType.names_responses_itself`) gets every response renamed:
then any string value of the structural `"model"` key is replaced, not only the target's.
"""

from __future__ import annotations

import json
import re

from poolkeeper.requestcontrol.types import model_renamed

# Any JSON string: what a server that names responses after itself may put there.
_ANY_STRING = rb'(?:[^"\\]|\\.)*'


class ModelNameRewriter:
    """Replaces `"model": "<target>"` (or, with no target, any `"model"` string) with
    `"model": "<client name>"` in JSON text."""

    __slots__ = ("_pattern", "_replacement")

    def __init__(self, target: str | None, client: str) -> None:
        if target is None:
            alternatives = _ANY_STRING
        else:
            spellings = {json.dumps(target)[1:-1], json.dumps(target, ensure_ascii=False)[1:-1]}
            alternatives = "|".join(
                re.escape(s.encode()).decode() for s in sorted(spellings)
            ).encode()
        self._pattern = re.compile(rb'("model"\s*:\s*)"(?:' + alternatives + rb')"')
        # a callable replacement: the client name is literal text, never a regex template
        quoted = json.dumps(client, ensure_ascii=False).encode()
        self._replacement = lambda m: m.group(1) + quoted

    def __call__(self, data: bytes) -> bytes:
        return self._pattern.sub(self._replacement, data)


def rewriter_for(target: str, client: str, *, any_name: bool = False) -> ModelNameRewriter | None:
    """A rewriter when the two names differ (and both are known), else None. With `any_name`
    (the server names responses after itself: llama.cpp) whatever name the server put there
    is replaced, whenever the client named a model."""
    if any_name and client:
        return ModelNameRewriter(None, client)
    return ModelNameRewriter(target, client) if model_renamed(target, client) else None
