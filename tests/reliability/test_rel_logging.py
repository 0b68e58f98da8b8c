"""Checklist G4: verbose logs under load. `serve` writes its logs from a thread of its own
through a bounded queue (`telemetry.logs.LogQueue`), so a stderr nobody reads (a full pipe, a
stalled log collector) stalls neither routing nor health probes; records beyond the queue are
dropped and counted, never buffered without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.telemetry.logs import JsonFormatter, LogQueue
from tests.support.gateway_files import gateway_ports, one_server_config
from tests.support.processes import (
    _RUNNER,
    SERVING,
    Proc,
    health_status,
    listening_ports,
    poolkeeper,
    wait_for_port,
    wait_ready,
)


class StalledStream(io.StringIO):
    """A log stream whose writes wait until `release` is set: a pipe nobody reads."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.release.wait(30)
        return super().write(text)


class GatedStream(io.StringIO):
    """A log stream that writes only as many records as the test allows (`allow`), and says
    how many writes have begun: the writer thread's progress, step by step."""

    def __init__(self) -> None:
        super().__init__()
        self._permits = threading.Semaphore(0)
        self._begun = threading.Condition()
        self.writes_begun = 0

    def write(self, text: str) -> int:
        with self._begun:
            self.writes_begun += 1
            self._begun.notify_all()
        if not self._permits.acquire(timeout=30):
            raise TimeoutError("the test never allowed this write")
        return super().write(text)

    def allow(self, writes: int) -> None:
        self._permits.release(writes)

    def wait_for_write(self, count: int) -> None:
        with self._begun:
            assert self._begun.wait_for(lambda: self.writes_begun >= count, timeout=30)


def _queue(stream: io.StringIO, capacity: int) -> tuple[logging.Logger, LogQueue]:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    writer = LogQueue(handler, capacity=capacity)
    logger = logging.getLogger(f"poolkeeper.test.logqueue.{id(writer)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(writer)
    return logger, writer


def test_a_stalled_log_stream_drops_and_counts_instead_of_blocking() -> None:
    stream = StalledStream()
    logger, writer = _queue(stream, capacity=100)
    try:
        for i in range(1_000):  # would hang on the first write without the queue
            logger.debug("routed request_id=%d", i)
        # The writer holds one record (blocked in write), the queue 100: the rest dropped.
        assert 899 <= writer.dropped <= 900
    finally:
        stream.release.set()
        writer.close()
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    kept = [int(e["msg"].split("=")[1]) for e in entries if e["msg"].startswith("routed")]
    assert kept[:100] == list(range(100))  # the first ones, then whatever found a free slot
    assert kept == sorted(set(kept))  # in order, none twice
    assert len(kept) == 1_000 - writer.dropped
    (note,) = [e for e in entries if e["logger"] == "poolkeeper.logs"]
    assert note["level"] == "warning"
    assert note["msg"].startswith(f"{writer.dropped} log records dropped")


def test_drops_are_reported_when_the_stream_recovers_only_after_close() -> None:
    """The exit path of a stalled stream: close() gives up waiting and queues its sentinel
    while records are still queued behind a blocked write. When the stream recovers, the
    writer drains the queue and must still say how many records it dropped (it used to
    report only on an empty queue, which the sentinel never leaves: the note was lost, and
    under CPU load the test above lost it too)."""
    stream = GatedStream()
    logger, writer = _queue(stream, capacity=10)
    logger.debug("routed request_id=0")
    stream.wait_for_write(1)  # the writer holds record 0, blocked in its write
    for i in range(1, 21):
        logger.debug("routed request_id=%d", i)  # 1-10 queued, 11-20 dropped
    assert writer.dropped == 10
    stream.allow(1)  # record 0 out; the writer takes record 1 and blocks again
    stream.wait_for_write(2)  # so the queue holds 2-10 and one free slot
    writer.close(timeout_s=0.05)  # the sentinel takes that slot; the join gives up
    stream.allow(1_000)  # the stream recovers after close
    deadline = time.monotonic() + 10
    while '"logger":"poolkeeper.logs"' not in stream.getvalue():
        assert time.monotonic() < deadline, stream.getvalue()
        time.sleep(0.01)
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [int(e["msg"].split("=")[1]) for e in entries[:-1]] == list(range(11))
    assert entries[-1]["msg"].startswith("10 log records dropped")


def test_queued_records_keep_their_values_and_tracebacks() -> None:
    stream = io.StringIO()
    logger, writer = _queue(stream, capacity=10)
    state = {"n": 1}
    logger.info("state %s", state)
    state["n"] = 2  # changed after the call: the record says what it was at the call
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("routing failed request_id=%s", "r1")
    writer.close()
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "state {'n': 1}"
    assert second["msg"] == "routing failed request_id=r1"
    assert "ValueError: boom" in second["exc"]
    assert writer.dropped == 0


MODEL = "tiny-base"


async def _complete(session: aiohttp.ClientSession, url: str, i: int) -> int:
    body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 4}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_debug_logs_to_a_pipe_nobody_reads_do_not_stall_the_gateway(
    tmp_path: Path,
) -> None:
    """`serve --log-level debug` (three records per request) with stdout and stderr on a pipe
    that is never read: the pipe fills after a few hundred records. Before the queue, the
    EPP's event loop blocked in the write and every request after that hung."""
    sim = poolkeeper(["sim", "--port", "0", "--model", MODEL], tmp_path / "s.log")
    ports = gateway_ports()
    try:
        (sim_port,) = await asyncio.to_thread(listening_ports, sim, 1)
    except BaseException:
        sim.stop()
        raise
    directory = one_server_config(tmp_path / "config", ports, sim_port, MODEL)
    read_end, gw = _serve_into_a_pipe(directory, tmp_path)
    try:
        try:
            await asyncio.to_thread(wait_ready, ports["health"], gw, 60)
            await asyncio.to_thread(wait_for_port, ports["http"], gw, 60)
        except (RuntimeError, TimeoutError) as exc:  # say why: the output is in the pipe
            raise AssertionError(f"{exc}\nits output:\n{_unread(read_end)[-3000:]}") from exc
        url = f"http://127.0.0.1:{ports['http']}"
        timeout = aiohttp.ClientTimeout(total=20)
        statuses: list[int] = []
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for start in range(0, 400, 8):
                statuses += await asyncio.gather(
                    *(_complete(session, url, i) for i in range(start, start + 8))
                )
            async with session.get(f"http://127.0.0.1:{ports['metrics']}/readyz") as resp:
                ready = resp.status
        assert statuses == [200] * 400
        assert ready == 200
        assert await asyncio.to_thread(health_status, ports["health"], "readiness") == SERVING
        # The pipe really is full: its reader now gets what was written, in full once drained.
        drained = await asyncio.to_thread(_drain_after_stop, read_end, gw)
        routed = [line for line in drained.splitlines() if "routed request_id=" in line]
        assert len(routed) == 400, drained[-2000:]
        assert len(drained) > 64 * 1024
    finally:
        gw.stop()
        sim.stop()
        os.close(read_end)


