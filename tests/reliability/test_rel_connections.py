"""Round 2, finding 1: one client must not lock everyone out. A connection that sends nothing is
closed from accept, a body trickled a byte at a time cannot outlive the request timeout, the
overload manager's connection cap sits below the descriptor limit, idle connections near the
cap are closed within about a second, and a legitimate client on 127.0.0.1 is served while
attackers (127.0.0.2..) hold idle and slow-body connections.

The attackers' idle connections come from `connflood` processes (each has its own descriptor
limit). The default suite runs a scaled-down attack (hundreds of connections against a cap
scaled to match); the full size (25,000 idle + 500 slow-body, the issue's acceptance, against
the cap `serve` derives from this machine's descriptor limit) is `soak`-marked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import resource
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.envoy.params import FD_RESERVE, downstream_connection_cap
from poolkeeper.envoy.process import raise_descriptor_limit
from tests.reliability.memprobe import rss_mb
from tests.reliability.rel_harness import Gate, gate

pytestmark = pytest.mark.integration

CHAT = b'{"model":"m","messages":[]}'


async def _connect_from(source: str, port: int) -> socket.socket:
    """A TCP connection from `source` (a loopback alias: 127.0.0.0/8 is all local)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((source, 0))
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def _slow_body(port: int, source: str, every_s: float, until: asyncio.Event) -> float:
    """A request whose body arrives one byte every `every_s`; returns how long the gateway
    kept the connection (until it answered or closed it)."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    sock = await _connect_from(source, port)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "content-length: 100000\r\n\r\n"
    )
    try:
        await loop.sock_sendall(sock, head.encode())
        while not until.is_set():
            await loop.sock_sendall(sock, b" ")
            try:
                await asyncio.wait_for(loop.sock_recv(sock, 4096), every_s)
            except TimeoutError:
                continue
            break  # an answer (408) or a close: the gateway let go
    except OSError:
        pass
    finally:
        sock.close()
    return loop.time() - began


async def _legitimate(
    url: str, count: int, within_s: float, failed: list[str] | None = None
) -> list[float]:
    """`count` requests from 127.0.0.1, each retried on a refused connection until `within_s`;
    returns each one's time to a 200 (inf when none came in time). Failed attempts are noted
    in `failed` (when, what)."""
    loop = asyncio.get_running_loop()
    times: list[float] = []
    timeout = aiohttp.ClientTimeout(total=within_s)
    for _ in range(count):
        began = loop.time()
        took = float("inf")
        while loop.time() - began < within_s:
            try:
                async with (
                    aiohttp.ClientSession(timeout=timeout) as session,
                    session.post(url + "/v1/chat/completions", data=CHAT) as resp,
                ):
                    await resp.read()
                    if resp.status == 200:
                        took = loop.time() - began
                        break
            except (aiohttp.ClientError, TimeoutError) as exc:
                if failed is not None:
                    failed.append(f"{loop.time() - began:.3f} {type(exc).__name__}")
                await asyncio.sleep(0.05)
        times.append(took)
    return times


async def test_a_connection_that_sends_nothing_is_closed_from_accept(tmp_path: Path) -> None:
    """Envoy's header timer starts at the first byte, so the connection idle timer (armed at
    accept) is what closes a silent connection: it was an hour."""
    async with gate(tmp_path, connection_idle_timeout_s=1.0) as g:
        loop = asyncio.get_running_loop()
        sock = await _connect_from("127.0.0.2", g.port)
        began = loop.time()
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 1024), 10.0)
        except ConnectionError:
            data = b""
        finally:
            sock.close()
        assert data == b""  # closed, nothing said
        assert loop.time() - began < 5.0


async def test_a_trickled_body_cannot_outlive_the_request_timeout(tmp_path: Path) -> None:
    """Each byte reset the stream idle timer and there was no request timeout: held forever."""
    async with gate(tmp_path, request_timeout_s=2.0) as g:
        stop = asyncio.Event()
        held = await asyncio.wait_for(_slow_body(g.port, "127.0.0.2", 0.3, stop), 30.0)
        assert held < 6.0


async def test_the_connection_cap_sits_below_the_descriptor_limit() -> None:
    """The cap was 50,000 with Envoy at 20,000 descriptors: it never acted."""
    for descriptors in (1024, 4096, 20_000, 1 << 17):
        cap = downstream_connection_cap(descriptors)
        assert 2 * cap + FD_RESERVE <= max(descriptors, 2 * 64 + FD_RESERVE)
    soft_before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        granted = raise_descriptor_limit(soft_before)
        assert granted >= soft_before
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= soft_before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft_before, hard))


@contextlib.asynccontextmanager
async def _flood(port: int, idle: int, first_source: int, sources: int) -> AsyncIterator[int]:
    """`idle` silent connections held by `connflood` processes (at most 6,000 each, sources
    split between them); yields how many connects were started, once all were. On exit the
    processes let go; how many connections the gateway had closed is printed."""
    per = 6000
    procs: list[asyncio.subprocess.Process] = []
    shares = [min(per, idle - start) for start in range(0, idle, per)]
    each = max(1, sources // len(shares))
    for k, count in enumerate(shares):
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.reliability.connflood",
                str(port),
                str(count),
                str(first_source + k * each),
                str(each),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        )
    try:
        opened = 0
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            opened += int(line.split()[1])
        yield opened
    finally:
        closed = 0
        for proc in procs:
            assert proc.stdin is not None
            assert proc.stdout is not None
            proc.stdin.close()
            with contextlib.suppress(TimeoutError, IndexError, ValueError):
                closed += int((await asyncio.wait_for(proc.stdout.readline(), 60)).split()[1])
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        print(f"flood: {closed} closed by the gateway before the end")


async def _envoy_stats(g: Gate) -> dict[str, int]:
    names = (
        "http.gateway.downstream_cx_active",
        "http.gateway.downstream_cx_idle_timeout",
        "listener.admin.downstream_cx_total",
        "overload.envoy.overload_actions.reduce_timeouts.scale_percent",
    )
    url = f"http://127.0.0.1:{g.params.admin_port}/stats?format=json"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        stats = (await resp.json())["stats"]
    found = {s["name"]: s.get("value", 0) for s in stats if "name" in s}
    out = {name: int(found.get(name, 0)) for name in names}
    out["global_cx_overflow"] = sum(
        int(v) for k, v in found.items() if k.endswith("downstream_global_cx_overflow")
    )
    return out


async def _watch_envoy(g: Gate, peak: dict[str, float], stop: asyncio.Event) -> None:
    """Envoy's peak RSS (MB) and open descriptors while the attack runs."""
    assert g.envoy.process is not None
    pid = g.envoy.process.pid
    while not stop.is_set():
        with contextlib.suppress(OSError, ValueError):
            peak["fds"] = max(peak.get("fds", 0), len(os.listdir(f"/proc/{pid}/fd")))
            peak["rss_mb"] = max(peak.get("rss_mb", 0), rss_mb(pid))
        await asyncio.sleep(0.2)


