"""Round 2, finding 1 (the part left open): a per-client-address connection cap.

`spec.edge.maxConnectionsPerClient` connections per address, counted by the `serve` process
for its Envoy (network ext_authz on a connection's first bytes, the listener's TCP access log
at its close: envoy/conncap.py, extproc/conncap.py). Real parts: `GatewayRuntime` with its
managed Envoy and a simulated model server, clients on 127.0.0.1 and 127.0.0.2."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from poolkeeper.controller.files import file_source
from poolkeeper.extproc.conncap import ConnectionCounter
from poolkeeper.server.runtime import GatewayRuntime, ServeOptions
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.sim.server import SimCluster
from tests.support.gateway_files import one_pool

MODEL = "m"
LIMIT = 3
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


def test_counts_per_address_and_frees_on_close() -> None:
    counter = ConnectionCounter(2)
    assert counter.opened("10.0.0.1", 1000)
    assert counter.opened("10.0.0.1", 1001)
    assert not counter.opened("10.0.0.1", 1002)  # the third from one address
    assert counter.opened("10.0.0.2", 1000)  # another address is not affected
    counter.closed("10.0.0.1", 1002)  # a refused connection's close: never counted
    counter.closed("10.0.0.9", 5)  # a silent connection's close: never counted
    assert counter.exported() == (3, 2, 1, 0)
    counter.closed("10.0.0.1", 1000)
    assert counter.opened("10.0.0.1", 1003)
    for port in (1001, 1003):
        counter.closed("10.0.0.1", port)
    counter.closed("10.0.0.2", 1000)
    assert counter.exported() == (0, 0, 1, 0)  # no address left behind


def test_the_table_is_bounded_and_a_lost_log_stream_fails_open() -> None:
    counter = ConnectionCounter(5, max_tracked=4)
    for port in range(8):
        assert counter.opened(f"10.0.0.{port}", port)  # past the table: let in, uncounted
    assert counter.exported() == (4, 4, 0, 4)
    counter.clear()  # Envoy's log stream ended: closes may be lost, nobody stays locked out
    assert counter.exported() == (0, 0, 0, 4)


def _config(tmp_path: Path, sim_port: int) -> Path:
    """One pool over the simulator, every listener on 0.0.0.0 (clients come from 127.0.0.x),
    the per-client cap at LIMIT."""
    edge = f"  edge: {{maxConnectionsPerClient: {LIMIT}}}\n"
    return one_pool(tmp_path / "cfg", sim_port, model=MODEL, spec=edge, address="0.0.0.0")


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _request(port: int, source: str, conn: Conn | None = None) -> tuple[bytes, Conn]:
    """One keep-alive chat request from `source`, on `conn` or a new connection; returns the
    status line (b"" if the connection was closed without an answer) and the connection."""
    if conn is None:
        conn = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    reader, writer = conn
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(CHAT), CHAT)
    )
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    except (asyncio.IncompleteReadError, ConnectionError):
        return b"", conn
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0], conn


async def _until(predicate: object, what: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


@pytest.mark.integration
async def test_the_connection_over_the_cap_is_refused_and_others_are_served(
    tmp_path: Path,
) -> None:
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings(model=MODEL, step_jitter=0.0)))
    (sim,) = await cluster.start()
    runtime = GatewayRuntime(ServeOptions(source=file_source([_config(tmp_path, sim.port)])))
    await runtime.start()
    held: list[Conn] = []
    try:
        assert runtime.config is not None
        assert runtime.conncap is not None
        assert runtime.metrics is not None
        port = runtime.config.spec.listeners.http
        for _ in range(LIMIT):  # LIMIT keep-alive connections from 127.0.0.2, held open
            status, conn = await _request(port, "127.0.0.2")
            assert status == b"HTTP/1.1 200 OK", status
            held.append(conn)
        status, refused = await _request(port, "127.0.0.2")
        assert status == b"", status  # closed on its first bytes, nothing answered
        refused[1].close()
        for _ in range(3):  # another client is served meanwhile, and the held ones still are
            status, conn = await _request(port, "127.0.0.1")
            assert status == b"HTTP/1.1 200 OK", status
            conn[1].close()
        status, _ = await _request(port, "127.0.0.2", held[0])
        assert status == b"HTTP/1.1 200 OK", status
        page = runtime.metrics.render().decode()
        assert "poolkeeper_client_connections_refused_total 1.0" in page

        # A held connection closes: its address may connect again once Envoy's log says so.
        held.pop(0)[1].close()
        counter = runtime.conncap
        await _until(lambda: counter.exported()[0] == LIMIT - 1, "the close reported")
        status, conn = await _request(port, "127.0.0.2")
        assert status == b"HTTP/1.1 200 OK", status
        held.append(conn)

        # Fail open: with the counter gone, Envoy lets connections in (its check fails).
        for server in runtime._grpc_servers[-1:]:  # the counter, started with Envoy
            await server.stop(None)
        status, conn = await _request(port, "127.0.0.2")
        assert status == b"HTTP/1.1 200 OK", status
        held.append(conn)
    finally:
        for _reader, writer in held:
            writer.close()
        await runtime.stop(grace_s=0)
        await cluster.stop()
