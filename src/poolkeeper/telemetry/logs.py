"""Structured (JSON-lines) logging for `poolkeeper serve`.

Request logs carry ids, model names, endpoints, statuses and timings; the ext_proc layer never
passes request or response bodies to a logger, so prompts and completions stay out of logs.
Client-supplied text (a model name) may hold newlines or escape sequences: JSON lines escape
them by construction, and the text format escapes every control character, so one record is
always one line and no client can forge another. Messages longer than `MAX_MESSAGE_CHARS` are cut.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

MAX_MESSAGE_CHARS = 4096


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[:MAX_MESSAGE_CHARS] + f"...[{len(message) - MAX_MESSAGE_CHARS} chars cut]"


def escape_controls(text: str) -> str:
    """Control characters as visible escapes (`\\n`, `\\x1b`, ...): one record, one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class TextFormatter(logging.Formatter):
    """`--log-format text`: human-readable, with the message escaped and bounded."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(_bounded(record.message))
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _bounded(record.getMessage()),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


class CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to whatever `sys.stderr` is at that moment (as logging's own
    last-resort handler does), so a replaced and closed stderr (a test's capture, a daemon
    that redirects it) never turns logging into "I/O operation on closed file" errors."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(
    level: str = "info", *, json_lines: bool = True, stream: TextIO | None = None
) -> None:
    """Route the `poolkeeper` loggers to `stream` (stderr) at `level`."""
    handler: logging.Handler = (
        CurrentStderrHandler() if stream is None else logging.StreamHandler(stream)
    )
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger("poolkeeper")
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
