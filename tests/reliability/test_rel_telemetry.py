"""Finding 4: label values and log lines under hostile model names (checklist F6/F7)."""

from __future__ import annotations

import io
import json
import logging

from poolkeeper.errors import ModelNotFound
from poolkeeper.telemetry.labels import MAX_LABEL_CHARS
from poolkeeper.telemetry.logs import configure_logging
from poolkeeper.telemetry.metrics import GatewayMetrics


def test_long_and_control_model_names_do_not_bloat_metrics() -> None:
    """110 requests with 1 MB names made a 122 MB /metrics page; now each value is cut."""
    metrics = GatewayMetrics(pool_stats=lambda: iter(()))
    for i in range(110):
        name = f"{i}" + "m" * 1_000_000
        metrics.rejected(name, ModelNotFound("model not found", model=name), 10)
    metrics.rejected('a\nb{c="d"}', ModelNotFound("x", model="a\nb"), 10)
    page = metrics.render()
    assert len(page) < 2_000_000
    for line in page.decode().splitlines():
        assert len(line) < MAX_LABEL_CHARS * 4 + 400
    assert "a\nb" not in page.decode()


def test_text_logs_cannot_be_forged_by_a_newline_in_a_model_name() -> None:
    stream = io.StringIO()
    configure_logging("info", json_lines=False, stream=stream)
    evil = "x\n2026-01-01 00:00:00,000 INFO poolkeeper.extproc: completed status=200\x1b[2J"
    logging.getLogger("poolkeeper.extproc").info("rejected model=%s", evil)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert "\\n2026-01-01" in lines[0]
    assert "\x1b" not in lines[0]
    stream = io.StringIO()
    configure_logging("info", json_lines=True, stream=stream)
    logging.getLogger("poolkeeper.extproc").info("rejected model=%s", evil + "y" * 100_000)
    (line,) = stream.getvalue().splitlines()
    assert json.loads(line)["msg"].startswith("rejected model=x\n")
    assert len(line) < 10_000
    configure_logging("info")
