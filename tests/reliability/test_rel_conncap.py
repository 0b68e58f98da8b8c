"""Round 2, finding 1 (the part left open): a per-client-address connection cap.

`spec.edge.maxConnectionsPerClient` connections per address, counted by the `serve` process
for its Envoy (network ext_authz on a connection's first bytes, the listener's TCP access log
at its close: envoy/conncap.py, extproc/conncap.py). Real parts: `GatewayRuntime` with its
managed Envoy and a simulated model server, clients on 127.0.0.1 and 127.0.0.2."""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
from envoy.service.auth.v3 import external_auth_pb2 as auth_pb2

from poolkeeper.controller.files import file_source
from poolkeeper.extproc.conncap import GONE_TTL_S, ConnectionCounter
from poolkeeper.extproc.conncap_service import ConnectionCapService
from poolkeeper.extproc.tcpdiag import _read_dump, connection_open, peers_that_sent
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.own_loop import OwnLoopServer
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet
from tests.support.gateway_files import one_pool
from tests.support.keepalive import Conn, chat_from

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


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_a_check_that_arrived_before_its_connections_close_is_not_counted() -> None:
    """The check of a connection that reset at once can be handled after the close was
    reported (two gRPC streams): counted then, it stayed in the table for good."""
    clock = _Clock()
    counter = ConnectionCounter(1, clock=clock)
    counter.closed("10.0.0.1", 5000, at=999.9)  # reported first: not in the table yet
    assert counter.closed_unknown("10.0.0.1", 5000) == 999.9
    assert counter.opened("10.0.0.1", 5000, arrived=999.8)  # its own check, handled late
    assert counter.counts().open == 0
    assert counter.counts().late == 1
    assert counter.opened("10.0.0.1", 5001, arrived=1_000.0)  # the address is not locked out
    assert counter.counts().open == 1


def test_reusing_a_closed_connections_port_does_not_pass_the_cap() -> None:
    clock = _Clock()
    counter = ConnectionCounter(1, clock=clock)
    assert counter.opened("10.0.0.1", 5000, arrived=999.0)
    assert not counter.opened("10.0.0.1", 6000, arrived=999.1)  # over the cap
    counter.closed("10.0.0.1", 6000, at=999.2)  # the refused one's close
    counter.closed("10.0.0.1", 7000, at=999.3)  # a silent one's close (never checked)
    # New connections from those ports send their first bytes after the close: counted.
    assert not counter.opened("10.0.0.1", 6000, arrived=999.25)
    assert not counter.opened("10.0.0.1", 7000, arrived=999.35)
    assert counter.counts().late == 0
    # And without a known arrival time a check always counts (as before).
    counter.closed("10.0.0.1", 8000, at=999.9)
    assert not counter.opened("10.0.0.1", 8000)


def test_the_kernel_is_asked_without_holding_the_table() -> None:
    """The kernel query (a sock_diag round trip) must not hold the counter's lock: closes and
    other checks, from Envoy's log stream and the check service's thread, go on meanwhile."""
    counter = ConnectionCounter(1, clock=_Clock())
    counter.closed("10.0.0.1", 6000, at=999.0)  # a close whose check is still to come
    other_finished: list[bool] = []

    def still_open() -> bool:
        other = threading.Thread(target=counter.counts)  # takes the lock
        other.start()
        other.join(timeout=5)  # never finishes while the caller holds the lock
        other_finished.append(not other.is_alive())
        return False  # the kernel says: closed

    assert counter.opened("10.0.0.1", 6000, still_open=still_open)
    assert other_finished == [True]  # the other reader got the lock while the kernel was asked
    assert counter.counts().late == 1  # and the late check was not counted


def test_remembered_closes_are_bounded_in_number_and_time() -> None:
    clock = _Clock()
    counter = ConnectionCounter(5, max_gone=2, clock=clock)
    for port in (1, 2, 3):
        counter.closed("10.0.0.1", port, at=clock.now)
    assert counter.closed_unknown("10.0.0.1", 1) is None  # the oldest, past the bound
    assert counter.closed_unknown("10.0.0.1", 3) == clock.now
    clock.now += GONE_TTL_S + 1
    counter.closed("10.0.0.2", 1, at=clock.now)
    assert counter.closed_unknown("10.0.0.1", 2) is None  # expired
    assert counter.closed_unknown("10.0.0.1", 3) is None