async def _attack_and_serve(
    tmp_path: Path, *, idle: int, slow: int, sources: int, cap: int, **overrides: float
) -> list[float]:
    """Slow-body requests from 127.0.0.2.., then `idle` silent connections from 127.0.0.20..
    held by flood processes; once every connect was started, 20 requests from 127.0.0.1."""
    async with gate(tmp_path, max_downstream_connections=cap, **overrides) as g:  # type: ignore[arg-type]
        stop, began = asyncio.Event(), time.monotonic()
        peak: dict[str, float] = {}
        watcher = asyncio.create_task(_watch_envoy(g, peak, stop))
        slow_tasks = [
            asyncio.create_task(_slow_body(g.port, f"127.0.0.{2 + i % 16}", 1.0, stop))
            for i in range(slow)
        ]
        try:
            async with _flood(g.port, idle, 20, sources) as opened:
                flooded = time.monotonic()
                at_flood = await _envoy_stats(g)
                failed: list[str] = []
                times = await _legitimate(g.url, 20, within_s=2.0, failed=failed)
                after = await _envoy_stats(g)
        finally:
            stop.set()
            await asyncio.gather(*slow_tasks, return_exceptions=True)
            await watcher
        held = sum(1 for t in slow_tasks if t.done() and not t.cancelled())
        print(
            "connection attack:",
            json.dumps(
                {
                    "cap": cap,
                    "idle_started": opened,
                    "slow_body": slow,
                    "slow_body_ended": held,
                    "flood_s": round(flooded - began, 1),
                    "legit_s": [round(t, 3) if math.isfinite(t) else None for t in times],
                    "legit_failed_attempts": failed[:20],
                    "envoy_at_flood": at_flood,
                    "envoy_after": after,
                    "envoy_peak": peak,
                }
            ),
        )
        return times


