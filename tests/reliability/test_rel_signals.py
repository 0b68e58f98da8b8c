"""Ctrl-C in a terminal stops `poolkeeper serve` the way SIGTERM does, and Envoy never
outlives it.

A terminal sends Ctrl-C's SIGINT (and SIGHUP when it closes) to its whole foreground process
group. Envoy used to be in `serve`'s group, so the keystroke stopped Envoy at once: the stream
in flight was cut before `serve` could drain, and the supervisor logged "envoy exited ...;
restarting". Now Envoy runs in a session of its own (`envoy/tether.py`): the signal reaches
`serve` only, which drains Envoy's listeners, waits for the stream, stops Envoy and exits 0.
And because Envoy is no longer in the group a shell would kill, it dies with `serve` (Linux's
parent-death signal): a SIGKILLed `serve` leaves no Envoy behind holding the gateway's ports.

`serve` runs as a subprocess in a process group of its own, as a shell starts a job; the
simulated model server runs in the test's process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.tokens import count_tokens
from tests.support.gateway_files import gateway_ports, one_pool
from tests.support.processes import (
    STARTUP_S,
    Proc,
    poolkeeper,
    wait_for_text,
    wait_ready,
)
from tests.support.sim_gateway import MODEL, sim_server
from tests.support.waiting import until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; prctl"),
    # One `serve` start per test, which a loaded 2-core machine stretches to a minute or more.
    pytest.mark.timeout(300),
]

TOKENS = 400  # the simulator's real-time steps make this a stream of a few seconds


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait() is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _envoy_of(gateway: Proc) -> int:
    (pid,) = gateway.children()  # serve's one child process
    assert Path(f"/proc/{pid}/comm").read_text().strip().startswith("envoy")
    return pid


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) != 0


async def _start_serve(
    tmp_path: Path, sim_port: int, event_loop: str = "uvloop"
) -> tuple[Proc, dict[str, int]]:
    ports = gateway_ports()
    config = one_pool(tmp_path / "cfg", sim_port, ports=ports)
    args = ["serve", "-f", str(config), "--workdir", str(tmp_path / "env")]
    gateway = poolkeeper(
        [*args, "--drain-grace", "60", "--log-format", "text", "--event-loop", event_loop],
        tmp_path / "serve.log",
        own_group=True,
    )
    await asyncio.to_thread(wait_for_text, gateway, "gateway ready on")
    await asyncio.to_thread(wait_ready, ports["health"], gateway)
    return gateway, ports


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hang-up"])
async def test_a_terminals_signal_to_the_group_drains_and_leaves_no_envoy(
    tmp_path: Path, sig: signal.Signals
) -> None:
    async with sim_server() as sim_port:
        gateway, ports = await _start_serve(tmp_path, sim_port)
        envoy = _envoy_of(gateway)
        try:
            assert os.getpgid(envoy) != gateway.process.pid  # not in the job's group
            body = {"model": MODEL, "prompt": "a story", "max_tokens": TOKENS, "stream": True}
            url = f"http://127.0.0.1:{ports['http']}/v1/completions"
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
                session.post(url, json=body) as resp,
            ):
                assert resp.status == 200
                raw = await resp.content.readuntil(b"\n\n")  # the first event: in flight
                os.killpg(gateway.process.pid, sig)  # what the terminal does
                raw += await resp.content.read()
            # The stream in flight finished whole.
            assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
            text = "".join(
                json.loads(line[6:])["choices"][0]["text"]
                for line in raw.decode().splitlines()
                if line.startswith("data: {")
            )
            assert count_tokens(text) == TOKENS
            code = await asyncio.to_thread(gateway.process.wait, STARTUP_S)
            log = gateway.log_text()
            assert code == 0, log[-3000:]
            assert "restarting" not in log, log[-3000:]
            assert "drain grace over" not in log, log[-3000:]
            await until(lambda: not _alive(envoy), "envoy gone after serve exited")
            assert _refused(ports["http"])
        finally:
            gateway.stop(signal.SIGKILL)
            if _alive(envoy):  # only if the test failed: never leave one behind
                os.kill(envoy, signal.SIGKILL)


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])  # each spawns Envoy its own way
async def test_a_killed_serve_takes_its_envoy_with_it(tmp_path: Path, event_loop: str) -> None:
    async with sim_server() as sim_port:
        gateway, ports = await _start_serve(tmp_path, sim_port, event_loop)
        envoy = _envoy_of(gateway)
        try:
            gateway.process.kill()  # no handler runs: nothing of serve's stops Envoy
            await asyncio.to_thread(gateway.process.wait, STARTUP_S)
            await until(lambda: not _alive(envoy), "envoy gone after serve was killed")
            await until(lambda: _refused(ports["http"]), "the gateway's port free")
        finally:
            gateway.stop(signal.SIGKILL)
            if _alive(envoy):
                os.kill(envoy, signal.SIGKILL)


def _demo(log_path: Path) -> Proc:
    """`poolkeeper quickstart`, a short one, in a process group of its own (a shell's job)."""
    log = log_path.open("wb")
    command = [sys.executable, "-m", "poolkeeper", "quickstart", "--requests", "20"]
    process = subprocess.Popen(
        [*command, "--concurrency", "4"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        process_group=0,
    )
    return Proc(process, log_path, log)


async def test_ctrl_c_stops_the_demo_and_its_envoy(tmp_path: Path) -> None:
    """`make demo` (`poolkeeper quickstart`), as the README has newcomers run and stop it: its
    simulators run in its own process, so Envoy is its one child, tied the same way."""
    demo = _demo(tmp_path / "demo.log")
    envoy = 0
    try:
        await asyncio.to_thread(wait_for_text, demo, "Serving until Ctrl-C")
        envoy = _envoy_of(demo)
        os.killpg(demo.process.pid, signal.SIGINT)
        code = await asyncio.to_thread(demo.process.wait, STARTUP_S)
        assert code == 0, demo.log_text()[-3000:]
        assert "restarting" not in demo.log_text()
        await until(lambda: not _alive(envoy), "envoy gone after the demo exited")
    finally:
        demo.stop(signal.SIGKILL)
        if envoy and _alive(envoy):
            os.kill(envoy, signal.SIGKILL)
