"""What the metrics read from the running gateway at scrape time: each pool's load
(`pool_stats`, with the admission section's saturation verdict), each flow-control queue
(`flow_stats`) and an endpoint's labels (`endpoint_of`). Read-only views of the datastore,
the GatewayConfig and the Director's gate; `GatewayMetrics` (telemetry/metrics.py) calls them
through the runtime, which hands them its current state."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.datastore.store import Datastore
from poolkeeper.flowcontrol.saturation import SaturationDetector
from poolkeeper.requestcontrol.director import Director
from poolkeeper.telemetry.flowqueue import FlowQueue, QueueStats
from poolkeeper.telemetry.pool_collector import PoolStats


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _pstdev(values: list[float]) -> float:
    """Population standard deviation, as upstream's metrics logger computes it."""
    return statistics.pstdev(values) if values else 0.0


def pool_stats(
    datastore: Datastore, config: GatewayConfig | None, now: float
) -> Iterator[PoolStats]:
    """Each pool's load at `now` (the runtime's clock, the one metrics are stamped with;
    `config`: its admission section judges saturation)."""
    snapshot = datastore.snapshot()
    # The admission section's detector, as the gate judges saturation (read-only here).
    detector = None
    if config is not None:
        spec = config.spec
        detector = SaturationDetector(spec.admission, staleness_s=spec.scraping.staleness_s)
    for key in snapshot.pool_keys():
        states = snapshot.states(key)
        kv = [s.metrics.kv_cache_usage for s in states]
        queue = [float(s.metrics.waiting) for s in states]
        running = [float(s.metrics.running) for s in states]
        ready = sum(1 for s in states if s.metrics.reachable)
        per_pod = tuple((s.endpoint.name, float(s.metrics.waiting)) for s in states)
        report = detector.assess(states, now) if detector is not None else None
        yield PoolStats(
            key.rpartition("/")[2],
            _mean(kv),
            _mean(queue),
            ready,
            per_pod,
            average_running_requests=_mean(running),
            std_dev_kv_cache_utilization=_pstdev(kv),
            std_dev_queue_size=_pstdev(queue),
            std_dev_running_requests=_pstdev(running),
            saturation=report.saturation if report is not None else None,
            stale_endpoints=report.stale if report is not None else 0,
        )


def endpoint_of(datastore: Datastore, hostport: str) -> tuple[str, str, str] | None:
    """(name, namespace, hostport) of the endpoint at `hostport` (metrics labels)."""
    endpoint = datastore.snapshot().endpoint(hostport)
    return None if endpoint is None else (endpoint.name, endpoint.namespace, hostport)


def flow_stats(director: Director | None, config: GatewayConfig | None) -> Iterator[QueueStats]:
    """Each flow-control queue of the Director's gate (none without flow control)."""
    gate = director.flow if director is not None else None
    if gate is None:
        return
    bands = config.spec.flow_control.bands if config is not None else None
    for pool, band, requests, size in gate.queue_stats():
        bound = bands.of(band) if bands is not None else None
        flows = tuple(
            FlowQueue(flow, priority, model, target, n, nbytes)
            for (flow, priority, model, target), (n, nbytes) in gate.queued_flows(
                pool, band
            ).items()
        )
        yield QueueStats(
            pool.rpartition("/")[2],
            band,
            requests,
            size,
            max_requests=bound.max_requests if bound is not None else 0,
            max_bytes=bound.max_bytes if bound is not None else 0,
            flows=flows,
            held=gate.held(pool, band),
        )
