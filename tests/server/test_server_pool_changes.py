"""The running EPP follows pool changes: the scheduler forgets what it keeps for an endpoint
that left the pool for good (absent past a grace, or replaced at its ip:port:
server/forgetting.py), and the replica syncer misses no change made while it started
(server/runtime.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from poolkeeper.api.pool import InferencePool
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.files import file_source
from poolkeeper.datastore.endpoint import EndpointMetrics
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.datastore.snapshot import EndpointSpec
from poolkeeper.datastore.store import Datastore
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.presets import preset_document
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server import sync_service
from poolkeeper.server.forgetting import FORGET_AFTER_S, AbsentEndpoints
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.replica_sync import RunningSync, start_replica_sync
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.server.wiring import build_director
from tests.scheduling.sched_factories import NOW, request
from tests.support.gateway_files import one_pool

POOL = InferencePool.model_validate(
    {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferencePool",
        "metadata": {"name": "pool"},
        "spec": {
            "selector": {"app": "sim"},
            "targetPortNumber": 8000,
            "extensionRef": {"name": "epp"},
        },
    }
)
PROMPT = "a long shared system prompt " * 100


def _specs(*hosts: int) -> list[EndpointSpec]:
    return [EndpointSpec(f"sim-{i}", f"10.0.0.{i}", labels={"app": "sim"}) for i in hosts]


def _store(*hosts: int) -> Datastore:
    store = Datastore()
    store.set_resources([POOL], [])
    store.set_endpoints(_specs(*hosts))
    return store


def _scrape(store: Datastore) -> None:
    for e in store.snapshot().all_endpoints():
        store.update_metrics(e.hostport, EndpointMetrics(updated_at=NOW - 0.01))


class _Clock:
    """The director's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Placed:
    """A scheduler whose forget calls are counted, with two prompts placed: `left` on
    10.0.0.1 (the endpoint the tests take away), `kept` on 10.0.0.2."""

    store: Datastore
    scheduler: Scheduler
    prefix: PrefixCacheScorer
    backlog: PrefillBacklogScorer
    forgets: list[set[str]]
    left: str = "10.0.0.1:8000"
    kept: str = "10.0.0.2:8000"

    def remembered(self) -> set[str]:
        index, backlog = self.prefix.index.endpoints(), self.backlog.backlog.snapshot()
        assert set(index) == set(backlog)
        return set(index)


def _placed(monkeypatch: pytest.MonkeyPatch, clock: Callable[[], float], **wiring: Any) -> _Placed:
    forgets: list[set[str]] = []
    forget = Scheduler.forget_endpoints

    def counted(self: Scheduler, keep: set[str]) -> None:
        forgets.append(set(keep))
        forget(self, keep)

    monkeypatch.setattr(Scheduler, "forget_endpoints", counted)
    store = _store(1, 2, 3)
    director = build_director(GatewayConfig(), store, rng=random.Random(1), clock=clock, **wiring)
    scheduler = director.scheduler
    assert isinstance(scheduler, Scheduler)
    (prefix,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    (backlog,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefillBacklogScorer)]
    _scrape(store)
    (pool,) = store.snapshot().pool_keys()
    states = store.snapshot().states(pool)
    # Two prompts, each placed on its own endpoint: both are recorded in the index and the
    # backlog (their first bytes have not come).
    gone = scheduler.schedule(request(prompt=PROMPT, request_id="a"), states[:1], now=NOW)
    stays = scheduler.schedule(request(prompt="other " * 400, request_id="b"), states[1:2], now=NOW)
    placed = _Placed(store, scheduler, prefix, backlog, forgets)
    assert (gone.primary.key, stays.primary.key) == (placed.left, placed.kept)
    assert placed.remembered() == {placed.left, placed.kept}
    return placed


def test_an_endpoint_back_within_the_grace_keeps_what_the_scheduler_learnt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    placed = _placed(monkeypatch, clock)
    store = placed.store
    # Metrics writes and a pool that only grows are no reason to forget anything.
    _scrape(store)
    store.set_endpoints(_specs(1, 2, 3, 4))
    # A readiness flap: the pod leaves the datastore and comes back, its engine cache intact.
    store.set_endpoints(_specs(2, 3, 4))
    clock.now = FORGET_AFTER_S - 1
    store.set_endpoints(_specs(2, 3, 4, 5))  # a pool change while it is away sweeps too
    store.set_endpoints(_specs(1, 2, 3, 4, 5))
    # A watch re-list that briefly lists no pool at all.
    store.set_resources([], [])
    store.set_resources([POOL], [])
    clock.now = 10 * FORGET_AFTER_S
    store.set_endpoints(_specs(1, 2, 3, 4, 5, 6))
    _scrape(store)
    assert placed.forgets == []
    assert placed.remembered() == {placed.left, placed.kept}


