"""The bench-only signal tap (extproc/signal_tap.py): off unless its variable is set."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import wrappers_pb2

from poolkeeper import observation as wire
from poolkeeper.extproc.accesslog import AccessLogReceiver, DetachedExchanges, FirstByteReceiver
from poolkeeper.extproc.outcome import Outcome
from poolkeeper.extproc.signal_tap import SIGNAL_LOG_ENV, TAG_HEADER, SignalTap


class _Held:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers
        self.firsts = 0
        self.outcomes: list[Outcome] = []

    def observed(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def first_byte_passed(self) -> None:
        self.firsts += 1


def test_no_tap_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SIGNAL_LOG_ENV, raising=False)
    assert SignalTap.from_env() is None
    assert DetachedExchanges().tap is None


def _entry(key: str) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.response.response_code.value = 200
    common = entry.common_properties
    common.start_time.FromNanoseconds(1_700_000_000_000_000_000)
    common.time_to_last_upstream_rx_byte.FromNanoseconds(25_000_000)
    meta = common.metadata.filter_metadata[wire.NAMESPACE]
    meta.fields[wire.EXCHANGE].string_value = key
    meta.fields[wire.FIRST_BYTE_AT].number_value = 1_700_000_000_010.0
    return entry


def test_tap_writes_first_bytes_and_entries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = tmp_path / "signals.jsonl"
    monkeypatch.setenv(SIGNAL_LOG_ENV, str(log))
    detached = DetachedExchanges(tap=SignalTap.from_env())
    held = _Held({TAG_HEADER: "sig-1"})
    key = detached.hold(held)
    asyncio.run(FirstByteReceiver(detached).first_byte(wrappers_pb2.StringValue(value=key)))
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.append(_entry(key))

    async def stream() -> object:
        async def messages():
            yield message

        return await AccessLogReceiver(detached).StreamAccessLogs(messages())

    asyncio.run(stream())
    assert detached.tap is not None
    detached.tap.close()
    assert (held.firsts, [o.status for o in held.outcomes]) == (1, [200])  # still applied
    first, end = (json.loads(line) for line in log.read_text().splitlines())
    assert (first["kind"], first["rid"], first["key"]) == ("first", "sig-1", key)
    assert (end["kind"], end["rid"], end["status"]) == ("end", "sig-1", 200)
    assert end["start"] == pytest.approx(1_700_000_000.0)
    assert end["time_to_last_upstream_rx_byte"] == pytest.approx(0.025)
    assert "time_to_first_upstream_rx_byte" not in end  # not in the entry: not made up
    assert end["lua_first_ms"] == 1_700_000_000_010.0
    assert detached.waiting(key) is None  # settled


def test_tap_writes_kv_batches(tmp_path: Path) -> None:
    out = tmp_path / "signals.jsonl"
    tap = SignalTap(out.open("a", buffering=1, encoding="utf-8"))
    tap.kv_batch("127.0.0.1:8000", 100.25, 100.5)
    tap.close()
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["kind"] == "kv"
    assert (record["endpoint"], record["ts"], record["wall"]) == ("127.0.0.1:8000", 100.25, 100.5)
    assert isinstance(record["mono"], float)
    assert record["applied"] > 100.5  # written now, after the receipt
