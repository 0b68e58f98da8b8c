"""Finding 2 and checklist G1: a restart of `poolkeeper serve` under 50 streaming clients
fails no request. SIGTERM → readiness NOT_SERVING, Envoy stops accepting (new connections are
refused: a client or load balancer goes elsewhere, here: retries until the new gateway is up),
every accepted stream finishes, the process exits 0; a second gateway takes over the ports.

Each client opens a fresh connection per request (no keep-alive), the way a load balancer
in front of several gateway replicas spreads them; a refused connection is not a failed
request (nothing was sent), anything accepted and then cut, or not 200, is.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.support.gateway_files import gateway_ports, one_server_config
from tests.support.processes import Proc, listening_ports, poolkeeper, wait_for_text, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CLIENTS = 50
MODEL = "tiny-base"


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    refused: int = 0
    in_stream: int = 0


def _serve(directory: Path, ports: dict[str, int], workdir: Path) -> Proc:
    proc = poolkeeper(
        ["serve", "-f", str(directory), "--workdir", str(workdir), "--log-format", "text"],
        workdir.with_suffix(".log"),
    )
    wait_for_text(proc, "gateway ready on", timeout=60)
    wait_ready(ports["health"], proc, timeout=60)
    return proc


async def _client(url: str, tally: Tally, stop: asyncio.Event, failures: list[str]) -> None:
    body = {"model": MODEL, "prompt": "tell a story", "max_tokens": 60, "stream": True}
    timeout = aiohttp.ClientTimeout(total=120)
    while not stop.is_set():
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            try:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    tally.in_stream += 1
                    raw = await resp.read()
                    tally.in_stream -= 1
                    if resp.status == 200 and raw.rstrip().endswith(b"data: [DONE]"):
                        tally.ok += 1
                    else:
                        tally.failed += 1
                        failures.append(f"{resp.status} {raw[-200:]!r}")
            except aiohttp.ClientConnectorError:
                tally.refused += 1  # nothing sent: a balancer would pick another replica
                await asyncio.sleep(0.1)  # the fault's own back-off, not synchronisation
            except aiohttp.ClientError as exc:
                tally.in_stream = max(0, tally.in_stream - 1)
                tally.failed += 1
                failures.append(repr(exc))


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_restart_under_50_streaming_clients_fails_nothing(tmp_path: Path) -> None:
    sim = poolkeeper(
        ["sim", "--port", "0", "--model", MODEL, "--max-num-seqs", "128"],
        tmp_path / "sim.log",
    )
    ports = gateway_ports()
    tally, failures, stop = Tally(), list[str](), asyncio.Event()
    first = second = None
    tasks: list[asyncio.Task[None]] = []
    try:
        (sim_port,) = await asyncio.to_thread(listening_ports, sim, 1)
        directory = one_server_config(tmp_path / "config", ports, sim_port, MODEL)
        first = await asyncio.to_thread(_serve, directory, ports, tmp_path / "gw1")
        url = f"http://127.0.0.1:{ports['http']}"
        tasks = [asyncio.create_task(_client(url, tally, stop, failures)) for _ in range(CLIENTS)]
        await _until(lambda: tally.in_stream >= CLIENTS * 0.8 and tally.ok >= CLIENTS, 60)
        first.process.send_signal(signal.SIGTERM)  # streams are running right now
        code = await asyncio.to_thread(first.process.wait, 150)
        assert code == 0, first.log_text()[-2000:]
        assert "drain grace over" not in first.log_text()
        served_before = tally.ok
        second = await asyncio.to_thread(_serve, directory, ports, tmp_path / "gw2")
        await _until(lambda: tally.ok >= served_before + CLIENTS, 60)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for proc in (first, second, sim):
            if proc is not None:
                proc.stop()
    summary = json.dumps(tally.__dict__)
    print("restart under", CLIENTS, "streaming clients:", summary)
    assert tally.failed == 0, (summary, failures[:5])
    assert tally.ok >= 2 * CLIENTS, summary
