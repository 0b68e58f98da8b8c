"""What a `GatewayRuntime` holds (the options, the datastore, the Director, the servers, tasks
and Envoy it started, the drain's state, the one clock) and the questions asked of it:
`ready()` and where the EPP and the gateway listen. Starting is `runtime`, the managed Envoy's
start `runtime_envoy`, draining and stopping `runtime_stop`."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from poolkeeper.backend.scraper_manager import ScraperManager
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.source import ResourceSource
from poolkeeper.datastore.store import Datastore
from poolkeeper.envoy.process import EnvoySupervisor
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.conncap import ConnectionCounter
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.requestcontrol.director import Director
from poolkeeper.server.envoy_drain import SETTLE_SLACK_S
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.sync_service import SyncService
from poolkeeper.server.transport import Stoppable
from poolkeeper.telemetry.metrics import GatewayMetrics


@dataclass
class RuntimeState:
    options: ServeOptions
    config: GatewayConfig | None = None  # what the source yielded, once started
    datastore: Datastore = field(default_factory=Datastore)
    director: Director | None = None
    metrics: GatewayMetrics | None = None
    servicer: ExtProcServicer | None = None
    detached: DetachedExchanges | None = None  # the response observer's waiting room
    envoy: EnvoySupervisor | None = None
    conncap: ConnectionCounter | None = None  # the per-client-address connection cap
    draining: bool = False
    _scrapers: ScraperManager | None = None
    _grpc_servers: list[Stoppable] = field(default_factory=list)  # grpc.aio or lean
    _web: web.AppRunner | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _stopped: bool = False
    _source: ResourceSource | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _source_task: asyncio.Task[None] | None = None
    # With the Envoy we run: its token for the EPP's gRPC port (extproc/auth.py).
    _epp_token: str | None = None
    _unsubscribe: list[Callable[[], None]] = field(default_factory=list)
    # The drain's settle: how long a connection may wait on its connection-cap check.
    _settle_max_s: float = SETTLE_SLACK_S
    _sync: SyncService | None = None  # cross-replica sync (spec.replicaSync)
    # The one clock of the EPP's state: decisions' `now` (the Director's), metrics' scrape
    # stamps (staleness), the pool views and the replica sync's stamps share this base.
    clock: Callable[[], float] = time.monotonic

    def ready(self) -> bool:
        """Serving: not draining, the source has synced, and (unless `ready_once_synced`) the
        Director has an endpoint with fresh metrics to send to."""
        if self.draining or self._source is None or not self._source.healthy():
            return False
        if self.options.ready_once_synced:
            return self.director is not None
        return self.director is not None and self.director.ready()

    @property
    def epp_address(self) -> str:
        """Where the EPP's own ports listen: loopback with the Envoy we run."""
        assert self.config is not None
        return "127.0.0.1" if self.options.run_envoy else self.config.spec.listeners.address

    @property
    def extproc_address(self) -> str:
        assert self.config is not None
        return f"ext_proc {self.epp_address}:{self.config.spec.listeners.ext_proc}"

    @property
    def http_url(self) -> str:
        assert self.config is not None
        listeners = self.config.spec.listeners
        host = "127.0.0.1" if listeners.address == "0.0.0.0" else listeners.address
        return f"http://{host}:{listeners.http}"