def test_an_endpoint_absent_past_the_grace_is_forgotten_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    placed = _placed(monkeypatch, clock)
    store = placed.store
    store.set_endpoints(_specs(2, 3))
    clock.now = FORGET_AFTER_S - 0.001
    store.set_endpoints(_specs(2, 3, 4))
    _scrape(store)
    assert placed.forgets == []
    # No running loop here (no timer): the next pool change past the grace sweeps.
    clock.now = FORGET_AFTER_S
    store.set_endpoints(_specs(2, 3, 4, 5))
    keep = {f"10.0.0.{i}:8000" for i in (2, 3, 4, 5)}
    assert placed.forgets == [keep]
    assert placed.remembered() == {placed.kept}
    store.set_endpoints(_specs(2, 3, 4))
    _scrape(store)
    assert placed.forgets == [keep]


def test_the_in_flight_tracker_forgets_an_absent_endpoint_with_the_scheduler() -> None:
    # What the tracker keeps per ip:port (its kept answer, the owner) goes when the scheduler
    # forgets the endpoint, or pod-IP churn grows it without bound.
    clock = _Clock()
    store = _store(1, 2, 3)
    director = build_director(GatewayConfig(), store, rng=random.Random(1), clock=clock)
    tracker = director.inflight
    assert isinstance(tracker, InflightTracker)
    _scrape(store)
    (pool,) = store.snapshot().pool_keys()
    tracker.apply(store.snapshot().states(pool))
    assert set(tracker._owners) == {f"10.0.0.{i}:8000" for i in (1, 2, 3)}
    store.set_endpoints(_specs(2, 3))
    clock.now = FORGET_AFTER_S
    store.set_endpoints(_specs(2, 3, 4))  # past the grace: this change sweeps
    assert set(tracker._owners) == {"10.0.0.2:8000", "10.0.0.3:8000"}


async def test_the_loop_forgets_an_absent_endpoint_when_its_grace_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    placed = _placed(monkeypatch, time.monotonic, forget_after_s=0.002)
    placed.store.set_endpoints(_specs(2, 3))
    assert placed.forgets == []  # the loop has not run yet: the grace cannot have ended
    # The timer is due before this sleep ends (an earlier deadline on the same loop clock).
    await asyncio.sleep(0.01)
    assert placed.forgets == [{"10.0.0.2:8000", "10.0.0.3:8000"}]
    assert placed.remembered() == {placed.kept}


def test_another_endpoint_at_the_same_ip_port_is_forgotten_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    placed = _placed(monkeypatch, clock)
    store = placed.store
    # One write: sim-1 is gone and another pod has its IP (a re-list, or a renamed endpoint).
    store.set_endpoints([EndpointSpec("new-1", "10.0.0.1", labels={"app": "sim"}), *_specs(2, 3)])
    assert placed.forgets == [{"10.0.0.2:8000", "10.0.0.3:8000"}]
    assert placed.remembered() == {placed.kept}
    # It leaves, and another pod takes its IP within the grace: forgotten at the change too.
    _scrape(store)
    (pool,) = store.snapshot().pool_keys()
    again = placed.scheduler.schedule(
        request(prompt=PROMPT, request_id="c"), store.snapshot().states(pool)[:1], now=NOW
    )
    assert again.primary.key == placed.left
    assert placed.remembered() == {placed.left, placed.kept}
    store.set_endpoints(_specs(2, 3))
    store.set_endpoints(_specs(1, 2, 3))
    assert placed.forgets[1:] == [{"10.0.0.2:8000", "10.0.0.3:8000"}]
    assert placed.remembered() == {placed.kept}


async def test_a_replaced_endpoints_kv_event_subscription_is_made_again() -> None:
    doc = preset_document("default")
    for p in doc["plugins"]:
        if p["type"] == "prefix-cache-scorer":
            p["parameters"].update(kvEvents=True)
    config = GatewayConfig.model_validate({"spec": {"scheduling": doc}})
    store = _store()
    store.set_endpoints([EndpointSpec("sim-1", "127.0.0.1", port=1, labels={"app": "sim"})])
    scheduler = build_director(config, store, rng=random.Random(1)).scheduler
    assert isinstance(scheduler, Scheduler)
    (prefix,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    subscriber = prefix._subscriber
    assert subscriber is not None
    try:
        _scrape(store)  # on the loop: the follower subscribes (connects and retries, no peer)
        first = subscriber._tasks["127.0.0.1:1"]
        store.set_endpoints([EndpointSpec("sim-2", "127.0.0.1", port=1, labels={"app": "sim"})])
        # The old pod's subscription went with its state; the new pod's is made on the change.
        assert first.cancelling()
        assert subscriber._tasks["127.0.0.1:1"] is not first
    finally:
        await subscriber.close()


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="grace_s must be >= 0, got -1"):
        AbsentEndpoints([], grace_s=-1)


