"""Prometheus metrics of the gateway, with the upstream EPP's names, labels and buckets
(`pkg/epp/metrics/metrics.go@v0.5.1`, gie.md §4.2), so upstream dashboards and alerts work.

Each `GatewayMetrics` owns its own `CollectorRegistry` (never the global one), so several
gateways, tests and the quickstart can live in one process. It implements the ext_proc
`ExchangeObserver` hooks. Pool gauges and the scheduler's plugin/prefix-index measurements are
read at scrape time from callables, so no loop has to keep them fresh. Label values that come
from clients are capped as upstream caps them: model names (`model_name` and
`target_model_name` share `max_label_values` values) and fairness ids
(`fairness_id_label_limit`); past the cap, new ones are reported as "other". Each value is
sanitised first (control characters replaced, at most `MAX_LABEL_CHARS` characters), so neither
many names nor long ones can bloat /metrics.

Exposition differs from prometheus_client's default in two ways, both to look like upstream's
Go client: no `_created` series, and (unless `objective_names=False`) every `inference_model_*`
family is also exposed as `inference_objective_*`, the v1.1+ name, with the same samples.
llm-d-router's `llm_d_epp_*` families come beside them (`telemetry/llmd.py`), the flow-control
ones labelled as upstream's: the flow's fairness id, the request's priority (a number), the
pool, model and target.

Where each part lives: the instruments recorded per request, `request_instruments.py`; the
families read at scrape time, `pool_collector.py`, `scheduling_collector.py` (with the KV-event
path's, `kv_collector.py`), `epp_collectors.py`; the label caps, `labels.py`; the exposition,
`exposition.py`; rendering off the event loop, `render.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import FilteredOut, GatewayError
from poolkeeper.requestcontrol.types import RoutingDecision, Usage
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.telemetry.epp_collectors import (
    ClientConnectionsCollector,
    ObserverCollector,
    ObserverStats,
    RefusedCollector,
    StaleCollector,
    StreamsCollector,
)
from poolkeeper.telemetry.exposition import CONTENT_TYPE, Exposition
from poolkeeper.telemetry.flowqueue import QueueCollector, QueueStats
from poolkeeper.telemetry.labels import LabelCap
from poolkeeper.telemetry.llmd import LlmdRequestMetrics
from poolkeeper.telemetry.llmd_families import LlmdFamilies, ScrapeErrors
from poolkeeper.telemetry.pool_collector import PoolCollector, PoolStats
from poolkeeper.telemetry.render import OffLoopRenderer
from poolkeeper.telemetry.request_instruments import (
    DURATION_BUCKETS,
    INPUT_TOKEN_BUCKETS,
    NTPOT_BUCKETS,
    OUTPUT_TOKEN_BUCKETS,
    REQUEST_SIZE_BUCKETS,
    RESPONSE_SIZE_BUCKETS,
    RequestInstruments,
)
from poolkeeper.telemetry.scheduling_collector import SchedulingCollector


class GatewayMetrics(RequestInstruments):
    """The EPP's metrics; pass it as the ext_proc observer."""

    def __init__(
        self,
        *,
        pool_stats: Callable[[], Iterable[PoolStats]] | None = None,
        scheduling: SchedulingStats | None = None,
        flow_stats: Callable[[], Iterable[QueueStats]] | None = None,
        max_label_values: int = 1000,
        fairness_id_label_limit: int = 1000,
        objective_names: bool = True,
        endpoint_of: Callable[[str], tuple[str, str, str] | None] | None = None,
    ) -> None:
        """`endpoint_of`: (name, namespace, hostport) of the endpoint at a `host:port`, for
        the scheduler-attempt labels (None: the labels stay empty). `fairness_id_label_limit`:
        distinct `fairness_id` values kept, then `other` (upstream's
        --fairness-id-metric-label-limit; 0: every value is `other`)."""
        self.registry = CollectorRegistry()
        self._endpoint_of = endpoint_of
        self._defer: Callable[[Callable[[], None]], object] | None = None
        self._exposition = Exposition(self.registry, objective_names=objective_names)
        self._renderer = OffLoopRenderer(self._exposition)
        # One cap for both model labels, as upstream's (they share their 1,000 values).
        self._model = self._target = LabelCap(max_label_values)
        caps = {
            "model_name": self._model,
            "target_model_name": self._target,
            "fairness_id": LabelCap(fairness_id_label_limit),
        }
        self._cap: Callable[[str, str], str] = lambda label, value: caps[label](value)
        r = self.registry
        self.llmd = LlmdRequestMetrics(
            r,
            self._cap,
            {
                "duration": DURATION_BUCKETS,
                "request_size": REQUEST_SIZE_BUCKETS,
                "response_size": RESPONSE_SIZE_BUCKETS,
                "input_tokens": INPUT_TOKEN_BUCKETS,
                "output_tokens": OUTPUT_TOKEN_BUCKETS,
                "ntpot": NTPOT_BUCKETS,
            },
        )
        self.families = LlmdFamilies(
            r, objective_names=objective_names, token_buckets=INPUT_TOKEN_BUCKETS
        )
        self._model_instruments(r)
        if pool_stats is not None:
            r.register(PoolCollector(pool_stats))
        if scheduling is not None:
            r.register(SchedulingCollector(scheduling))
        self._flow_instruments(r)
        if flow_stats is not None:
            r.register(QueueCollector(flow_stats, self._cap))

    def follow_source(self, stale_s: Callable[[], float]) -> None:
        """Export how long the resource source has not been in step (Kubernetes: watches
        down, the last known state served); 0 while it is."""
        self.registry.register(StaleCollector(stale_s))

    def follow_refused(self, source: Callable[[], int]) -> None:
        """Export the count of gRPC calls refused for want of Envoy's token (extproc/auth)."""
        self.registry.register(RefusedCollector(source))

    def follow_streams(self, source: Callable[[], tuple[int, int]]) -> None:
        """Export the ext_proc streams held and those refused at the cap (held, refused)."""
        self.registry.register(StreamsCollector(source))

    def follow_client_connections(self, source: Callable[[], tuple[int, int, int, int]]) -> None:
        """Export the per-client-address connection cap's counts (held, addresses, refused,
        untracked)."""
        self.registry.register(ClientConnectionsCollector(source))

    def follow_scrapes(self, source: ScrapeErrors) -> None:
        """Export the model-server scrape failures (poll, extract) as upstream's data-layer
        error counters."""
        self.families.follow_scrapes(source)

    def follow_observer(self, source: Callable[[], ObserverStats]) -> None:
        """Export the response observer's waiting room (when the runtime has one)."""
        self.registry.register(ObserverCollector(source))

    def defer_request_path(self, schedule: Callable[[Callable[[], None]], object]) -> None:
        """Record the request path's samples (`routed`, `flow_outcome`) through `schedule`,
        the event loop's `call_soon`: a routed request's replies then leave before its ~14
        samples are taken (about a fifth of the route work), not after. Same samples, same
        order (call_soon is FIFO); what a request's end records always comes later, on a
        later message or access-log entry."""
        self._defer = schedule

    def _labels(self, decision: RoutingDecision) -> tuple[str, str]:
        return self._model(decision.model_name), self._target(decision.target_model)

    # -- ExchangeObserver -------------------------------------------------------------------
    def routed(self, decision: RoutingDecision, request_bytes: int, route_seconds: float) -> None:
        if self._defer is not None:
            self._defer(functools.partial(self._routed, decision, request_bytes, route_seconds))
        else:
            self._routed(decision, request_bytes, route_seconds)

    def _routed(self, decision: RoutingDecision, request_bytes: int, route_seconds: float) -> None:
        self.scheduler_duration.observe(route_seconds)
        self.llmd.routed(decision, request_bytes, route_seconds)
        if not decision.model_name:
            return  # header-only requests carry no model: not an inference request
        model, target = self._labels(decision)
        self.request_total.labels(model, target).inc()
        if self.families.objective_requests is not None:
            priority = str(decision.priority or 0)
            self.families.objective_requests.labels(model, target, priority).inc()
        self.request_sizes.labels(model, target).observe(request_bytes)
        self.running_requests.labels(model).inc()
        if decision.endpoints:
            lookup = self._endpoint_of
            self.families.scheduled(target, lookup(decision.endpoints[0]) if lookup else None)

    def rejected(self, model_name: str, error: GatewayError, request_bytes: int) -> None:
        # Like upstream, errors after model resolution (shed, no endpoint) carry the target.
        target = self._target(error.target_model) if error.target_model else ""
        self.request_error_total.labels(self._model(model_name), target, error.code).inc()
        self.llmd.rejected(model_name, error.target_model, error.code)
        if isinstance(error, FilteredOut):  # the scheduler ran and found no endpoint
            self.families.not_scheduled(target)

    def finished(
        self,
        decision: RoutingDecision,
        *,
        status: int,
        usage: Usage | None,
        seconds: float,
        response_bytes: int,
    ) -> None:
        if not decision.model_name:
            return
        self.llmd.finished(
            decision, status=status, usage=usage, seconds=seconds, response_bytes=response_bytes
        )
        model, target = self._labels(decision)
        self.running_requests.labels(model).dec()
        if status == 499:
            return  # the client closed the stream: upstream counts no error (and no latency)
        if status >= 400 or status == 0:
            self.request_error_total.labels(model, target, "ModelServerError").inc()
            return
        self.request_duration.labels(model, target).observe(seconds)
        self.response_sizes.labels(model, target).observe(response_bytes)
        if usage is not None and not usage.estimated:
            # Upstream records token counts only when positive, and only the server's own.
            if usage.prompt_tokens > 0:
                self.input_tokens.labels(model, target).observe(usage.prompt_tokens)
            if usage.cached_tokens and self.families.objective_cached is not None:
                self.families.objective_cached.labels(model, target).observe(usage.cached_tokens)
            if usage.completion_tokens > 0:
                self.output_tokens.labels(model, target).observe(usage.completion_tokens)
                if seconds > 0:
                    self.ntpot.labels(model, target).observe(seconds / usage.completion_tokens)

    # -- DirectorObserver (requestcontrol.director) ------------------------------------------
    def first_token(self, decision: RoutingDecision, seconds: float) -> None:
        self.llmd.first_token(decision, seconds)

    def model_rewritten(self, rewrite: str, model: str, target: str) -> None:
        self.llmd.model_rewritten(rewrite, model, target)

    # -- FlowObserver (requestcontrol.flowoutcomes) -----------------------------------------
    def flow_outcome(
        self,
        *,
        pool: str,
        band: Criticality,
        model: str,
        target: str,
        fairness_id: str,
        priority: int,
        outcome: str,
        waited_s: float,
    ) -> None:
        """One request's flow-control outcome, labelled as upstream: its fairness id and
        priority (the number), pool, model and target (`band` is poolkeeper's own)."""
        del band  # upstream labels by the priority; the band follows from it
        record = functools.partial(
            self._flow_outcome, pool, model, target, fairness_id, priority, outcome, waited_s
        )
        if self._defer is not None:
            self._defer(record)
        else:
            record()

    def _flow_outcome(
        self,
        pool: str,
        model: str,
        target: str,
        fairness_id: str,
        priority: int,
        outcome: str,
        waited_s: float,
    ) -> None:
        pool_name = pool.rpartition("/")[2]
        fairness = self._cap("fairness_id", fairness_id)
        self.flow_queue_duration.labels(
            fairness, str(priority), outcome, pool_name, self._model(model), self._target(target)
        ).observe(waited_s)
        self.families.flow_requests.labels(outcome, str(priority), pool_name).inc()

    def flow_held(self, *, pool: str, band: Criticality, outcome: str, held_s: float) -> None:
        """A `holdNewPrefixes` hold ended (poolkeeper's own family; upstream has no hold)."""
        del band  # held requests are of `queue` bands; the pool and outcome say enough
        series = self.flow_hold_duration.labels(pool.rpartition("/")[2], outcome)
        if self._defer is not None:
            self._defer(functools.partial(series.observe, held_s))
        else:
            series.observe(held_s)

    # -- exposition -------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self._exposition)

    async def render_off_loop(self) -> bytes:
        """`render`, with only the collectors of the EPP's state run on the event loop; the
        instruments' samples and the text (most of a large page) on the metrics thread, one
        render for every scrape waiting (`render.py`)."""
        return await self._renderer.render()

    async def close(self) -> None:
        """Stop the metrics thread (the runtime's stop); no scrape is served after this."""
        await self._renderer.close()

    def app(self) -> web.Application:
        async def metrics(_request: web.Request) -> web.Response:
            body = await self.render_off_loop()
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app