class _Context:
    def __init__(self, remaining: float | None, cancelled: bool = False) -> None:
        self.remaining, self.was_cancelled = remaining, cancelled

    def time_remaining(self) -> float | None:
        return self.remaining

    def cancelled(self) -> bool:
        return self.was_cancelled


def _check(ip: str, port: int) -> auth_pb2.CheckRequest:
    request = auth_pb2.CheckRequest()
    request.attributes.source.address.socket_address.address = ip
    request.attributes.source.address.socket_address.port_value = port
    return request


async def test_a_check_past_its_deadline_or_cancelled_is_not_counted() -> None:
    clock = _Clock()
    counter = ConnectionCounter(1, clock=clock)
    service = ConnectionCapService(counter, check_timeout_s=0.25)

    async def check(port: int, context: _Context) -> bool:
        reply = await service.Check(_check("10.0.0.1", port), cast(Any, context))
        return bool(reply.status.code == 0)

    assert await check(1, _Context(remaining=0.0))  # Envoy let it in uncounted
    assert await check(2, _Context(remaining=0.2, cancelled=True))  # Envoy closed it
    assert counter.counts().open == 0
    assert counter.counts().late == 2
    counter.closed("10.0.0.1", 3, at=clock.now - 0.01)
    assert await check(3, _Context(remaining=0.2))  # arrived 50 ms ago: before the close
    assert counter.counts().open == 0
    counter.closed("10.0.0.1", 4, at=clock.now - 0.1)
    assert await check(4, _Context(remaining=0.2))  # arrived after that close: counted
    assert counter.counts().open == 1
    assert not await check(5, _Context(remaining=0.2))  # and the cap holds


async def test_a_check_delayed_past_its_connections_close_asks_the_kernel() -> None:
    """Round 4: a check that arrived after a close from its address and port is the closed
    connection's own (delayed on its way: counted, it was a phantom for good) or a new
    connection's from the reused port: the kernel tells which."""
    clock = _Clock()
    counter = ConnectionCounter(1, clock=clock)
    open_now: dict[tuple[str, int], bool | None] = {}
    asked: list[tuple[tuple[str, int], tuple[str, int]]] = []

    def lookup(local: tuple[str, int], remote: tuple[str, int]) -> bool | None:
        asked.append((local, remote))
        return open_now.get(remote)

    service = ConnectionCapService(counter, check_timeout_s=0.25, lookup=lookup)

    async def check(port: int) -> bool:
        request = _check("10.0.0.1", port)
        request.attributes.destination.address.socket_address.address = "10.9.9.9"
        request.attributes.destination.address.socket_address.port_value = 8080
        reply = await service.Check(request, cast(Any, _Context(remaining=0.2)))
        return bool(reply.status.code == 0)

    assert await check(1)  # no close remembered: counted, the kernel not asked
    assert (counter.counts().open, asked) == (1, [])
    counter.closed("10.0.0.1", 1)
    counter.closed("10.0.0.1", 2, at=clock.now - 0.1)  # closed after its check was sent ...
    open_now[("10.0.0.1", 2)] = False
    assert await check(2)  # ... which arrived 50 ms after the close: not counted
    assert asked == [(("10.9.9.9", 8080), ("10.0.0.1", 2))]
    assert (counter.counts().open, counter.counts().late) == (0, 1)
    counter.closed("10.0.0.1", 3, at=clock.now - 0.1)
    open_now[("10.0.0.1", 3)] = True  # a new connection from the reused port
    assert await check(3)
    assert counter.counts().open == 1
    assert not await check(4)  # the cap holds
    counter.closed("10.0.0.1", 3)
    counter.closed("10.0.0.1", 5, at=clock.now - 0.1)
    open_now[("10.0.0.1", 5)] = None  # the kernel cannot tell: counted, as before
    assert await check(5)
    assert counter.counts().open == 1


