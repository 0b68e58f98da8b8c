"""Checklist D6 on the streamed-response path, as `poolkeeper serve` runs it: a simulated model
server streams a long response (responses observed from the access log, past the EPP) to a
client that stops reading. What Envoy takes from the model server is bounded by the limits
the bootstrap configures: its connection buffers, and its client socket's pinned kernel send
buffer (`client_send_buffer_bytes`). Autotuned, that kernel buffer alone grew to tcp_wmem's
maximum (4 MB here) for one such client: Envoy read 4.4-4.6 MB before it pushed back.

The same over HTTP/2 to the model server (`appProtocol: kubernetes.io/h2c`): Envoy's default
stream window let such a server push 16.8 MB of a stalled stream into Envoy; the bootstrap's
upstream windows bound it (envoy/clusters.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import h2.config
import h2.connection
import h2.events
import pytest

from poolkeeper.envoy.clusters import UPSTREAM_H2_STREAM_WINDOW
from poolkeeper.envoy.params import ROUTED_CLUSTER, BootstrapParams
from tests.reliability.memprobe import children, rss_mb
from tests.reliability.rel_harness import gate, stalled_reader
from tests.reliability.test_rel_restart import _serve
from tests.support.gateway_files import gateway_ports, one_server_config
from tests.support.processes import listening_ports, poolkeeper

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CLIENT_RCVBUF = 1 << 16  # the client's own kernel buffer: pinned small, it is not Envoy's
PAUSED = f"cluster.{ROUTED_CLUSTER}.upstream_flow_control_paused_reading_total"
READ = f"cluster.{ROUTED_CLUSTER}.upstream_cx_rx_bytes_total"


async def _admin(port: int, path: str) -> dict[str, int]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}") as resp,
    ):
        data = await resp.json()
    if "stats" in data:
        return {s["name"]: int(s["value"]) for s in data["stats"] if "value" in s}
    return {k: int(v) for k, v in data.items()}


async def _stats(port: int) -> dict[str, int]:
    return await _admin(port, "/stats?format=json&filter=upstream_(cx_rx_bytes_total|flow_)")


def _bound(p: BootstrapParams) -> int:
    """The most Envoy may read from the model server for one client that reads nothing: the
    client connection's write buffer and the model-server connection's read buffer (each
    watermark may be passed by one read, so twice that; no filter buffers this body), the
    client socket's kernel send buffer (the kernel doubles the value set), and the client's
    own receive buffer (doubled too)."""
    envoy = 2 * (p.connection_buffer_bytes + p.buffer_limit_bytes)
    return envoy + 2 * p.client_send_buffer_bytes + 2 * CLIENT_RCVBUF


async def test_a_stalled_client_of_a_long_stream_is_bounded(tmp_path: Path) -> None:
    # A long fast stream: up to a million tokens (about 200 KB-1 MB a second here; far more
    # than any buffer on the way), each event written as soon as the loop gets to it.
    (tmp_path / "sim.yaml").write_text(
        "defaults: {max_model_len: 2000000, num_gpu_blocks: 200000}\n"
    )
    fast = ["--time-scale", "0.003", "--config", str(tmp_path / "sim.yaml")]
    sim = poolkeeper(["sim", "--port", "0", "--model", "tiny-base", *fast], tmp_path / "sim.log")
    ports = gateway_ports()
    gw = None
    writer: asyncio.StreamWriter | None = None
    try:
        (sim_port,) = await asyncio.to_thread(listening_ports, sim, 1)
        directory = one_server_config(tmp_path / "config", ports, sim_port)
        gw = await asyncio.to_thread(_serve, directory, ports, tmp_path / "gw")
        (envoy,) = children(gw.process.pid)
        idle_rss = rss_mb(envoy)
        idle_heap = (await _admin(ports["admin"], "/memory"))["allocated"]
        body = json.dumps(
            {"model": "tiny-base", "prompt": "hi", "max_tokens": 1_000_000, "stream": True}
        ).encode()
        writer = await stalled_reader(
            ports["http"], "/v1/completions", body, receive_buffer=CLIENT_RCVBUF
        )
        # Envoy pushes back (stops reading the model server) once its client connection's
        # buffer is full; from then on what it has read stays put. Wait for both.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        stats = await _stats(ports["admin"])
        while stats.get(PAUSED, 0) == 0:
            assert loop.time() < deadline, f"Envoy never pushed back: {stats}"
            await asyncio.sleep(0.25)
            stats = await _stats(ports["admin"])
        read = -1
        while read != stats[READ]:
            read = stats[READ]
            await asyncio.sleep(1.0)
            stats = await _stats(ports["admin"])
        heap = (await _admin(ports["admin"], "/memory"))["allocated"] - idle_heap
        bound = _bound(BootstrapParams())
        print(
            f"stalled client: Envoy read {read / 1e6:.2f} MB from the model server (bound "
            f"{bound / 1e6:.2f} MB), live heap +{heap / 1e6:.2f} MB, RSS "
            f"+{rss_mb(envoy) - idle_rss:.1f} MB"
        )
        assert read < bound, (read, bound)
        # Nothing of the stream is kept elsewhere in Envoy (the RSS also holds the Lua
        # observer's garbage, which a reading client leaves as well: reported, not asserted).
        p = BootstrapParams()
        assert heap < 2 * (p.connection_buffer_bytes + p.buffer_limit_bytes), heap
        # Still serving others meanwhile.
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"http://127.0.0.1:{ports['http']}/v1/completions",
                json={"model": "tiny-base", "prompt": "hi", "max_tokens": 3},
            ) as resp,
        ):
            assert resp.status == 200
    finally:
        if writer is not None:
            writer.close()
        if gw is not None:
            gw.stop()
        sim.stop()


class _H2Stream(asyncio.Protocol):
    """An h2c model server answering each request with `total` bytes of SSE, as fast as the
    peer's flow-control windows let it; `sent` counts what it handed to the connection."""

    def __init__(self, total: int, sent: list[int]) -> None:
        self.total, self.sent = total, sent
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.streams: dict[int, int] = {}  # stream -> bytes still to send

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.conn.initiate_connection()
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                headers = [(":status", "200"), ("content-type", "text/event-stream")]
                self.conn.send_headers(event.stream_id, headers)
                self.streams[event.stream_id] = self.total
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self.streams.pop(event.stream_id, None)
        for stream, left in list(self.streams.items()):
            while left > 0:
                window = self.conn.local_flow_control_window(stream)
                size = min(window, self.conn.max_outbound_frame_size, left)
                if size <= 0:
                    break
                self.conn.send_data(stream, b"x" * size)
                left -= size
                self.sent[0] += size
            self.streams[stream] = left
            if left == 0:
                self.conn.end_stream(stream)
                del self.streams[stream]
        self.transport.write(self.conn.data_to_send())


