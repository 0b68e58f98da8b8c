"""Token usage from model-server responses: whole JSON bodies and Server-Sent Events streams.

`SseUsageFilter` is fed the response body as Envoy delivers it (split anywhere, even inside a
`data:` line) and returns the bytes to forward. It records the `usage` object of the final chunk.
When the gateway injected `stream_options.include_usage` on the client's behalf, it also drops
the extra usage-only chunk (`"choices": []` plus `usage`), so the client sees the stream it asked
for. Only an incomplete trailing event is ever held back, so streaming stays incremental.

Some servers (and upstream's own test fixture, `pkg/epp/handlers/response_test.go`) write one
`data:` line per message with no blank line between them. Strictly that is one SSE event whose
data is the lines joined by newlines; when that joined payload is not JSON, each `data:` line is
read as a message of its own, as upstream does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from poolkeeper.requestcontrol.types import Usage

# An event that never terminates is forwarded unparsed once it grows past this size.
MAX_PENDING_EVENT = 1 << 20
_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")
_NULL_USAGE = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,\s*')


def usage_from_object(obj: Any) -> Usage | None:
    """The OpenAI `usage` of a decoded response (chat/completions chunk or body), if present."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if not isinstance(prompt, int) and not isinstance(completion, int):
        return None
    cached: int | None = None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        cached = details["cached_tokens"]
    return Usage(
        prompt_tokens=prompt if isinstance(prompt, int) else 0,
        completion_tokens=completion if isinstance(completion, int) else 0,
        cached_tokens=cached,
    )


def usage_from_json(body: bytes) -> Usage | None:
    """Usage of a non-streaming response body; None for anything that is not such JSON."""
    try:
        return usage_from_object(json.loads(body))
    except (ValueError, RecursionError):
        return None


def _event_data(event: bytes) -> bytes | None:
    """The joined `data:` payload of one SSE event (without its terminator)."""
    lines = []
    for raw in event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
        if raw.startswith(b"data:"):
            value = raw[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines) if lines else None


def _as_separate_lines(event: bytes) -> list[bytes] | None:
    """The event's lines (with their terminators) when its `data:` lines must be read one by one:
    several data lines whose joined payload is not one JSON document."""
    lines = event.splitlines(keepends=True)
    if sum(1 for line in lines if line.startswith(b"data:")) < 2:
        return None
    data = _event_data(event)
    try:
        json.loads(data or b"")
    except (ValueError, RecursionError):
        return lines
    return None


def _split_event(buf: bytes) -> tuple[bytes, bytes] | None:
    """(event including its terminator, rest) for the first complete event in `buf`."""
    best: tuple[int, int] | None = None
    for sep in _SEPARATORS:
        at = buf.find(sep)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, len(sep))
    if best is None:
        return None
    end = best[0] + best[1]
    return buf[:end], buf[end:]


class SseUsageFilter:
    """Streams SSE bytes through, recording usage and optionally dropping the injected chunk."""

    def __init__(
        self,
        *,
        strip_injected_usage: bool,
        rewrite: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.strip_injected_usage = strip_injected_usage
        # Applied to each complete event (e.g. the model name back to the client's).
        self.rewrite = rewrite
        self._holds = strip_injected_usage or rewrite is not None
        self.usage: Usage | None = None
        self.saw_done = False
        self.events = 0
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """Bytes to forward now for this piece of the stream.

        Without stripping or rewriting nothing is ever held back: the bytes pass at once and
        are parsed on the side. Otherwise complete events pass and an incomplete tail waits.
        """
        self._pending += data
        out: list[bytes] = []
        while True:
            split = _split_event(self._pending)
            if split is None:
                break
            event, self._pending = split
            kept = self._filter(event)
            if kept is not None:
                out.append(kept)
        if len(self._pending) > MAX_PENDING_EVENT:
            out.append(self._pending)
            self._pending = b""
        if not self._holds:
            return data
        return b"".join(out)

    def finish(self) -> bytes:
        """The held tail at end of stream (an unterminated last event is still inspected)."""
        tail, self._pending = self._pending, b""
        kept = self._filter(tail) if tail else b""
        if not self._holds:
            return b""  # already forwarded by feed()
        return kept or b""

    def _filter(self, event: bytes) -> bytes | None:
        """The event as the client should see it; None to drop it."""
        self.events += 1
        lines = _as_separate_lines(event)
        if lines is not None:
            kept_lines = [x for x in lines if not x.startswith(b"data:") or self._keep(x)]
            if not any(x.startswith(b"data:") for x in kept_lines):
                return None
            event = b"".join(kept_lines)
        elif not self._keep(event):
            return None
        if self.strip_injected_usage and b'"usage"' in event:
            # The injected option also makes servers add `"usage": null` to every chunk; the
            # client did not ask for the field. Only a structural key can match: inside JSON
            # strings quotes are escaped.
            event = _NULL_USAGE.sub(b"", event)
        if self.rewrite is not None:
            event = self.rewrite(event)
        return event

    def _keep(self, event: bytes) -> bool:
        data = _event_data(event)
        if data is None:
            return True
        if data.strip() == b"[DONE]":
            self.saw_done = True
            return True
        if b'"usage"' not in data:
            return True
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return True
        usage = usage_from_object(obj)
        if usage is None:
            return True
        self.usage = usage
        usage_only = isinstance(obj, dict) and obj.get("choices") == []
        return not (self.strip_injected_usage and usage_only)
