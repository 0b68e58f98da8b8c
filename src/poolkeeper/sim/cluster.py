"""`SimCluster`: all simulated servers of one process. `SimCluster(specs, host, base_port)`
builds one EngineModel per ServerSpec, serves each (`server.SimServer`) on its own port
(base_port + i; 0 = any free port), drives them all from one RealtimeDriver, and with
`kv_events_port_offset` publishes each server's KV-cache events on a ZMQ PUB socket at its
HTTP port plus the offset (`sim/kvpublish.py`). `start` answers where each one listens
(`Listening`); `stop` stops them all."""

from __future__ import annotations

import asyncio
import random
import socket
from dataclasses import dataclass

from aiohttp import web

from poolkeeper.sim.config import ServerSpec
from poolkeeper.sim.driver import RealtimeDriver
from poolkeeper.sim.engine import EngineModel
from poolkeeper.sim.kvpublish import ZmqKVEventPublisher
from poolkeeper.sim.server import SimServer


@dataclass(frozen=True, slots=True)
class Listening:
    name: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class SimCluster:
    """All simulated servers of one process: start them, find them, stop them."""

    def __init__(
        self,
        specs: list[ServerSpec],
        *,
        host: str = "127.0.0.1",
        base_port: int = 0,
        kv_events_port_offset: int | None = None,
    ):
        self.host = host
        self.kv_events_port_offset = kv_events_port_offset
        self._publishers: list[ZmqKVEventPublisher] = []
        self.base_port = base_port
        engines = [EngineModel(spec.engine, name=spec.name) for spec in specs]
        self.driver = RealtimeDriver(engines)
        self.servers = [
            SimServer(
                index=i,
                spec=spec,
                engine=engines[i],
                driver=self.driver,
                faults=spec.faults,
                rng=random.Random(f"faults:{spec.engine.seed}:{spec.name}"),
            )
            for i, spec in enumerate(specs)
        ]
        self._runners: list[web.AppRunner] = []
        self._driver_task: asyncio.Task[None] | None = None

    async def start(self) -> list[Listening]:
        self._driver_task = asyncio.create_task(self.driver.run(), name="sim-driver")
        out: list[Listening] = []
        try:
            for server in self.servers:
                port = self.base_port + server.index if self.base_port else 0
                sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((self.host, port))
                except OSError:
                    sock.close()
                    raise
                server.port = sock.getsockname()[1]
                runner = web.AppRunner(
                    server.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0
                )
                try:
                    await runner.setup()
                    self._runners.append(runner)
                    await web.SockSite(runner, sock).start()
                except BaseException:
                    sock.close()
                    raise
                out.append(Listening(server.name, self.host, server.port))
                if self.kv_events_port_offset is not None:
                    self._publish_kv_events(server)
        except BaseException:
            await self.stop()
            raise
        return out

    def _publish_kv_events(self, server: SimServer) -> None:
        assert self.kv_events_port_offset is not None
        host = f"[{self.host}]" if ":" in self.host else self.host
        publisher = ZmqKVEventPublisher(
            f"tcp://{host}:{server.port + self.kv_events_port_offset}",
            block_size=server.engine.config.block_size,
        )
        self._publishers.append(publisher)
        server.engine.kv.sink = publisher
        server.engine.kv_step_end = publisher.step_ended  # one batch per step, at its end

    async def stop(self) -> None:
        for publisher in self._publishers:
            publisher.close()
        self._publishers.clear()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        self.driver.close()
        if self._driver_task is not None:
            await asyncio.gather(self._driver_task, return_exceptions=True)
            self._driver_task = None
