"""Give responses the model name the client asked for (upstream v1.x restores it too).

When the gateway sent a request to a target model (`food-review` -> `food-review-v1`), the
model server answers with `"model": "food-review-v1"`. `ModelNameRewriter` puts the client-facing
name back, in whole JSON bodies and in each complete SSE event. Only the structural `"model"`
key matches: inside JSON strings quotes are escaped, so a prompt or a completion that mentions
`"model":"food-review-v1"` stays as it is. Both the ASCII-escaped and the raw UTF-8 spelling of
the target are recognised, and whitespace around the colon is kept.
"""

from __future__ import annotations

import json
import re

from poolkeeper.requestcontrol.types import model_renamed


class ModelNameRewriter:
    """Replaces `"model": "<target>"` with `"model": "<client name>"` in JSON text."""

    __slots__ = ("_pattern", "_replacement")

    def __init__(self, target: str, client: str) -> None:
        spellings = {json.dumps(target)[1:-1], json.dumps(target, ensure_ascii=False)[1:-1]}
        alternatives = "|".join(re.escape(s.encode()).decode() for s in sorted(spellings))
        self._pattern = re.compile(rb'("model"\s*:\s*)"(?:' + alternatives.encode() + rb')"')
        # a callable replacement: the client name is literal text, never a regex template
        quoted = json.dumps(client, ensure_ascii=False).encode()
        self._replacement = lambda m: m.group(1) + quoted

    def __call__(self, data: bytes) -> bytes:
        return self._pattern.sub(self._replacement, data)


def rewriter_for(target: str, client: str) -> ModelNameRewriter | None:
    """A rewriter when the two names differ (and both are known), else None."""
    return ModelNameRewriter(target, client) if model_renamed(target, client) else None