def _serve_into_a_pipe(directory: Path, tmp_path: Path) -> tuple[int, Proc]:
    """`serve --log-level debug` with stdout and stderr on a new pipe; its read end, unread."""
    read_end, write_end = os.pipe()
    args = ["serve", "-f", str(directory), "--workdir", str(tmp_path / "gw"),
            "--log-level", "debug"]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, *args],
        stdout=write_end,
        stderr=write_end,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    os.close(write_end)
    log = tmp_path / "gw.log"
    log.write_text("(the gateway's output is the unread pipe)\n")
    return read_end, Proc(process, log, log.open("rb"))


def _unread(read_end: int) -> str:
    """What the pipe holds now, without waiting for its writers (Envoy may still hold one)."""
    os.set_blocking(read_end, False)
    chunks: list[bytes] = []
    with contextlib.suppress(BlockingIOError):
        while data := os.read(read_end, 1 << 16):
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def _drain_after_stop(read_end: int, gw: Proc) -> str:
    """Read the pipe while the gateway stops (SIGTERM), until every writer has closed it."""
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: _read_all(read_end, chunks), daemon=True)
    reader.start()
    gw.stop()
    reader.join(30)
    return b"".join(chunks).decode(errors="replace")


def _read_all(fd: int, chunks: list[bytes]) -> None:
    while data := os.read(fd, 1 << 16):
        chunks.append(data)


def test_records_after_close_are_still_written_and_close_twice_is_harmless() -> None:
    stream = io.StringIO()
    logger, writer = _queue(stream, capacity=10)
    logger.info("before")
    writer.close()
    logger.info("after")  # e.g. a shutdown message once `serve` closed its log queue
    writer.close()
    assert [json.loads(line)["msg"] for line in stream.getvalue().splitlines()] == [
        "before",
        "after",
    ]