async def test_a_late_check_of_an_open_connection_is_counted_over_the_limit() -> None:
    """A check Envoy gave up on (timeout: it let the connection in) is counted while the
    kernel says the connection is open, over the limit too, so connections let in by late
    checks do not pile up uncounted: the address's next connection is refused until one
    closes. Closed, or the kernel unable to tell: not counted (no phantom)."""
    clock = _Clock()
    counter = ConnectionCounter(1, clock=clock)
    open_now: dict[int, bool | None] = {}
    service = ConnectionCapService(
        counter, check_timeout_s=0.25, lookup=lambda _here, there: open_now.get(there[1])
    )

    async def check(port: int, context: _Context) -> bool:
        request = _check("10.0.0.1", port)
        request.attributes.destination.address.socket_address.address = "10.9.9.9"
        request.attributes.destination.address.socket_address.port_value = 8080
        reply = await service.Check(request, cast(Any, context))
        return bool(reply.status.code == 0)

    assert await check(1, _Context(remaining=0.2))  # on time: counted, the address is full
    open_now[2] = True
    assert await check(2, _Context(remaining=0.0))  # late, Envoy let it in: over the limit
    open_now[3] = False
    assert await check(3, _Context(remaining=0.1, cancelled=True))  # late and closed
    open_now[4] = None
    assert await check(4, _Context(remaining=0.0))  # late, the kernel cannot tell
    counts = counter.counts()
    assert (counts.open, counts.late, counts.late_counted) == (2, 3, 1)
    counter.closed("10.0.0.1", 1)
    assert not await check(5, _Context(remaining=0.2))  # still at the limit: refused
    counter.closed("10.0.0.1", 2)  # the late one's close frees its place
    assert await check(6, _Context(remaining=0.2))
    assert counter.counts().open == 1


def test_the_kernels_list_counts_connections_let_in_uncounted_and_drops_phantoms() -> None:
    """Round 7: a connection whose check timed out was let in by Envoy and, with grpc dropping
    the cancelled call, never counted. The kernel's list of open connections that have sent
    bytes, taken every check deadline plus 0.5 s, names it: missing from the table in two lists
    in a row, it is counted. A table entry in neither of two lists is a phantom: forgotten."""
    clock = _Clock()
    counter = ConnectionCounter(2, clock=clock)
    assert counter.opened("10.0.0.1", 1)
    assert counter.opened("10.0.0.1", 9)  # a phantom: its close never reported
    sent = {("10.0.0.1", 1), ("10.0.0.1", 2), ("10.0.0.1", 3), ("10.0.0.1", 4)}
    counter.reconcile(sent)  # 2, 3, 4 may still have their checks on the way: not yet
    assert counter.counts().open == 2
    counter.closed("10.0.0.1", 4)  # 4's close reported (not in the table): remembered
    counter.reconcile(sent - {("10.0.0.1", 3)})  # 3 closed meanwhile
    counts = counter.counts()
    assert (counts.open, counts.reconciled, counts.phantoms) == (2, 1, 1)  # 1 and 2, over 9
    assert not counter.opened("10.0.0.1", 5)  # the address holds its 2
    counter.closed("10.0.0.1", 2)
    assert counter.opened("10.0.0.1", 5)
    counter.clear()
    counter.reconcile({("10.0.0.2", 1)})
    counter.reconcile({("10.0.0.2", 1)})  # two lists since the reset
    assert counter.counts().open == 1


def test_the_kernel_lists_the_connections_that_have_sent_bytes() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("sock_diag is Linux's")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        silent = socket.create_connection(("127.0.0.1", port))
        talker = socket.socket()
        talker.bind(("127.0.0.3", 0))
        talker.connect(("127.0.0.1", port))
        ours = [listener.accept()[0], listener.accept()[0]]
        talker.sendall(b"hello")
        peer = talker.getsockname()
        for _ in range(100):
            if peers_that_sent(port) == {peer}:
                break
            time.sleep(0.01)
        assert peers_that_sent(port) == {peer}  # the silent one is not listed
        talker.close()
        ours[0].close()
        ours[1].close()  # closed here: not open any more
        assert peers_that_sent(port) == set()
        silent.close()


