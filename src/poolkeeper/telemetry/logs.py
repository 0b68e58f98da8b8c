"""Structured (JSON-lines) logging for `poolkeeper serve`.

Request logs carry ids, model names, endpoints, statuses and timings; the ext_proc layer never
passes request or response bodies to a logger, so prompts and completions stay out of logs.
Client-supplied text (a model name) may hold newlines or escape sequences: JSON lines escape
them by construction, and the text format escapes every control character, so one record is
always one line and no client can forge another. Messages longer than `MAX_MESSAGE_CHARS` are cut.

`serve` writes its logs from a thread of their own (`LogQueue`, checklist G4): the event loop
only puts a record on a bounded queue, so a slow or stalled stderr (a full pipe, a blocked log
collector) never stalls routing or health probes. When the queue is full, records are dropped
and counted, and the writer says how many once it catches up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import sys
import threading
import time
from typing import TextIO

MAX_MESSAGE_CHARS = 4096
# Records waiting for the writer thread: a few seconds of debug logging at full load (three
# records per request); beyond it records are dropped, never buffered without bound.
LOG_QUEUE_RECORDS = 10_000


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
        elif record.exc_text:  # formatted by LogQueue before it crossed threads
            entry["exc"] = record.exc_text
        return json.dumps(entry, separators=(",", ":"))


class CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to whatever `sys.stderr` is at that moment (as logging's own
    last-resort handler does), so a replaced and closed stderr (a test's capture, a daemon
    that redirects it) never turns logging into "I/O operation on closed file" errors."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


class LogQueue(logging.Handler):
    """A handler that hands records to one writer thread through a bounded queue.

    The logging call pays for the message's %-formatting only (its arguments may change once
    the call returns) and a non-blocking put; the writer formats and writes. A full queue
    drops the record and counts it: the writer then logs how many were lost."""

    def __init__(self, target: logging.Handler, capacity: int = LOG_QUEUE_RECORDS) -> None:
        super().__init__()
        self.target = target
        self.dropped = 0
        self._reported = 0
        self._queue: queue.Queue[logging.LogRecord | None] = queue.Queue(capacity)
        self._drop_lock = threading.Lock()
        self._closing = False
        self._writer = threading.Thread(target=self._write, name="poolkeeper-logs", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg = record.getMessage()
            record.args = None
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None  # tracebacks hold frames: do not keep them queued
        except Exception:
            self.handleError(record)
            return
        if self._closing:  # the writer is gone or going: write it here, as at exit
            self.target.handle(record)
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self._drop_lock:
                self.dropped += 1

    def _write(self) -> None:
        while (record := self._queue.get()) is not None:
            self.target.handle(record)
            if self._queue.empty():
                self._report_drops()
        # close()'s sentinel can join the queue before the writer has caught up (a stream that
        # was stalled until exit): the queue is then never empty after a record, so say here
        # what was lost, or the note would be lost with the writer.
        self._report_drops()

    def _report_drops(self) -> None:
        if self.dropped > self._reported:
            lost, self._reported = self.dropped - self._reported, self.dropped
            self.target.handle(
                logging.makeLogRecord(
                    {
                        "name": "poolkeeper.logs",
                        "levelno": logging.WARNING,
                        "levelname": "WARNING",
                        "msg": f"{lost} log records dropped: the log stream was slower "
                        "than the gateway",
                    }
                )
            )

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (for at most `timeout_s`: a stalled stream must not hold up
        an exit), then stop the writer. Idempotent: logging's exit hook closes it again."""
        if self._writer.is_alive() and not self._closing:
            self._closing = True
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout_s)
            self._writer.join(timeout_s)
        super().close()


def configure_logging(
    level: str = "info",
    *,
    json_lines: bool = True,
    stream: TextIO | None = None,
    queued: bool = False,
) -> LogQueue | None:
    """Route the `poolkeeper` loggers to `stream` (stderr) at `level`. With `queued`, records
    are written by a thread of their own (`LogQueue`), which the caller closes at exit."""
    handler: logging.Handler = (
        CurrentStderrHandler() if stream is None else logging.StreamHandler(stream)
    )
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    writer = LogQueue(handler) if queued else None
    root = logging.getLogger("poolkeeper")
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(writer or handler)
    root.setLevel(level.upper())
    root.propagate = False
    return writer
