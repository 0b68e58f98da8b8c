"""`GatewayRuntime`: the composition root. Resource source → datastore → scrapers → Director →
ext_proc + health + metrics servers → Envoy child process; and the reverse on shutdown.

The one startup path: the `ResourceSource` the options name (files today; `controller/source.py`)
fills the datastore and yields the GatewayConfig, and everything else is built from those two.

Shutdown drains as Kubernetes expects: readiness first, then Envoy's listeners, then what was
accepted finishes within the grace period (`runtime_stop.py`, which says how).

The runtime itself is four modules: `runtime_state.py` (`RuntimeState`: its fields, `ready()`,
its addresses), `runtime_envoy.py` (the managed Envoy's start), `runtime_stop.py` (the drain
and stop) and this one (the start). The parts it composes live beside it: `options.py`
(`ServeOptions`), `epp_ports.py` (the EPP's ext_proc, health and metrics servers),
`envoy_bootstrap.py`, `managed_envoy.py` and `envoy_drain.py` (the Envoy it runs:
parameters, start, drain), `stats_views.py` (what the metrics read at scrape time),
`housekeeping.py` (periodic tasks), `sync_service.py`, `wiring.py` (the Director).
"""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
from aiohttp import web

from poolkeeper.backend.scraper_manager import ScraperManager
from poolkeeper.envoy.process import find_envoy
from poolkeeper.errors import ConfigError
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.auth import EnvoyOnly, new_token
from poolkeeper.extproc.contracts import BodyBudget
from poolkeeper.extproc.heap import keep_freed_pages
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.extproc.signal_tap import SignalTap
from poolkeeper.extproc.tls import server_credentials, ssl_context
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig
from poolkeeper.scheduling.replicasync.peerunseen import PeerUnseen
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.scheduling.steplive import StepBatchFeed
from poolkeeper.server.envoy_bootstrap import fail_open_split_targets
from poolkeeper.server.epp_ports import (
    extproc_settings,
    health_server,
    health_service,
    metrics_runner,
    side_services,
)
from poolkeeper.server.housekeeping import expire_detached, trim_after_bursts
from poolkeeper.server.runtime_envoy import ManagedEnvoyStart
from poolkeeper.server.runtime_stop import RuntimeStop
from poolkeeper.server.stats_views import endpoint_of, flow_stats, pool_stats
from poolkeeper.server.sync_service import SyncService
from poolkeeper.server.transport import export_transport, refused_calls, start_extproc
from poolkeeper.server.wiring import build_director
from poolkeeper.telemetry.epp_collectors import ObserverStats
from poolkeeper.telemetry.metrics import GatewayMetrics

log = logging.getLogger("poolkeeper.server")


class GatewayRuntime(ManagedEnvoyStart, RuntimeStop):
    """The composition root (see the module docstring); its fields are `RuntimeState`'s."""

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
        tap = SignalTap.from_env() if observing else None  # bench only: scripts/step_signal.py
        if tap is not None:  # and the KV-event batches' arrivals
            for plugin in getattr(self.director.scheduler, "plugins", {}).values():
                if isinstance(plugin, PrefixCacheScorer) and plugin.subscriber is not None:
                    feed = plugin.subscriber.on_batch  # a step clock's feed keeps its place
                    if isinstance(feed, StepBatchFeed):
                        feed.then = tap.kv_batch
                    else:
                        plugin.subscriber.on_batch = tap.kv_batch
        self.detached = detached = DetachedExchanges(tap=tap) if observing else None
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
        director, flow = self.director, self.director.flow

        def peers(unseen: PeerUnseen | None) -> None:
            director.peers = unseen

        self._sync = sync = SyncService(
            config,
            scheduler,
            self.datastore,
            clock=self.clock,
            wake=flow.wake if flow is not None else None,
            on_unseen=peers,
        )
        await sync.start()
        self.metrics.registry.register(sync.collector())

    async def _wait_ready(self, within_s: float) -> None:
        """Give the first scrapes a moment, so the first requests see fresh metrics."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while not (self.ready() and self.director is not None and self.director.ready()):
            if loop.time() >= deadline:
                log.warning("no endpoint has fresh metrics yet; starting anyway")
                return
            await asyncio.sleep(0.05)
