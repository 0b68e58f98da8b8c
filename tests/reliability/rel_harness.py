"""A real Envoy (our bootstrap) in front of an in-process EPP and echo backends, with knobs
for the reliability tests: bootstrap overrides, a fixed endpoint list (fault proxies), a hung
EPP, and raw-socket HTTP probes."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from poolkeeper.envoy.bootstrap import BootstrapParams
from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.envoy.params import CLIENT_MAX_HEADER_KB, CLIENT_MAX_HEADERS
from poolkeeper.envoy.process import EnvoySupervisor
from poolkeeper.extproc.contracts import ExtProcSettings
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.netutil import free_port
from poolkeeper.telemetry.health import HealthService
from tests.envoy.envoy_harness import Backend, RoundRobinRouter, running_envoy


@dataclass
class Gate:
    port: int
    url: str
    backends: list[Backend]
    router: RoundRobinRouter
    servicer: ExtProcServicer | None
    envoy: EnvoySupervisor
    params: BootstrapParams


class HungServicer(ExtProcServicer):
    """An EPP that accepts every stream and never answers (alive, but stuck)."""

    async def Process(self, request_iterator: Any, context: Any = None) -> Any:
        self.active += 1
        try:
            async for _ in request_iterator:
                pass
            await asyncio.Event().wait()
        finally:
            self.active -= 1
        yield  # pragma: no cover  (makes this an async generator like the real one)


@asynccontextmanager
async def gate(
    tmp_path: Path,
    *,
    fixed: tuple[str, ...] | None = None,
    hung_epp: bool = False,
    **overrides: Any,
) -> AsyncIterator[Gate]:
    backends = [Backend("a"), Backend("b")]
    for b in backends:
        await b.start()
    router = RoundRobinRouter(backends, fixed=fixed)
    health = HealthService.for_gateway(live=lambda: True, ready=lambda: True)
    # The client's header limits are the EPP's to check, as `serve` sets them (epp_ports.py).
    settings = ExtProcSettings(client_header_limits=(CLIENT_MAX_HEADERS, CLIENT_MAX_HEADER_KB))
    servicer: ExtProcServicer = (HungServicer if hung_epp else ExtProcServicer)(
        router, settings=settings
    )
    server: grpc.aio.Server
    server, epp_port = build_server(servicer, "127.0.0.1:0", extra=health.register)
    await server.start()
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write([*(b.hostport for b in backends), *(fixed or ())])
    params = dataclasses.replace(
        BootstrapParams(
            listen_port=free_port(),
            extproc_port=epp_port,
            admin_port=free_port(),
            fallback_endpoints=tuple(b.hostport for b in backends),
            endpoints_file=str(endpoints.path),
        ),
        **overrides,
    )
    try:
        async with running_envoy(params, tmp_path) as envoy:
            yield Gate(
                params.listen_port,
                f"http://127.0.0.1:{params.listen_port}",
                backends,
                router,
                servicer,
                envoy,
                params,
            )
    finally:
        await server.stop(None)
        for b in backends:
            await b.stop()


async def stalled_reader(
    port: int, path: str, body: bytes, *, receive_buffer: int
) -> asyncio.StreamWriter:
    """A client that POSTs `body` to `path` and never reads the response. Its receive buffer
    is pinned to `receive_buffer` before connecting, so what the gateway sends beyond that
    stays in the gateway. The caller closes the returned writer."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connect
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
    _reader, writer = await asyncio.open_connection(sock=client)
    writer.write(
        b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (path.encode(), len(body), body)
    )
    await writer.drain()
    return writer


async def raw_http(port: int, data: bytes, *, read_timeout_s: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection; return what came back until the server closes it
    or has been silent for a moment after answering (an HTTP/1.1 keep-alive reply)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + read_timeout_s
        while loop.time() < deadline:
            wait = 0.5 if out.count(b"\r\n\r\n") and _complete(out) else deadline - loop.time()
            try:
                chunk = await asyncio.wait_for(reader.read(65536), max(wait, 0.01))
            except TimeoutError:
                if _complete(out):
                    break
                continue
            except ConnectionError:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        writer.close()


def _complete(response: bytes) -> bool:
    head, sep, body = response.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return True


def status_of(response: bytes) -> int:
    """The final status code of a raw response (skipping any `100 Continue`)."""
    statuses = [
        int(line.split()[1])
        for line in response.split(b"\r\n")
        if line.startswith(b"HTTP/1.") and len(line.split()) > 1
    ]
    return statuses[-1] if statuses else 0