def test_a_kernel_list_without_bytes_received_is_no_list() -> None:
    """A kernel before 4.1 gives no tcpi_bytes_received: such a list would name no connection,
    and the counter would forget every one it holds as a phantom. It is taken as no list."""

    class _Reply:
        def __init__(self, port: int) -> None:
            diag = bytearray(72)
            diag[0] = socket.AF_INET
            struct.pack_into("!HH", diag, 4, port, 40000)
            message = struct.pack("=IHHII", 16 + 72, 20, 2, 1, 0) + bytes(diag)
            self.data = message + struct.pack("=IHHII", 20, 3, 2, 1, 0) + b"\0" * 4

        def recv(self, _size: int) -> bytes:
            return self.data

    peers: set[tuple[str, int]] = set()
    assert _read_dump(cast(Any, _Reply(8080)), 8080, peers) is False
    assert _read_dump(cast(Any, _Reply(8081)), 8080, peers) is True  # another port: skipped
    assert peers == set()


def test_the_kernel_knows_which_connections_are_open() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("sock_diag is Linux's")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        here = listener.getsockname()
        client = socket.create_connection(here)
        there = client.getsockname()
        accepted, _ = listener.accept()
        assert connection_open(here, there) is True
        assert connection_open(here, ("127.0.0.1", 1)) is False  # no such connection
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset
        for _ in range(100):
            if connection_open(here, there) is False:
                break
            time.sleep(0.01)
        assert connection_open(here, there) is False  # reset: gone, its fd still open here
        accepted.close()
        assert connection_open(here, there) is False
        assert connection_open(("not an address", 1), there) is None


def _config(tmp_path: Path, sim_port: int) -> Path:
    """One pool over the simulator, every listener on 0.0.0.0 (clients come from 127.0.0.x),
    the per-client cap at LIMIT."""
    edge = f"  edge: {{maxConnectionsPerClient: {LIMIT}}}\n"
    return one_pool(tmp_path / "cfg", sim_port, model=MODEL, spec=edge, address="0.0.0.0")


async def _until(predicate: object, what: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


@asynccontextmanager
async def _gateway(tmp_path: Path, held: list[Conn]) -> AsyncIterator[GatewayRuntime]:
    """`serve`'s runtime (real Envoy, the connection cap on) in front of one simulated server;
    on the way out the test's `held` connections are closed and everything stops at once."""
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings(model=MODEL, step_jitter=0.0)))
    (sim,) = await cluster.start()
    runtime = GatewayRuntime(ServeOptions(source=file_source([_config(tmp_path, sim.port)])))
    try:
        await runtime.start()
        yield runtime
    finally:
        for _reader, writer in held:
            writer.close()
        await runtime.stop(grace_s=0)
        await cluster.stop()


@pytest.mark.integration
async def test_the_connection_over_the_cap_is_refused_and_others_are_served(
    tmp_path: Path,
) -> None:
    held: list[Conn] = []
    async with _gateway(tmp_path, held) as runtime:
        assert runtime.config is not None
        assert runtime.conncap is not None
        assert runtime.metrics is not None
        port = runtime.config.spec.listeners.http
        for _ in range(LIMIT):  # LIMIT keep-alive connections from 127.0.0.2, held open
            status, conn = await chat_from(port, "127.0.0.2", CHAT)
            assert status == b"HTTP/1.1 200 OK", status
            held.append(conn)
        status, refused = await chat_from(port, "127.0.0.2", CHAT)
        assert status == b"", status  # closed on its first bytes, nothing answered
        refused[1].close()
        for _ in range(3):  # another client is served meanwhile, and the held ones still are
            status, conn = await chat_from(port, "127.0.0.1", CHAT)
            assert status == b"HTTP/1.1 200 OK", status
            conn[1].close()
        status, _ = await chat_from(port, "127.0.0.2", CHAT, held[0])
        assert status == b"HTTP/1.1 200 OK", status
        page = runtime.metrics.render().decode()
        assert "poolkeeper_client_connections_refused_total 1.0" in page

        # A held connection closes: its address may connect again once Envoy's log says so.
        held.pop(0)[1].close()
        counter = runtime.conncap
        await _until(lambda: counter.exported()[0] == LIMIT - 1, "the close reported")
        status, conn = await chat_from(port, "127.0.0.2", CHAT)
        assert status == b"HTTP/1.1 200 OK", status
        held.append(conn)

        # Fail open: with the counter gone, Envoy lets connections in (its check fails).
        for server in runtime._grpc_servers[-1:]:  # the counter, started with Envoy
            await server.stop(None)
        status, conn = await chat_from(port, "127.0.0.2", CHAT)
        assert status == b"HTTP/1.1 200 OK", status
        held.append(conn)


