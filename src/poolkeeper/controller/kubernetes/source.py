"""`KubernetesResourceSource`: pools, models and Pods from the API server → the datastore.

The Kubernetes implementation of the `ResourceSource` seam (`controller/source.py`).

start(): list InferencePools (x-k8s v1alpha2, or v1alpha1 where only that is served; k8s.io v1),
InferenceModels (v1alpha2, else v1alpha1), InferenceObjectives and InferenceModelRewrites
(v1alpha2) and Pods in the namespace (a resource the API server does not serve counts as empty
and is looked for again later), apply them in one datastore write, and yield the GatewayConfig
given at construction. An unreachable API server is retried with backoff for
`start_timeout_s`, then a ConfigError says why.

run(): one follower per kind watches from the list's resourceVersion (bookmarks keep it fresh)
and applies every event as it comes: a Pod that turns NotReady leaves the datastore on that
one event. When a watch fails (410 Gone, a dropped stream, the API server down), the follower
marks itself stale, backs off with jitter (a 429 waits the server's Retry-After instead),
re-lists and prunes whatever vanished in the gap, then watches again; a successful list
resets the backoff, so every replica is back within one capped delay (`backoff_max_s`, 4 s)
of the API server's return. A 403 is logged at ERROR with the API server's own message (the
verb and resource refused), on every attempt. Beside them: the leader election and the status
writer (statuses are reconciled after every resource change, when leadership is gained, and
every `resync_s` from the cache, writing only what differs).

healthy(): the first full sync is done. As upstream's EPP, readiness never depends on the API
server afterwards: through an outage the datastore keeps the last known state and routing goes
on; `stale_s()` says for how long it has not been kept in step (a metric and the retry logs).
run() releases the Lease when cancelled, whatever else ends with it.

This module owns the start, the run and the status writes; the settings and the source's state
are `source_state.py`, the list-and-watch followers `source_watch.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.kubernetes.api_errors import ApiUnavailable, Forbidden
from poolkeeper.controller.kubernetes.source_watch import KubeFollowers
from poolkeeper.errors import ConfigError

__all__ = ["KubernetesResourceSource"]

log = logging.getLogger(__name__)


class KubernetesResourceSource(KubeFollowers):
    """Feeds a datastore from the API server and keeps it in step (a `ResourceSource`)."""

    async def start(self) -> GatewayConfig:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.start_timeout_s
        backoff = self._backoff()
        while True:
            try:
                for cache in self._caches():
                    await self._list(cache)
                break
            except Forbidden as exc:
                # RBAC is not going to change by itself within the start timeout: say so now.
                log.error("permission denied listing resources: %s", exc)
                raise ConfigError(
                    f"the Kubernetes API server refused to list resources in namespace "
                    f"{self.settings.namespace} ({exc}); the EPP's Role needs list and watch on "
                    f"them (deploy/rbac.yaml)"
                ) from exc
            except ApiUnavailable as exc:
                if loop.time() >= deadline:
                    raise ConfigError(
                        f"cannot list resources in namespace {self.settings.namespace} from the "
                        f"Kubernetes API server: {exc}"
                    ) from exc
                delay = self._delay(backoff, exc)
                log.warning("listing resources failed (%s); retrying in %.1fs", exc, delay)
                await self._sleep(delay)
        self._apply(resources=True)
        if not self._datastore.snapshot().pool_keys():
            wanted = ", ".join(self.settings.pool_names) or "any"
            log.warning(
                "no InferencePool (%s) in namespace %s yet; waiting for one",
                wanted,
                self.settings.namespace,
            )
        return self.gateway_config

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(self._follow(c), name=f"watch {c.kind}") for c in self._caches()
        ]
        if self.settings.write_status or self.settings.leader_election:
            tasks.append(asyncio.create_task(self.elector.run(self._sleep), name="lease"))
        if self.settings.write_status:
            tasks.append(asyncio.create_task(self._write_statuses(), name="status"))
            tasks.append(asyncio.create_task(self._resync_loop(), name="resync"))
        try:
            # asyncio.wait, not gather: cancelling run() must reach every task exactly once
            # (below). A gather cancels its children itself and returns at the first one
            # cancelled, so a second cancel landed inside the elector's Lease release.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:  # none should end (each catches its own errors): a bug
                if not task.cancelled() and task.exception() is not None:
                    log.error("%s stopped", task.get_name(), exc_info=task.exception())
        finally:
            for task in tasks:
                task.cancel()
            # Shielded: a second cancel of run() (shutdown timing out) must not cut the
            # Lease release short; it takes one GET and one PUT.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
            await self.api.close()

    # --- status --------------------------------------------------------------------------------

    async def reconcile_statuses(self) -> int:
        """Write the statuses that differ now (only as leader); returns the writes made."""
        if not self.settings.write_status or not self.elector.is_leader():
            return 0
        verdicts = self._datastore.snapshot().model_index.verdicts
        kind = self.state.models_cache.kind
        return await self.status_writer.reconcile(kind, self._models_by_key, verdicts)

    async def _write_statuses(self) -> None:
        while True:
            await self._status_due.wait()
            self._status_due.clear()
            with contextlib.suppress(ApiUnavailable):
                await self.reconcile_statuses()

    async def _resync_loop(self) -> None:
        while True:
            await self._sleep(self.settings.resync_s)
            self.resyncs += 1
            self._status_due.set()