async def test_an_h2c_model_server_cannot_push_a_stalled_stream_into_envoy(
    tmp_path: Path,
) -> None:
    sent = [0]
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _H2Stream(64 << 20, sent), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    writer: asyncio.StreamWriter | None = None
    try:
        async with gate(
            tmp_path, fixed=(f"127.0.0.1:{port}",), upstream_h2c=True, observe_responses=True
        ) as g:
            # A reading client gets a whole response through the windows (4 MB here).
            got = 0
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    g.url + "/v1/chat/completions", json={"model": "m", "stream": True}
                ) as resp,
            ):
                async for chunk in resp.content.iter_chunked(1 << 16):
                    got += len(chunk)
                    if got >= 4 << 20:
                        break
            assert got >= 4 << 20, got
            sent[0] = 0
            writer = await stalled_reader(
                g.port,
                "/v1/chat/completions",
                b'{"model": "m", "stream": true}',
                receive_buffer=CLIENT_RCVBUF,
            )
            # The server sends as far as Envoy's windows let it: wait until that stops.
            last = -1
            deadline = loop.time() + 60
            while last != sent[0] or last == 0:
                assert loop.time() < deadline, "the stream never started or never stopped"
                last = sent[0]
                await asyncio.sleep(1.0)
            bound = UPSTREAM_H2_STREAM_WINDOW + _bound(g.params)
            print(f"stalled h2c stream: {sent[0] / 1e6:.2f} MB sent (bound {bound / 1e6:.2f})")
            assert sent[0] < bound, (sent[0], bound)
    finally:
        if writer is not None:
            writer.close()
        server.close()