@pytest.mark.integration
async def test_a_reset_during_its_check_leaves_no_phantom_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real Envoy: a client from 127.0.0.3 resets right after its first bytes, and its check is
    held until Envoy's report of the close has been handled (the order the race can take).
    Before, that check was counted and the connection stayed in the table for good; now the
    address is left with nothing counted and gets its LIMIT connections. A silent connection's
    reported close time includes how long it was open (Envoy's start time plus duration)."""
    held_checks: list[tuple[str, int]] = []
    check = ConnectionCapService.Check

    async def check_after_its_close(
        self: ConnectionCapService, request: auth_pb2.CheckRequest, context: Any = None
    ) -> auth_pb2.CheckResponse:
        source = request.attributes.source.address.socket_address
        if source.address != "127.0.0.3" or held_checks:
            return await check(self, request, context)
        held_checks.append((source.address, source.port_value))

        async def after_the_close() -> auth_pb2.CheckResponse:
            await _until(
                lambda: self.counter.closed_unknown(source.address, source.port_value),
                "the reset connection's close reported",
            )
            return await check(self, request, context)

        # Shielded: Envoy cancels the check when the connection resets, and the handler must
        # still run, late, as it does when it had started before the cancel came.
        return await asyncio.shield(asyncio.ensure_future(after_the_close()))

    monkeypatch.setattr(ConnectionCapService, "Check", check_after_its_close)
    held: list[Conn] = []
    async with _gateway(tmp_path, held) as runtime:
        assert runtime.config is not None
        counter = runtime.conncap
        assert counter is not None
        port = runtime.config.spec.listeners.http
        _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        await writer.drain()
        await _until(lambda: held_checks, "its check under way")
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()  # a reset
        await _until(lambda: counter.counts().late == 1, "the late check handled")
        assert counter.counts().open == 0
        for _ in range(LIMIT):
            status, conn = await chat_from(port, "127.0.0.3", CHAT)
            assert status == b"HTTP/1.1 200 OK", status
            held.append(conn)

        # A silent connection (never checked) open for a while: its close time is its end.
        opened_at = time.time()
        _, silent = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.4", 0))
        silent_port = silent.get_extra_info("sockname")[1]
        await asyncio.sleep(0.5)
        silent.close()
        await _until(
            lambda: counter.closed_unknown("127.0.0.4", silent_port), "the silent close reported"
        )
        closed_at = counter.closed_unknown("127.0.0.4", silent_port)
        assert closed_at is not None
        assert opened_at + 0.4 <= closed_at <= time.time()


def _envoy_checks(admin_port: int) -> dict[str, int]:
    """Envoy's counts of the cap's checks (`ext_authz.client_cap.*`), read without the loop."""
    url = f"http://127.0.0.1:{admin_port}/stats?filter=^ext_authz\\.client_cap\\."
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    stats: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if value.strip().isdigit():
            stats[name.strip().removeprefix("ext_authz.client_cap.")] = int(value)
    return stats


def _status(sock: socket.socket) -> bytes:
    """The status line of the answer on `sock`, b"" if it was closed unanswered."""
    sock.settimeout(30)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except ConnectionError:
        return b""
    return data.split(b"\r\n", 1)[0] if b"\r\n" in data else b""


@pytest.mark.integration
async def test_the_cap_holds_while_the_main_event_loop_is_busy(tmp_path: Path) -> None:
    """Bounds round 6: Envoy gives each check a deadline (`conncap_timeout_s`) and lets the
    connection in when the answer is late. The counter answered on `serve`'s main event
    loop, behind the EPP's work, so on a loaded gateway over-cap connections got in. Here
    the main loop is held busy (a Python loop holding the interpreter lock, as the EPP's
    work does) from before LIMIT + 2
    connections from one address send a request until Envoy has finished every one of their
    checks, answered or timed out. Before: all LIMIT + 2 were let in (each check timed out)
    and served once the loop was free; now the counter answers on its own thread: LIMIT are
    served, 2 closed unanswered."""
    held: list[Conn] = []
    async with _gateway(tmp_path, held) as runtime:
        assert runtime.config is not None
        counter = runtime.conncap
        assert counter is not None
        port, admin = runtime.config.spec.listeners.http, runtime.config.spec.listeners.admin
        status, conn = await chat_from(port, "127.0.0.1", CHAT)  # the path is warm
        assert status == b"HTTP/1.1 200 OK", status
        conn[1].close()
        before = await asyncio.to_thread(_envoy_checks, admin)
        busy, checked = threading.Event(), threading.Event()
        socks: list[socket.socket] = []
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%b" % (len(CHAT), CHAT)
        )

        def connect_while_busy() -> None:
            try:
                busy.wait(30)
                for _ in range(LIMIT + 2):
                    sock = socket.socket()
                    socks.append(sock)
                    sock.bind(("127.0.0.5", 0))
                    sock.connect(("127.0.0.1", port))
                    sock.sendall(request)
                for _ in range(1000):  # until Envoy has every check's outcome
                    stats = _envoy_checks(admin)
                    if stats["total"] - before["total"] >= LIMIT + 2 and stats["active"] == 0:
                        return
                    time.sleep(0.01)
            finally:
                checked.set()

        client = threading.Thread(target=connect_while_busy)
        client.start()
        busy.set()
        spin_until = time.monotonic() + 30
        while not checked.is_set() and time.monotonic() < spin_until:
            sum(range(1000))  # the main loop busy, the interpreter lock held but for switches
        await asyncio.to_thread(client.join)
        try:
            statuses = await asyncio.gather(*(asyncio.to_thread(_status, s) for s in socks))
        finally:
            for sock in socks:
                sock.close()
        served = [s for s in statuses if s == b"HTTP/1.1 200 OK"]
        assert (len(served), len(statuses)) == (LIMIT, LIMIT + 2), statuses
        assert counter.counts().refused == 2
        after = await asyncio.to_thread(_envoy_checks, admin)
        assert after["denied"] - before["denied"] == 2


