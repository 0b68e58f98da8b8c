"""The running EPP follows pool changes: the scheduler forgets what it keeps for an endpoint
that left the pool (server/wiring.py), and the replica syncer misses no change made while it
started (server/runtime.py)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from poolkeeper.api.pool import InferencePool
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.files import file_source
from poolkeeper.datastore.endpoint import EndpointMetrics
from poolkeeper.datastore.store import Datastore, EndpointSpec
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server import runtime as runtime_module
from poolkeeper.server.replica_sync import RunningSync, start_replica_sync
from poolkeeper.server.runtime import GatewayRuntime, ServeOptions
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


def test_an_endpoint_that_leaves_the_pool_is_forgotten_by_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forgets: list[set[str]] = []
    forget = Scheduler.forget_endpoints

    def counted(self: Scheduler, keep: set[str]) -> None:
        forgets.append(set(keep))
        forget(self, keep)

    monkeypatch.setattr(Scheduler, "forget_endpoints", counted)
    store = _store(1, 2, 3)
    scheduler = build_director(GatewayConfig(), store, rng=random.Random(1)).scheduler
    assert isinstance(scheduler, Scheduler)
    prefix = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    backlog = [p for p in scheduler.plugins.values() if isinstance(p, PrefillBacklogScorer)]
    assert len(prefix) == 1
    assert len(backlog) == 1
    _scrape(store)
    (pool,) = store.snapshot().pool_keys()
    states = store.snapshot().states(pool)
    # Two prompts, each placed on its own endpoint: both are recorded in the index and the
    # backlog (their first bytes have not come).
    gone = scheduler.schedule(request(prompt=PROMPT, request_id="a"), states[:1], now=NOW)
    stays = scheduler.schedule(request(prompt="other " * 400, request_id="b"), states[1:2], now=NOW)
    left, kept = gone.primary.key, stays.primary.key
    assert sorted(prefix[0].index.endpoints()) == sorted([left, kept])
    assert set(backlog[0].backlog.snapshot()) == {left, kept}
    # Metrics writes and a pool that only grows are no reason to forget anything.
    _scrape(store)
    store.set_endpoints(_specs(1, 2, 3, 4))
    assert forgets == []
    # The endpoint leaves the pool: what the scheduler kept for it goes, once, at the change.
    store.set_endpoints(_specs(2, 3, 4))
    assert left == "10.0.0.1:8000"
    assert prefix[0].index.endpoints() == [kept]
    assert set(backlog[0].backlog.snapshot()) == {kept}
    assert forgets == [{"10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}]
    _scrape(store)
    assert len(forgets) == 1


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

    monkeypatch.setattr(runtime_module, "start_replica_sync", bound_then_changed)
    await runtime.start()
    try:
        assert runtime._sync is not None
        # Peers' sends to the endpoint that joined are accepted: the syncer has its pool.
        assert runtime._sync.fold.pool == frozenset({f"127.0.0.1:{sim}", "127.0.0.2:8000"})
    finally:
        await runtime.stop(grace_s=0)