BOUND_S = 15.0


async def test_idle_connections_near_the_cap_close_within_a_second(tmp_path: Path) -> None:
    """The overload manager shortens the idle timeout as connections near the cap: 95 silent
    connections against a cap of 100 are closed within seconds though the idle timeout is
    30 s (before: held 10 s by the listener's accept timeout, and the cap with them).
    About a second on an idle machine; the bound (15 s) leaves room for a loaded one (8 s
    once failed at load 20) and stays well clear of the 30 s they would be held without it."""
    async with gate(tmp_path, max_downstream_connections=100, connection_idle_timeout_s=30.0) as g:
        loop = asyncio.get_running_loop()
        socks = [await _connect_from("127.0.0.2", g.port) for _ in range(95)]
        began = loop.time()
        try:
            for sock in socks:
                remaining = max(0.1, began + BOUND_S - loop.time())
                with contextlib.suppress(ConnectionError):
                    assert await asyncio.wait_for(loop.sock_recv(sock, 16), remaining) == b""
        finally:
            for sock in socks:
                sock.close()
        assert loop.time() - began < BOUND_S


async def test_idle_and_slow_body_connections_do_not_lock_out_a_client(tmp_path: Path) -> None:
    """Scaled down, default timeouts: 400 idle + 30 slow-body connections held by attackers
    against a cap of 250; the legitimate client gets 200 for 20 of 20 within 2 s each."""
    times = await _attack_and_serve(tmp_path, idle=400, slow=30, sources=8, cap=250)
    assert all(t <= 2.0 for t in times), times


@pytest.mark.soak
async def test_25000_idle_and_500_slow_body_connections_do_not_lock_out_a_client(
    tmp_path: Path,
) -> None:
    """The issue's acceptance at full size, with the cap `serve` derives from the descriptor
    limit it raises: Envoy holds what its descriptors allow and closes the rest (at accept
    over the cap, idle ones within about a second near it)."""
    descriptors = raise_descriptor_limit()
    cap = min(50_000, downstream_connection_cap(descriptors))
    assert 2 * cap + FD_RESERVE <= max(descriptors, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    times = await _attack_and_serve(tmp_path, idle=25_000, slow=500, sources=100, cap=cap)
    assert all(t <= 2.0 for t in times), times


async def test_requests_are_refused_when_envoys_heap_is_full(tmp_path: Path) -> None:
    """Held requests cost memory in Envoy and the EPP, and nothing bounded Envoy's heap: now
    above 95 % of its heap limit new requests get 503 before any filter runs (here the limit
    is set below what Envoy already uses)."""
    async with gate(tmp_path, heap_limit_bytes=2 << 20) as g:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while True:  # the overload manager samples the heap every 0.25 s
            turns = g.router.turn
            async with (
                aiohttp.ClientSession() as session,
                session.post(g.url + "/v1/chat/completions", data=CHAT) as resp,
            ):
                text = await resp.text()
                if resp.status == 503 or loop.time() > deadline:
                    break
            await asyncio.sleep(0.1)
        assert resp.status == 503, text
        assert "overloaded" in text
        assert g.router.turn == turns  # the EPP was not asked