@pytest.mark.integration
async def test_a_pool_change_while_the_replica_syncer_starts_still_reaches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runtime reads the pool, awaits the syncer's start (its socket bound, its peers
    # looked up), then subscribes to pool changes: a change in between reaches the syncer only
    # through the runtime's read after subscribing. Inject one there: an endpoint joins.
    key = tmp_path / "sync.key"
    key.write_text("0123456789abcdef0123456789abcdef\n")
    sync_port, sim = free_ports(2)
    spec = (
        f"  replicaSync: {{enabled: true, address: 127.0.0.1, port: {sync_port}, "
        f"keyFile: {key}, peers: ['127.0.0.1:{sync_port}']}}\n"
    )
    runtime = GatewayRuntime(
        ServeOptions(
            source=file_source([one_pool(tmp_path / "cfg", sim, spec=spec)]),
            run_envoy=False,
            ready_wait_s=0,
        )
    )
    joined = EndpointSpec("late-0", "127.0.0.2", port=8000, labels={"app": "sim"})

    async def bound_then_changed(*args: Any, **kwargs: Any) -> RunningSync:
        running = await start_replica_sync(*args, **kwargs)
        assert running.fold.pool == frozenset({f"127.0.0.1:{sim}"})  # read before the change
        runtime.datastore.set_endpoints([joined], source="late")
        return running

    monkeypatch.setattr(sync_service, "start_replica_sync", bound_then_changed)
    await runtime.start()
    try:
        assert runtime._sync is not None
        assert runtime._sync.running is not None
        # Peers' sends to the endpoint that joined are accepted: the syncer has its pool.
        assert runtime._sync.running.fold.pool == frozenset({f"127.0.0.1:{sim}", "127.0.0.2:8000"})
    finally:
        await runtime.stop(grace_s=0)


@pytest.mark.integration
async def test_the_runtimes_stop_cancels_a_pending_forgetting_sweep(tmp_path: Path) -> None:
    # An endpoint leaves: the forgetter arms a sweep for when its grace ends (120 s). A runtime
    # stopped meanwhile must not leave that timer on the loop (it would run on a loop being
    # torn down, into a scheduler no longer serving).
    sim = free_ports(1)[0]
    runtime = GatewayRuntime(
        ServeOptions(
            source=file_source([one_pool(tmp_path / "cfg", sim)]), run_envoy=False, ready_wait_s=0
        )
    )
    loop = asyncio.get_running_loop()
    sweeps: list[asyncio.TimerHandle] = []
    call_later = loop.call_later

    def recording(delay: float, callback: Callable[..., object], *args: Any) -> Any:
        handle = call_later(delay, callback, *args)
        if "sweep" in getattr(callback, "__name__", ""):
            sweeps.append(handle)
        return handle

    await runtime.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loop, "call_later", recording)
            late = EndpointSpec("late-0", "127.0.0.2", port=8000, labels={"app": "sim"})
            runtime.datastore.set_endpoints([late], source="late")
            runtime.datastore.set_endpoints([], source="late")
    finally:
        await runtime.stop(grace_s=0)
    assert len(sweeps) == 1  # the absence's sweep was armed
    assert sweeps[0].cancelled()


@pytest.mark.integration
async def test_the_runtimes_stop_closes_the_kv_event_subscriptions(tmp_path: Path) -> None:
    # With kvEvents the prefix scorer subscribes to each endpoint's ZMQ publisher as soon as
    # the pool is known. A stopped runtime must not leave those tasks, sockets and the ZMQ
    # context behind (an embedding process or a test's loop would carry them on).
    doc = preset_document("default")
    for p in doc["plugins"]:
        if p["type"] == "prefix-cache-scorer":
            p["parameters"].update(kvEvents=True)
    sim = free_ports(1)[0]
    files = one_pool(tmp_path / "cfg", sim, spec=f"  scheduling: {json.dumps(doc)}\n")
    runtime = GatewayRuntime(
        ServeOptions(
            source=file_source([files]),
            run_envoy=False,
            ready_wait_s=0,
        )
    )
    await runtime.start()
    try:
        assert runtime.director is not None
        scheduler = runtime.director.scheduler
        assert isinstance(scheduler, Scheduler)
        (prefix,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
        subscriber = prefix._subscriber
        assert subscriber is not None
        tasks = list(subscriber._tasks.values())
        assert len(tasks) == 1  # the pool's one endpoint, followed before any decision
    finally:
        await runtime.stop(grace_s=0)
    assert all(t.done() for t in tasks)
    assert subscriber._ctx.closed
    subscriber.follow([f"127.0.0.1:{sim}"])  # a late pool change subscribes nothing
    assert not subscriber._tasks
