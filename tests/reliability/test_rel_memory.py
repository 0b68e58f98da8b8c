"""Finding 3 (checklist E4): hostile bodies cost bounded memory. Concurrent 17 MB bodies,
declared (Content-Length) and chunked (no length), against `poolkeeper serve` with its Envoy;
every one is refused (413 early, or 413/503 once the per-request limit or the EPP's in-flight
budget is passed), and the EPP's RSS afterwards stays within 50 MB of idle (Envoy's: see the
soak version).

The CI version sends 10 bodies of each kind; `make soak` sends the headline's 50.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.netutil import free_ports
from tests.e2e.e2e_harness import (
    POOL,
    gateway_doc,
    gateway_ports,
    model_doc,
    poolkeeper,
    wait_for_port,
    write_config,
)
from tests.reliability.memprobe import children, rss_mb
from tests.reliability.test_rel_restart import _serve

BODY_MB = 17
CHUNK = b"x" * (1 << 20)


async def _one(port: int, chunked: bool) -> int:
    """One hostile request on a raw socket; the status it got (0: connection closed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
    start = b'{"model": "tiny-base", "prompt": "'
    if chunked:
        head += b"transfer-encoding: chunked\r\n\r\n"
    else:
        head += f"content-length: {len(start) + BODY_MB * len(CHUNK)}\r\n\r\n".encode()

    async def send() -> None:
        writer.write(head)
        for piece in (start, *([CHUNK] * BODY_MB)):
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        line = await asyncio.wait_for(reader.readline(), 120)
        parts = line.split()
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    except (ConnectionError, TimeoutError):
        return 0
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()


async def _attack(port: int, n: int) -> list[int]:
    return list(await asyncio.gather(*(_one(port, bool(i % 2)) for i in range(n))))


async def _measure(tmp_path: Path, n: int) -> dict[str, float]:
    (sim_port,) = free_ports(1)
    sim = poolkeeper(["sim", "--port", str(sim_port), "--model", "tiny-base"], tmp_path / "s.log")
    ports = gateway_ports()
    docs = [
        gateway_doc(ports, [("tiny-0", sim_port, "tiny")]),
        POOL.format(name="tiny", app="tiny", failure_mode="FailClose"),
        model_doc("tiny-base", "tiny", "Critical"),
    ]
    directory = write_config(tmp_path / "config", docs)
    gw = None
    try:
        wait_for_port(sim_port, sim)
        gw = await asyncio.to_thread(_serve, directory, ports, tmp_path / "gw")
        url = f"http://127.0.0.1:{ports['http']}"
        (envoy,) = children(gw.process.pid)
        body = {"model": "tiny-base", "prompt": "hi", "max_tokens": 2}
        async with (
            aiohttp.ClientSession() as session,  # warm: one ordinary request
            session.post(f"{url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
        idle = {"epp": rss_mb(gw.process.pid), "envoy": rss_mb(envoy)}
        statuses = await _attack(ports["http"], n)
        assert all(s in (0, 413, 503) for s in statuses), statuses
        assert statuses.count(0) < n  # most get an answer, not just a closed connection
        # Envoy gives free heap back on its overload manager's 10 s shrink_heap cycle: poll
        # (up to 30 s) until both are near idle, then report what they are at.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while loop.time() < deadline:
            after = {"epp": rss_mb(gw.process.pid), "envoy": rss_mb(envoy)}
            if all(after[k] - idle[k] < 50 for k in after):
                break
            await asyncio.sleep(0.5)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{ports['admin']}/memory") as resp,
        ):
            print("envoy /memory", await resp.text())
        async with (
            aiohttp.ClientSession() as session,  # still serving
            session.post(f"{url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
        return {
            "idle_epp": idle["epp"],
            "idle_envoy": idle["envoy"],
            "after_epp": after["epp"],
            "after_envoy": after["envoy"],
        }
    finally:
        if gw is not None:
            gw.stop()
        sim.stop()


def _report(n: int, figures: dict[str, float]) -> str:
    return (
        f"{n} x {BODY_MB} MB rejected: EPP {figures['idle_epp']:.0f} -> "
        f"{figures['after_epp']:.0f} MB, Envoy {figures['idle_envoy']:.0f} -> "
        f"{figures['after_envoy']:.0f} MB"
    )


@pytest.mark.e2e
@pytest.mark.timeout(240)
async def test_rejected_big_bodies_leave_memory_near_idle(tmp_path: Path) -> None:
    n = int(os.environ.get("POOLKEEPER_MEMORY_BODIES", "10"))
    figures = await _measure(tmp_path, n)
    print(_report(n, figures))
    assert figures["after_epp"] - figures["idle_epp"] < 50, _report(n, figures)
    assert figures["after_envoy"] - figures["idle_envoy"] < 50, _report(n, figures)


@pytest.mark.soak
@pytest.mark.timeout(600)
async def test_headline_50_rejected_17mb_bodies(tmp_path: Path) -> None:
    figures = await _measure(tmp_path, 50)
    print(_report(50, figures))
    assert figures["after_epp"] - figures["idle_epp"] < 50, _report(50, figures)
    # Envoy: its 1 MiB per-connection buffers x 50 leave tcmalloc free pages (allocated falls
    # back to ~7 MB; shrink_heap gives part back): measured +55-65 MB (docs/reliability.md).
    assert figures["after_envoy"] - figures["idle_envoy"] < 100, _report(50, figures)
