"""Draining and stopping the runtime (`GatewayRuntime.stop`).

Shutdown drains as Kubernetes expects (reliability finding 2): readiness turns NOT_SERVING
first, Envoy's listeners stop accepting at once (new connections are refused, so clients and
load balancers go to a peer instead of being accepted and cut later; idle keep-alive
connections are closed), every request already accepted gets up to the grace period (default
130 s, like upstream's chart) to finish, counted by Envoy itself and by the EPP's streams, then
Envoy, the gRPC servers and the scrapers stop. grpc.aio does not
stop on signals by itself, so `serve_until_signalled` installs its own handlers (SIGINT, SIGTERM,
SIGHUP: `signals.py`). Envoy runs in a session of its own (`envoy/tether.py`), so a terminal's
Ctrl-C reaches this process only, and this order is the one that runs.
"""

from __future__ import annotations

import asyncio
import logging

from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server.envoy_drain import drain_envoy
from poolkeeper.server.runtime_state import RuntimeState

log = logging.getLogger("poolkeeper.server")


class RuntimeStop(RuntimeState):
    """The runtime's drain and stop (`GatewayRuntime` extends this)."""

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
        if self.metrics is not None:  # after the last scrape: its render thread
            await self.metrics.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._scrapers is not None:
            await self._scrapers.close()
        if self.director is not None:  # no decision from here: KV-event sockets can go
            scheduler = self.director.scheduler
            if isinstance(scheduler, Scheduler):
                await scheduler.stop_following()
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