@pytest.mark.integration
async def test_connections_let_in_by_timed_out_checks_are_counted(tmp_path: Path) -> None:
    """Round 7, real Envoy: the counter's own loop held for longer than a check's deadline
    while two connections from 127.0.0.7 send a request. Envoy lets both in (fails open) and
    grpc drops the cancelled checks, so they were never counted: the address then got LIMIT
    more. Now the kernel's list counts them within two lists, and the address gets LIMIT - 2."""
    held: list[Conn] = []
    async with _gateway(tmp_path, held) as runtime:
        assert runtime.config is not None
        counter = runtime.conncap
        assert counter is not None
        port = runtime.config.spec.listeners.http
        own = runtime._grpc_servers[-1]
        assert isinstance(own, OwnLoopServer)
        assert own.loop is not None
        own.loop.call_soon_threadsafe(time.sleep, 2.0)  # the counter's loop held 2 s
        for status, conn in await asyncio.gather(
            chat_from(port, "127.0.0.7", CHAT), chat_from(port, "127.0.0.7", CHAT)
        ):
            assert status == b"HTTP/1.1 200 OK", status  # let in: their checks timed out
            held.append(conn)
        await _until(lambda: counter.counts().reconciled == 2, "both counted", timeout_s=10)
        statuses = []
        for _ in range(LIMIT - 1):
            status, conn = await chat_from(port, "127.0.0.7", CHAT)
            statuses.append(status)
            held.append(conn)
        assert statuses == [b"HTTP/1.1 200 OK"] * (LIMIT - 2) + [b""]
