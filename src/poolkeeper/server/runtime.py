"""`GatewayRuntime`: the composition root. Resource source → datastore → scrapers → Director →
ext_proc + health + metrics servers → Envoy child process; and the reverse on shutdown.

The one startup path: the `ResourceSource` the options name (files today; `controller/source.py`)
fills the datastore and yields the GatewayConfig, and everything else is built from those two.

Shutdown drains as Kubernetes expects (reliability finding 2): readiness turns NOT_SERVING
first, Envoy's listeners stop accepting at once (new connections are refused, so clients and
load balancers go to a peer instead of being accepted and cut later; idle keep-alive
connections are closed), every request already accepted gets up to the grace period (default
130 s, like upstream's chart) to finish, counted by Envoy itself and by the EPP's streams, then
Envoy, the gRPC servers and the scrapers stop. grpc.aio does not
stop on signals by itself, so `serve_until_signalled` installs its own handlers (SIGINT, SIGTERM,
SIGHUP: `signals.py`). Envoy runs in a session of its own (`envoy/tether.py`), so a terminal's
Ctrl-C reaches this process only, and this order is the one that runs.

The parts it composes live beside it: `options.py` (`ServeOptions`), `epp_ports.py` (the EPP's
ext_proc, health and metrics servers), `envoy_bootstrap.py`, `managed_envoy.py` and
`envoy_drain.py` (the Envoy it runs: parameters, start, drain), `stats_views.py` (what the
metrics read at scrape time), `housekeeping.py` (periodic tasks), `sync_service.py`,
`wiring.py` (the Director).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from aiohttp import web

from poolkeeper.backend.scraper_manager import ScraperManager
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.source import ResourceSource
from poolkeeper.datastore.store import Datastore
from poolkeeper.envoy.bootstrap import BootstrapParams
from poolkeeper.envoy.process import EnvoySupervisor, find_envoy
from poolkeeper.errors import ConfigError
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.auth import EnvoyOnly, new_token
from poolkeeper.extproc.conncap import ConnectionCounter
from poolkeeper.extproc.conncap_service import build_conncap_server
from poolkeeper.extproc.contracts import BodyBudget
from poolkeeper.extproc.heap import keep_freed_pages
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.extproc.tls import server_credentials, ssl_context
from poolkeeper.requestcontrol.director import Director
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.server.envoy_bootstrap import bootstrap_params, fail_open_split_targets
from poolkeeper.server.envoy_drain import SETTLE_SLACK_S, drain_envoy
from poolkeeper.server.epp_ports import (
    extproc_settings,
    health_server,
    health_service,
    metrics_runner,
    side_services,
)
from poolkeeper.server.housekeeping import expire_detached, trim_after_bursts
from poolkeeper.server.managed_envoy import follow_endpoints, start_supervised, supervise
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.own_loop import OwnLoopServer
from poolkeeper.server.stats_views import endpoint_of, flow_stats, pool_stats
from poolkeeper.server.sync_service import SyncService
from poolkeeper.server.transport import Stoppable, export_transport, refused_calls, start_extproc
from poolkeeper.server.wiring import build_director
from poolkeeper.telemetry.metrics import GatewayMetrics, ObserverStats

log = logging.getLogger("poolkeeper.server")


@dataclass
class GatewayRuntime:
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

    # -- start ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start everything; on failure whatever started is stopped again before raising."""
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0)
            raise

    async def _start(self) -> None:
        # Fail before loading or binding anything when Envoy is wanted but missing.
        binary = find_envoy(self.options.envoy_path) if self.options.run_envoy else ""
        # Large request bodies from the heap, its freed pages kept for the next one
        # (extproc/heap.py); after a burst `trim_after_bursts` gives them back.
        keep_freed_pages()
        # The source applies pools, models and endpoints and keeps them in step later; the
        # GatewayConfig it yields (listeners, scheduling, the Envoy bootstrap) is read once.
        self._source = self.options.source(self.datastore)
        config = self.config = await self._source.start()
        spec = config.spec
        self._source_task = asyncio.create_task(self._source.run(), name="resource-source")
        self._tasks.append(self._source_task)
        log.info("resources from %s", self._source.describe())
        self._scrapers = ScraperManager(
            spec.scraping, self.datastore.update_metrics, clock=self.clock
        )
        self._scrapers.follow(self.datastore)
        # The response observer: on by default only with the Envoy we run and configure.
        observing = spec.edge.responses_observed(managed_envoy=self.options.run_envoy)
        self.director = build_director(
            config,
            self.datastore,
            rng=random.Random(self.options.rng_seed),
            clock=self.clock,
            responses_observed=observing,
            on_stop=self._unsubscribe,  # the forgetter's sweep is cancelled on stop
        )
        stats = getattr(self.director.scheduler, "stats", None)
        self.metrics = GatewayMetrics(
            pool_stats=lambda: pool_stats(self.datastore, self.config, self.clock()),
            scheduling=stats if isinstance(stats, SchedulingStats) else None,
            flow_stats=lambda: flow_stats(self.director, self.config),
            endpoint_of=lambda hostport: endpoint_of(self.datastore, hostport),
            fairness_id_label_limit=self.options.fairness_id_label_limit,
        )
        # Samples of the request path taken after its replies have left (telemetry/metrics).
        self.metrics.defer_request_path(asyncio.get_running_loop().call_soon)
        self.metrics.follow_scrapes(self._scrapers.failure_totals)
        self.metrics.follow_source(self._source.stale_s)
        self.director.observer = self.metrics  # time to first token, rewrite decisions
        if self.director.flow is not None:
            self.director.flow.observer = self.metrics  # queue outcomes and durations
        if spec.replica_sync.enabled:  # peers' decisions into this scheduler, ours to them
            await self._start_replica_sync(spec.replica_sync)
        listeners = spec.listeners
        health = health_service(
            upstream=self.options.upstream_health,
            source=self._source,
            ready=self.ready,
            answering=lambda: self.director is not None,
        )
        settings = extproc_settings(spec, own_bootstrap=self.options.own_bootstrap)
        budget = BodyBudget(spec.request_handling.max_inflight_body_bytes)
        self.detached = detached = DetachedExchanges() if observing else None
        if detached is not None:
            self.metrics.follow_observer(
                lambda: ObserverStats(len(detached), detached.settled, detached.expired)
            )
        self.servicer = ExtProcServicer(
            self.director,
            settings=settings,
            observer=self.metrics,
            budget=budget,
            detached=self.detached,
        )
        servicer = self.servicer
        self.metrics.follow_streams(lambda: (servicer.active, servicer.over_limit))
        self._tasks.append(asyncio.create_task(trim_after_bursts(budget), name="trim"))
        if detached is not None:
            self._tasks.append(asyncio.create_task(expire_detached(detached), name="expire"))

        # With the Envoy we run, the EPP's ports are for that Envoy only (round 2, finding 2):
        # loopback whatever the public address, and a token on every gRPC call but health.
        # Without it (--no-envoy, Kubernetes) another host's Envoy must reach them. Both
        # transports hold to it: grpcio by the interceptor, the lean one by its own check.
        local = self.epp_address
        lean = listeners.ext_proc_transport == "lean"
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.options.run_envoy:
            self._epp_token = new_token()
            guard = EnvoyOnly(self._epp_token)
            interceptors.append(guard)
        extproc = await start_extproc(
            listeners.ext_proc_transport,
            self.servicer,
            local,
            listeners.ext_proc,
            health=health,
            detached=detached,
            register=side_services(health, detached),
            interceptors=interceptors,
            token=self._epp_token,
            # TLS (--secure-serving) as the transport serves it: stdlib ssl or grpcio's.
            tls=ssl_context(self.options.tls) if lean else None,
            credentials=None if lean else server_credentials(self.options.tls),
        )
        self._grpc_servers.append(extproc)
        export_transport(self.metrics.registry, extproc)
        if interceptors:
            self.metrics.follow_refused(refused_calls(extproc, guard))
        self._grpc_servers.append(health_server(health, local, listeners.health))
        for server in self._grpc_servers:
            await server.start()
        self._web = metrics_runner(self.metrics.app(), self.options.metrics_middlewares, self.ready)
        await self._web.setup()
        await web.TCPSite(self._web, local, listeners.metrics).start()
        log.info(
            "epp listening ext_proc=%s:%d health=%d metrics=%d",
            local,
            listeners.ext_proc,
            listeners.health,
            listeners.metrics,
        )
        if why := config.spec.hold_left_out():
            log.info("%s", why)
        await self._wait_ready(self.options.ready_wait_s)
        unserved = fail_open_split_targets(self.datastore.snapshot())
        if unserved and not self.options.run_envoy:  # the Envoy we run holds the table
            log.warning(
                "FailOpen: with the endpoint picker down, requests for %s reach model servers "
                "unrewritten and get 404 (they name only a split) unless your Envoy rewrites "
                "them; see docs/reliability.md",
                ", ".join(unserved),
            )
        if self.options.run_envoy:
            await self._start_envoy(config, binary)

    async def _start_replica_sync(self, config: ReplicaSyncConfig) -> None:
        assert self.director is not None
        assert self.metrics is not None
        scheduler = self.director.scheduler
        if not isinstance(scheduler, Scheduler):
            raise ConfigError("spec.replicaSync: needs poolkeeper's scheduler")
        flow = self.director.flow
        self._sync = sync = SyncService(
            config,
            scheduler,
            self.datastore,
            clock=self.clock,
            wake=flow.wake if flow is not None else None,
        )
        await sync.start()
        self.metrics.registry.register(sync.collector())

    async def _start_conncap(
        self, config: GatewayConfig, params: BootstrapParams
    ) -> BootstrapParams:
        """The per-client-address connection counter for the Envoy about to start (loopback,
        the run's token), and the bootstrap parameters that make Envoy ask it."""
        limit = config.spec.edge.max_connections_per_client
        if limit <= 0:
            return params
        self.conncap = counter = ConnectionCounter(limit)
        token, timeout_s, listen = self._epp_token, params.conncap_timeout_s, params.listen_port
        # On a thread and loop of its own: Envoy lets a connection in uncounted when the
        # answer takes over `timeout_s`, and on this loop it waited behind the EPP's work.
        server = OwnLoopServer(
            lambda: build_conncap_server(counter, "127.0.0.1", token, timeout_s, listen),
            "conncap",
        )
        await server.start()
        self._grpc_servers.append(server)
        if self.metrics is not None:
            self.metrics.follow_client_connections(counter.exported)
        return dataclasses.replace(params, conncap_port=server.port)

    async def _start_envoy(self, config: GatewayConfig, binary: str) -> None:
        workdir = self.options.workdir
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="poolkeeper-")
            workdir = Path(self._tmp.name)
        workdir.mkdir(parents=True, exist_ok=True)
        endpoints_path, unsubscribe = follow_endpoints(workdir, self.datastore)
        self._unsubscribe.append(unsubscribe)
        params = bootstrap_params(
            config,
            self.datastore.snapshot(),
            endpoints_file=endpoints_path,
            managed=True,
            first_tokens_at_once=self.director is not None
            and self.director.wants_first_tokens_at_once,
        )
        params = dataclasses.replace(
            params, epp_token=self._epp_token, epp_tls=self.options.tls.secure_serving
        )
        params = await self._start_conncap(config, params)
        if params.conncap_port:
            self._settle_max_s = params.conncap_timeout_s + SETTLE_SLACK_S
        self.envoy, params = supervise(
            params,
            binary=binary,
            workdir=workdir,
            concurrency=self.options.envoy_concurrency,
            detached=self.detached,
            conncap=self.conncap,
        )
        await start_supervised(self.envoy, params)

    async def _wait_ready(self, within_s: float) -> None:
        """Give the first scrapes a moment, so the first requests see fresh metrics."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while not (self.ready() and self.director is not None and self.director.ready()):
            if loop.time() >= deadline:
                log.warning("no endpoint has fresh metrics yet; starting anyway")
                return
            await asyncio.sleep(0.05)

    # -- state ----------------------------------------------------------------------------
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

    # -- stop -----------------------------------------------------------------------------
    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop everything (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        self.draining = True
        if self._sync is not None:  # no late start nor new key during the drain
            await self._sync.stop_following()
        if self.envoy is not None:
            self.envoy.expect_exit()  # from here an exit of Envoy's is no crash to restart
        await self._stop_source()
        if grace > 0 and self.options.drain_timeout_s > 0:
            log.info("draining: ext_proc serves for %.0fs more", self.options.drain_timeout_s)
            await asyncio.sleep(self.options.drain_timeout_s)
        if self.envoy is not None and grace > 0:
            assert self.config is not None
            servicer = self.servicer
            await drain_envoy(
                self.envoy,
                self.config.spec.listeners.http,
                grace,
                settle_max_s=self._settle_max_s,
                epp_active=lambda: servicer.active if servicer is not None else 0,
            )
        if self.envoy is not None:
            await self.envoy.stop()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        for server in self._grpc_servers:
            await server.stop(grace if grace > 0 else None)
        if self._sync is not None:  # after the last request: its end is told to the peers
            await self._sync.stop()
        if self._web is not None:
            await self._web.cleanup()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._scrapers is not None:
            await self._scrapers.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        log.info("stopped")

    async def _stop_source(self) -> None:
        """Stop following the source first (routing goes on with the datastore as it is): a
        Kubernetes source releases its Lease as it stops, so another replica takes over the
        status writes within one retry period instead of a whole lease duration."""
        task = self._source_task
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
