"""`poolkeeper sim` as a subprocess: serves N servers on consecutive ports, stops on Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.netutil import free_ports

pytestmark = pytest.mark.integration

# Bounds a hang only: `python -m poolkeeper sim` spends ~2 s of CPU importing before it serves,
# which a loaded 2-core machine stretches several times over.
SUBPROCESS_S = 60


async def start_sim(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "poolkeeper", "sim", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def read_until_serving(proc: asyncio.subprocess.Process) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(SUBPROCESS_S):
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise AssertionError(f"sim exited early: {lines}")
            lines.append(line.strip())
            if line.startswith("serving"):
                return lines


async def test_sim_serves_count_servers_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    port = free_ports(2, consecutive=True)[0]
    config = tmp_path / "fleet.yaml"
    config.write_text("servers:\n  - name: small\n    max_num_seqs: 8\n  - name: big\n")
    proc = await start_sim("--count", "2", "--port", str(port), "--config", str(config),
                           "--lora-adapters", "x,y", "--time-scale", "0.5")  # fmt: skip
    try:
        lines = await read_until_serving(proc)
        assert lines[0].startswith(f"small listening on http://127.0.0.1:{port} ")
        assert lines[1].startswith(f"big listening on http://127.0.0.1:{port + 1} ")
        async with aiohttp.ClientSession() as http:
            for offset, name, seqs in ((0, "small", 8), (1, "big", 256)):
                url = f"http://127.0.0.1:{port + offset}"
                body = {"model": "x", "prompt": "hello", "max_tokens": 3}
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 200
                    assert response.headers["x-sim-server"] == name
                    assert json.loads(await response.read())["model"] == "x"
                async with http.get(f"{url}/server_info") as response:
                    assert (await response.json())["max_num_seqs"] == seqs
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(SUBPROCESS_S):
            out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip().endswith("stopped")
    assert b"Traceback" not in err


async def test_bad_config_is_a_precise_error_not_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("defaults:\n  max_num_seqs: -1\n")
    proc = await start_sim("--config", str(config))
    async with asyncio.timeout(SUBPROCESS_S):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "bad.yaml: defaults.max_num_seqs: Input should be greater than or equal to 1" in (
        err.decode()
    )
    assert "Traceback" not in err.decode()


def test_sim_is_a_registered_command() -> None:
    from poolkeeper.cli import main

    assert "poolkeeper.cli.sim" in main.COMMAND_MODULES
