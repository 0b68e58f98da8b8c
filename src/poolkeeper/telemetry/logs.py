"""Structured (JSON-lines) logging for `poolkeeper serve`.

Request logs carry ids, model names, endpoints, statuses and timings; the ext_proc layer never
passes request or response bodies to a logger, so prompts and completions stay out of logs.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
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
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("poolkeeper")
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
