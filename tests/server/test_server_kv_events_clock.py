"""KV-event batches are stamped on the runtime's one clock (the decisions' `now`), wired from
the composition root into the prefix scorer's subscriber."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import zmq
import zmq.asyncio

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.datastore.endpoint import EndpointMetrics
from poolkeeper.datastore.snapshot import EndpointSpec
from poolkeeper.datastore.store import Datastore
from poolkeeper.kvevents import BlockStored, KVEventBatch, encode
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.presets import preset_document
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server.wiring import build_director
from tests.server.test_server_pool_changes import POOL
from tests.support.kvpub import Publisher

FAR = 1_000_000.0  # the runtime's clock, nowhere near time.monotonic()


class _Clock:
    def __init__(self) -> None:
        self.now = FAR

    def __call__(self) -> float:
        return self.now


def _wired(doc: dict[str, Any], port: int, **prefix: Any) -> tuple[Datastore, _Clock, Scheduler]:
    """One sim endpoint, and the scheduler the composition root builds from `doc` with the
    prefix scorer's kvEvents on `port` (and `prefix`'s parameters) on the FAR clock."""
    for p in doc["plugins"]:
        if p["type"] == "prefix-cache-scorer":
            p.setdefault("parameters", {}).update(kvEvents=True, kvEventsPort=port, **prefix)
    config = GatewayConfig.model_validate({"spec": {"scheduling": doc}})
    store = Datastore()
    store.set_resources([POOL], [])
    store.set_endpoints([EndpointSpec("sim-1", "127.0.0.1", labels={"app": "sim"})])
    clock = _Clock()
    scheduler = build_director(config, store, rng=random.Random(1), clock=clock).scheduler
    assert isinstance(scheduler, Scheduler)
    return store, clock, scheduler


async def test_a_sequence_gap_distrusts_the_endpoint_on_the_decisions_clock() -> None:
    (port,) = free_ports(1)
    store, clock, scheduler = _wired(preset_document("default"), port, kvEventsStaleAfterS=5)
    endpoint = "127.0.0.1:8000"
    (prefix,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    exact, subscriber = prefix.exact, prefix._subscriber
    assert exact is not None
    assert subscriber is not None
    pub = Publisher(port)
    payload = encode(KVEventBatch(ts=0.0, events=[BlockStored([7, 8], None)]))
    try:
        store.update_metrics(endpoint, EndpointMetrics(updated_at=FAR))  # on the loop: follow
        seq = await pub.until_applied(subscriber, payload)
        assert exact.fresh(endpoint, clock.now)
        assert exact.foreign_at == FAR  # a head this EPP did not send, stamped at clock()
        # A gap (a lost batch): the endpoint's view is distrusted for 5 s of the decisions'
        # clock, not of time.monotonic() (which would have ended "long ago" at FAR).
        await pub.until_applied(subscriber, payload, seq + 2, every=2)
        assert not exact.fresh(endpoint, clock.now)
        clock.now = FAR + 5.0
        assert exact.fresh(endpoint, clock.now)
    finally:
        await subscriber.close()
        pub.close()


async def test_a_step_phase_scorer_gets_the_batches_on_the_decisions_clock() -> None:
    """The composition root feeds the subscriber's batches to a step-phase scorer whose
    prefix scorer has kvEvents, the engine's wall-clock stamp moved onto the decisions' clock."""
    import time

    from poolkeeper.scheduling.candidate_presets import candidate_document
    from poolkeeper.scheduling.plugins.stepphase_scorer import StepPhaseScorer
    from poolkeeper.scheduling.steplive import StepBatchFeed

    (port,) = free_ports(1)
    store, _, scheduler = _wired(candidate_document("default-stepclock-w4"), port)
    endpoint = "127.0.0.1:8000"
    (prefix,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    (scorer,) = [p for p in scheduler.plugins.values() if isinstance(p, StepPhaseScorer)]
    subscriber = prefix.subscriber
    assert subscriber is not None
    assert isinstance(subscriber.on_batch, StepBatchFeed)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        store.update_metrics(endpoint, EndpointMetrics(updated_at=FAR))  # on the loop: follow
        for seq in range(500):  # bounded: until the SUB socket has connected
            stamp = time.time() - 0.25  # a step that ended 250 ms ago by the engine's clock
            batch = KVEventBatch(ts=stamp, events=[BlockStored([seq + 100], None)])
            await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), encode(batch)])
            await asyncio.sleep(0.005)
            if subscriber.received:
                break
        last = scorer.clock.clocks[endpoint].last_batch
        assert last is not None
        assert FAR - 0.35 < last < FAR - 0.2  # 250 ms before the decisions' now
    finally:
        await subscriber.close()
        pub.close(linger=0)
        ctx.term()
