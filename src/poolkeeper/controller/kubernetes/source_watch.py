"""Following the API server: one list-and-watch per kind (`_follow`), re-listing and pruning
after a failed watch with backoff (a 429's Retry-After honoured), the followers that lost
their watch counted as degraded, and every change applied to the datastore in one write
(`_apply`, which also recomputes the models' statuses)."""

from __future__ import annotations

import asyncio
import logging
from types import MappingProxyType
from typing import Any

from poolkeeper.api.status import compute_model_statuses
from poolkeeper.controller.kubernetes.api_errors import Forbidden, Gone, NotFound, Throttled
from poolkeeper.controller.kubernetes.backoff import Backoff
from poolkeeper.controller.kubernetes.objects import ObjectCache
from poolkeeper.controller.kubernetes.source_state import KubeSourceState

# The source's logger, as before the followers had a module of their own.
log = logging.getLogger("poolkeeper.controller.kubernetes.source")


class KubeFollowers(KubeSourceState):
    """List, watch and apply (`KubernetesResourceSource` extends this)."""

    # --- listing and watching ----------------------------------------------------------------

    def _backoff(self) -> Backoff:
        s = self.settings
        return Backoff(s.backoff_initial_s, s.backoff_max_s, rng=self._rng)

    def _delay(self, backoff: Backoff, exc: Exception) -> float:
        """How long to wait after `exc`: a 429's Retry-After (plus up to 10% jitter, so the
        replicas it turned away do not all come back in the same instant), else the backoff."""
        if isinstance(exc, Throttled):
            return backoff.after(exc.retry_after_s)
        return backoff.next()

    async def _list(self, cache: ObjectCache) -> list[str]:
        """List the first served version of the cache's objects, replace and prune. None
        served (the CRD is not installed): empty, and `version` None so it is looked for again."""
        items: list[dict[str, Any]] = []
        version: str | None = None
        cache.installed = False
        for kind in cache.candidates or (cache.kind,):
            try:
                items, version = await self.api.list(kind)
            except NotFound:
                continue
            if kind != cache.kind:
                log.info("watching %s (the version the API server serves)", kind)
                cache.kind = kind
            cache.installed = True
            break
        pruned = cache.replace(items, version)
        for key in pruned:
            log.info("%s %s vanished while the watch was down; pruned", cache.kind.kind, key)
        return pruned

    async def _follow(self, cache: ObjectCache) -> None:
        """Watch one kind forever: apply events; on failure back off, re-list, prune, resume."""
        backoff = self._backoff()
        name = str(cache.kind)
        relist = False
        while True:
            try:
                if relist or cache.version is None:
                    await self._list(cache)
                    self.relists += 1
                    self._apply(resources=cache is not self.state.pods_cache)
                    relist = False
                    backoff.reset()  # in step again: the next failure starts small
                lost = self._degraded.pop(name, None)
                if lost is not None:
                    log.info("watch of %s is back; in step after %.1fs", name, self._clock() - lost)
                if cache.version is None:  # not served: look again later
                    await self._sleep(self.settings.backoff_max_s)
                    relist = True
                    continue
                events = 0
                async for event_type, obj in self.api.watch(
                    cache.kind, cache.version, timeout_s=self.settings.watch_timeout_s
                ):
                    events += 1
                    backoff.reset()
                    if cache.apply_event(event_type, obj):
                        self._apply(resources=cache is not self.state.pods_cache)
                # The server ended the watch (timeoutSeconds): resume from the last version;
                # after a stream with no event at all, not at once (no hot loop against a
                # server that keeps closing streams).
                if not events:
                    await self._sleep(backoff.next())
            except asyncio.CancelledError:
                raise
            except Gone:
                # The first 410 re-lists at once; repeated ones (no event in between) back off.
                self._degraded.setdefault(name, self._clock())
                relist = True
                delay = backoff.next() if backoff.failures else 0.0
                backoff.failures = max(backoff.failures, 1)
                log.info("watch of %s: resource version too old (410); re-listing in %.2fs",
                         name, delay)  # fmt: skip
                if delay:
                    await self._sleep(delay)
            except Exception as exc:  # ApiUnavailable, a dropped stream, bad JSON
                self._degraded.setdefault(name, self._clock())
                relist = True
                delay = self._delay(backoff, exc)
                message = "watch of %s failed (%s); serving the last known state (%.1fs stale); "
                log.log(
                    logging.ERROR if isinstance(exc, Forbidden) else logging.WARNING,
                    message + "re-listing in %.2fs",
                    name,
                    exc,
                    self.stale_s(),
                    delay,
                )
                await self._sleep(delay)

    # --- applying to the datastore -----------------------------------------------------------

    def _apply(self, *, resources: bool) -> None:
        state = self.state
        if not resources:
            self._datastore.set_endpoints(state.endpoints(), source="k8s")
            return
        models = state.models()
        snapshot = self._datastore.set_all(
            state.pools(), [*models, *state.policies()], state.endpoints(), source="k8s"
        )
        verdicts = snapshot.model_index.verdicts
        self._models_by_key = {m.key: m for m in models}
        self._statuses = MappingProxyType(compute_model_statuses(models, verdicts, now=self._now()))
        self._status_due.set()
