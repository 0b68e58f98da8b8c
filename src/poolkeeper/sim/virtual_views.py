"""The servers of a virtual-time fleet as its router sees them: scraped, plus what is in flight.

`ScrapedViews` keeps one `EndpointState` per server: the engine's metrics as of the last scrape
tick (every `scrape_interval` virtual seconds; a server whose state did not change keeps its
snapshot and only gets a fresh timestamp every `timestamp_refresh` seconds), the requests routed
to it and not finished (`inflight_*`), those routed since its last scrape (`unseen_*`) and, with
`answers_seen`, how many of those already gave their first token. `VirtualFleet` (`sim/virtual.py`)
tells it when a server is about to change, a request was routed, answered or finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.sim.engine import EngineModel
from poolkeeper.sim.request import SimRequest


class ScrapedViews:
    """Per-server `EndpointState`s on the fleet's virtual clock (see the module docstring)."""

    def __init__(
        self,
        engines: Sequence[EngineModel],
        endpoints: Sequence[Endpoint],
        *,
        scrape_interval: float,
        timestamp_refresh: float,
        answers_seen: bool,
    ) -> None:
        self.engines = engines
        self.endpoints = endpoints
        self.scrape_interval = scrape_interval
        self.timestamp_refresh = timestamp_refresh
        self.answers_seen = answers_seen
        n = len(self.engines)
        self._metrics = [EndpointMetrics() for _ in range(n)]
        self.states = [
            EndpointState(endpoint=e, metrics=m)
            for e, m in zip(self.endpoints, self._metrics, strict=True)
        ]
        self._snap_tick = [-1] * n
        self._dirty = [True] * n
        self._inflight = [0] * n
        self._inflight_tokens = [0] * n
        self._inflight_models: list[dict[str, int]] = [{} for _ in range(n)]
        self._unseen = [0] * n
        self._unseen_tokens = [0] * n
        self._answered = [0] * n  # of the unseen, those whose first token is out
        self._scrapes = [0] * n  # scrapes per server: which scrape a request was unseen by
        self._unseen_by: dict[str, int] = {}  # request id -> its server's scrape count at routing
        self._refreshed_tick = -1

    def tick(self, now: float) -> int:
        return int(now / self.scrape_interval) if self.scrape_interval > 0 else -1

    def scrape(self, i: int, at: float) -> None:
        if self._dirty[i]:
            s = self.engines[i].stats()
            self._metrics[i] = EndpointMetrics(
                waiting=s.waiting,
                running=s.running,
                kv_cache_usage=s.kv_cache_usage,
                active_adapters=frozenset(s.running_adapters),
                waiting_adapters=frozenset(s.waiting_adapters),
                max_adapters=s.max_loras,
                block_size=s.block_size,
                num_gpu_blocks=s.num_gpu_blocks,
                updated_at=at,
                # What a scraper reads from the `model_name` label of the simulator's page.
                served_model=self.engines[i].config.model,
            )
            self._dirty[i] = False
        else:  # unchanged since the last scrape: only the time moves (positional: cheap)
            m = self._metrics[i]
            self._metrics[i] = EndpointMetrics(
                m.waiting, m.running, m.kv_cache_usage, m.active_adapters, m.waiting_adapters,
                m.max_adapters, m.block_size, m.num_gpu_blocks, at,
                served_model=m.served_model,
            )  # fmt: skip
        self._unseen[i] = 0
        self._unseen_tokens[i] = 0
        self._answered[i] = 0
        self._scrapes[i] += 1
        self.rebuild(i)

    def rebuild(self, i: int) -> None:
        self.states[i] = EndpointState(
            endpoint=self.endpoints[i],
            metrics=self._metrics[i],
            inflight_requests=self._inflight[i],
            inflight_tokens=self._inflight_tokens[i],
            unseen_requests=self._unseen[i],
            unseen_tokens=self._unseen_tokens[i],
            unseen_answered=self._answered[i],
            inflight_models=MappingProxyType(dict(self._inflight_models[i])),
        )

    def before_change(self, i: int, now: float) -> None:
        """Snapshot a server as of the latest tick before its state changes at `now`."""
        if self.scrape_interval > 0:
            tick = self.tick(now)
            if self._snap_tick[i] < tick:
                self.scrape(i, tick * self.scrape_interval)
                self._snap_tick[i] = tick
        self._dirty[i] = True

    def views(self, now: float) -> list[EndpointState]:
        if self.scrape_interval <= 0:
            for i in range(len(self.engines)):
                self._dirty[i] = True
                self.scrape(i, now)
            return self.states
        tick = self.tick(now)
        if tick > self._refreshed_tick:
            at = tick * self.scrape_interval
            refresh, metrics, dirty = self.timestamp_refresh, self._metrics, self._dirty
            for i in range(len(self.engines)):
                if self._snap_tick[i] < tick:
                    if not dirty[i] and at - metrics[i].updated_at < refresh:
                        continue  # nothing changed and the timestamp is recent enough
                    self.scrape(i, at)
                    self._snap_tick[i] = tick
            self._refreshed_tick = tick
        return self.states

    def routed(self, i: int, request: SimRequest) -> None:
        """A request was just submitted to server `i` (after `before_change`)."""
        self._inflight[i] += 1
        self._inflight_tokens[i] += request.prompt_tokens
        models = self._inflight_models[i]
        models[request.model] = models.get(request.model, 0) + 1
        self._unseen[i] += 1
        self._unseen_tokens[i] += request.prompt_tokens
        if self.answers_seen:
            self._unseen_by[request.request_id] = self._scrapes[i]
        self.rebuild(i)

    def first_token(self, i: int, request_id: str) -> None:
        """Server `i` gave the request its first token."""
        # Still unseen by a scrape (routed since the last one): it answered.
        if self._unseen_by.pop(request_id, -1) == self._scrapes[i]:
            self._answered[i] += 1
            self.rebuild(i)

    def finished(self, i: int, request: SimRequest) -> None:
        """The request finished on server `i`; the state is rebuilt by `rebuild` after the
        step's finished requests (the router's `on_finish` sees the counts, not the state)."""
        self._inflight[i] -= 1
        self._inflight_tokens[i] -= request.prompt_tokens
        models = self._inflight_models[i]
        if models[request.model] <= 1:
            del models[request.model]
        else:
            models[request.model] -= 1
