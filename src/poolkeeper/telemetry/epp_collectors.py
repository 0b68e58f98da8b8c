"""The EPP's own state, read at scrape time from callables: gRPC calls refused for want of
Envoy's token, ext_proc streams held and refused, the per-client-address connection cap (also
`poolkeeper bbr`'s whole /metrics page), the response observer's waiting room, and how long the
resource source has not been in step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poolkeeper.telemetry.exposition import CONTENT_TYPE


@dataclass(frozen=True, slots=True)
class ObserverStats:
    """The response observer's waiting room (extproc/accesslog.py), read at scrape time."""

    waiting: int  # routed requests whose response has not been reported yet
    settled: int  # ended by their access-log entry
    given_up: int  # settled as unknown: over the limit or the TTL (entries lost)


class RefusedCollector(Collector):
    def __init__(self, source: Callable[[], int]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "inference_extension_epp_refused_calls",
            "gRPC calls to the EPP refused: they lacked the token of the Envoy serve runs.",
            value=self.source(),
        )


class StreamsCollector(Collector):
    def __init__(self, source: Callable[[], tuple[int, int]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        held, refused = self.source()
        yield GaugeMetricFamily(
            "poolkeeper_extproc_streams", "ext_proc streams the EPP holds now.", value=held
        )
        yield CounterMetricFamily(
            "poolkeeper_extproc_streams_refused",
            "ext_proc streams refused with RESOURCE_EXHAUSTED at requestHandling.maxStreams.",
            value=refused,
        )


class ClientConnectionsCollector(Collector):
    def __init__(self, source: Callable[[], tuple[int, int, int, int]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        held, addresses, refused, untracked = self.source()
        prefix = "poolkeeper_client_connections"
        yield GaugeMetricFamily(prefix, "Client connections counted by address now.", value=held)
        yield GaugeMetricFamily(
            f"{prefix}_addresses", "Client addresses holding counted connections.", value=addresses
        )
        yield CounterMetricFamily(
            f"{prefix}_refused",
            "Connections closed at edge.maxConnectionsPerClient.",
            value=refused,
        )
        yield CounterMetricFamily(
            f"{prefix}_untracked", "Connections let in uncounted: the table was full.",
            value=untracked,
        )  # fmt: skip


def client_connections_app(source: Callable[[], tuple[int, int, int, int]]) -> web.Application:
    """A `/metrics` page of the per-client-address connection cap's counts alone (`poolkeeper
    bbr`, which has no other metrics): the families `follow_client_connections` exports."""
    registry = CollectorRegistry()
    registry.register(ClientConnectionsCollector(source))

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


class ObserverCollector(Collector):
    def __init__(self, source: Callable[[], ObserverStats]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        stats = self.source()
        yield GaugeMetricFamily(
            "inference_extension_response_observer_waiting",
            "Routed requests whose end Envoy's access log has not reported yet.",
            value=stats.waiting,
        )
        yield CounterMetricFamily(
            "inference_extension_response_observer_settled",
            "Requests ended by their access-log entry.",
            value=stats.settled,
        )
        yield CounterMetricFamily(
            "inference_extension_response_observer_given_up",
            "Requests settled as unknown, their entry never seen (waiting-room limit or TTL).",
            value=stats.given_up,
        )


class StaleCollector(Collector):
    def __init__(self, stale_s: Callable[[], float]) -> None:
        self.stale_s = stale_s

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "poolkeeper_resource_source_stale_seconds",
            "Seconds the routing state has not been kept in step with its source (API server "
            "watches down: the last known state is served); 0 while in step.",
            value=self.stale_s(),
        )
