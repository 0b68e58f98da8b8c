"""The Kubernetes source under faults, against the fake API server (real HTTP on 127.0.0.1).

Each test drives the source's real watch loops; the backoff sleep is injected (`VirtualSleep`
counts the seconds asked for), so "the API server is down for 30 s" means the source backed
off for 30 s of its own time, without the test waiting for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from poolkeeper.controller.kubernetes.client import KubeApi, load_config
from poolkeeper.controller.kubernetes.source import KubernetesResourceSource
from poolkeeper.datastore.endpoint import EndpointMetrics
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import ConfigError
from tests.kube.conftest import NS, Factory, VirtualSleep, model_obj, pod_obj, pool_obj
from tests.kube.fakeapi import FakeApiServer
from tests.support.waiting import until

POOL = "default/pool"


def hostports(store: Datastore) -> list[str]:
    return sorted(e.hostport for e in store.snapshot().endpoints(POOL))


def api_endpoints(fake: FakeApiServer) -> list[str]:
    """What the datastore should hold: Ready pods with an IP, port 8000."""
    pods = fake.objects.get(("", "pods"), {}).values()
    return sorted(
        f"{p['status']['podIP']}:8000"
        for p in pods
        if p["status"].get("podIP")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
    )


@asynccontextmanager
async def running(source: KubernetesResourceSource, fake: FakeApiServer) -> AsyncIterator[None]:
    await source.start()
    watches = fake.watch_count
    task = asyncio.create_task(source.run())
    try:
        await until(lambda: fake.watch_count >= watches + 4, "the four watches to open")
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def seed(fake: FakeApiServer, pods: int = 3) -> None:
    fake.put(pool_obj(), "inferencepools")
    fake.put(model_obj("m", "llama"), "inferencemodels")
    for i in range(pods):
        fake.put(pod_obj(f"p{i}", f"10.0.0.{i + 1}"), "pods")


def changes_of(store: Datastore) -> list[int]:
    seen: list[int] = []
    store.subscribe(lambda snap, kind: seen.append(snap.version))
    return seen


async def test_not_ready_pod_leaves_on_its_one_watch_event(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    source, store = await make_source(write_status=False)
    async with running(source, fake):
        writes = changes_of(store)
        fake.put(pod_obj("p1", "10.0.0.2", ready=False), "pods")
        await until(lambda: "10.0.0.2:8000" not in hostports(store), "p1 to leave")
        assert hostports(store) == ["10.0.0.1:8000", "10.0.0.3:8000"]
        assert len(writes) == 1  # one event, one datastore write: no re-list, no delay
        assert source.relists == 0
        # Back to Ready: back in on the next event.
        fake.put(pod_obj("p1", "10.0.0.2"), "pods")
        await until(lambda: "10.0.0.2:8000" in hostports(store), "p1 to return")


async def test_flapping_ready_ends_in_the_api_state(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    source, store = await make_source(write_status=False)
    async with running(source, fake):
        for flip in range(22):  # ends Ready
            fake.put(pod_obj("p0", "10.0.0.1", ready=flip % 2 == 1), "pods")
        await until(lambda: fake.rv == int(source.state.pods_cache.version or 0), "the last event")
        assert hostports(store) == api_endpoints(fake) == ["10.0.0.1:8000", "10.0.0.2:8000",
                                                           "10.0.0.3:8000"]  # fmt: skip
        # Deleting and pending pods (no IP) are no endpoints either.
        terminating = pod_obj("p2", "10.0.0.3")
        terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        fake.put(terminating, "pods")
        fake.put(pod_obj("p9", None), "pods")
        await until(lambda: hostports(store) == ["10.0.0.1:8000", "10.0.0.2:8000"], "p2 out")


async def test_410_gone_relists_and_prunes_a_lost_delete(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    source, store = await make_source(write_status=False)
    async with running(source, fake):
        fake.lose_next_delete()
        fake.delete("v1", "pods", NS, "p0")  # the DELETED event never reaches the watch
        fake.put(pod_obj("p5", "10.0.0.6"), "pods")
        await until(lambda: "10.0.0.6:8000" in hostports(store), "p5")
        assert "10.0.0.1:8000" in hostports(store)  # still there: the event was lost
        fake.put(pool_obj("other", app="other"), "inferencepools")  # history moves on
        await until(lambda: len(store.snapshot().pool_keys()) == 2, "the other pool")
        fake.compact()
        fake.end_watches()  # resuming pods from their older version now gets 410 Gone
        await until(lambda: "10.0.0.1:8000" not in hostports(store), "the re-list to prune p0")
        assert hostports(store) == api_endpoints(fake)
        assert source.relists >= 1
        await until(source.in_step, "the source to be healthy again")


async def test_dropped_stream_relists_and_prunes(fake: FakeApiServer, make_source: Factory) -> None:
    seed(fake)
    source, store = await make_source(write_status=False)
    async with running(source, fake):
        fake.lose_next_delete()
        fake.delete("v1", "pods", NS, "p1")
        fake.drop_watches()  # cut mid-chunk: the client sees an incomplete stream
        await until(lambda: "10.0.0.2:8000" not in hostports(store), "p1 pruned")
        assert hostports(store) == api_endpoints(fake)
        await until(source.in_step, "healthy again")


async def test_bookmarks_move_the_resume_version(fake: FakeApiServer, make_source: Factory) -> None:
    seed(fake)
    source, _ = await make_source(write_status=False)
    async with running(source, fake):
        fake.put(pool_obj("other", app="other"), "inferencepools")  # no pod event, newer version
        fake.bookmark()
        await until(
            lambda: source.state.pods_cache.version == str(fake.rv), "the bookmark's version"
        )
        assert any("allowWatchBookmarks=true" in r for r in fake.requests)
        # History before the bookmark is compacted: resuming from the bookmark needs no re-list.
        fake.compact(upto=fake.rv)
        watches = fake.watch_count
        fake.end_watches()
        await until(lambda: fake.watch_count >= watches + 4, "the watches to resume")
        assert source.relists == 0


async def test_api_outage_of_30s_converges(fake: FakeApiServer, make_source: Factory) -> None:
    seed(fake, pods=4)
    sleep = VirtualSleep()
    source, store = await make_source(
        write_status=False, backoff_initial_s=0.5, backoff_max_s=8.0, sleep=sleep
    )
    async with running(source, fake):
        assert source.healthy()
        assert source.in_step()
        await fake.stop()
        # Changes while the API server is unreachable: deleted, added, turned NotReady, reused IP.
        fake.delete("v1", "pods", NS, "p0")
        fake.put(pod_obj("p1", "10.0.0.2", ready=False), "pods")
        fake.put(pod_obj("p7", "10.0.0.8"), "pods")
        fake.delete("v1", "pods", NS, "p3")
        fake.put(pod_obj("p8", "10.0.0.4"), "pods")  # p3's IP, now another pod's
        fake.put(model_obj("m2", "mistral"), "inferencemodels")
        fake.compact()
        await until(lambda: not source.in_step(), "the watches to drop")
        assert source.healthy()  # readiness stays: the last known state is served
        await until(lambda: sleep.slept >= 30.0, "30 s of backoff", within_s=100)
        await fake.start()
        await until(lambda: hostports(store) == api_endpoints(fake), "convergence")
        await until(source.in_step, "in step after the outage")
        endpoint = store.snapshot().endpoint("10.0.0.4:8000")
        assert endpoint is not None
        assert endpoint.name == "p8"
        assert store.snapshot().resolve("mistral") is not None


async def test_pod_ip_reuse_carries_no_metrics_or_inflight(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake, pods=1)
    source, store = await make_source(write_status=False)
    tracker = InflightTracker()
    async with running(source, fake):
        store.update_metrics("10.0.0.1:8000", EndpointMetrics(waiting=7, updated_at=1.0))
        tracker.apply(store.snapshot().states(POOL))
        tracker.start("r1", "10.0.0.1:8000", 100, now=2.0)
        before = tracker.apply(store.snapshot().states(POOL))
        assert before[0].inflight_requests == 1
        assert before[0].metrics.waiting == 7
        fake.delete("v1", "pods", NS, "p0")
        fake.put(pod_obj("p-new", "10.0.0.1"), "pods")
        await until(lambda: [e.name for e in store.snapshot().endpoints(POOL)] == ["p-new"],
                    "the new pod")  # fmt: skip
        after = tracker.apply(store.snapshot().states(POOL))
        assert after[0].endpoint.name == "p-new"
        assert after[0].metrics.waiting == 0
        assert after[0].metrics.updated_at == 0.0
        assert after[0].inflight_requests == 0
        assert after[0].inflight_tokens == 0
        assert tracker.finish("r1") is False  # the old pod's request no longer counts


async def test_readiness_needs_the_first_sync(fake: FakeApiServer, make_source: Factory) -> None:
    seed(fake)
    source, _ = await make_source(write_status=False)
    assert not source.healthy()
    await source.start()
    assert source.healthy()


async def test_unreachable_api_server_at_start_is_a_config_error(make_source: Factory) -> None:
    source, _ = await make_source(write_status=False, start_timeout_s=0.0)
    await source.api.close()
    source.api = KubeApi(load_config(server="http://127.0.0.1:9"), NS, timeout_s=1.0)
    with pytest.raises(ConfigError, match="cannot list resources in namespace default"):
        await source.start()
    await source.api.close()


async def test_served_model_version_is_negotiated(
    fake: FakeApiServer, make_source: Factory
) -> None:
    fake.unserved.add(("inference.networking.x-k8s.io", "v1alpha2", "inferencemodels"))
    fake.unserved.add(("inference.networking.k8s.io", "v1", "inferencepools"))
    seed(fake)
    old = model_obj("old", "phi")
    old["apiVersion"] = "inference.networking.x-k8s.io/v1alpha1"
    fake.put(old, "inferencemodels")
    source, store = await make_source(write_status=False)
    await source.start()
    assert source.state.models_cache.kind.version == "v1alpha1"
    assert store.snapshot().resolve("phi") is not None
    assert store.snapshot().resolve("llama") is not None


async def test_invalid_objects_are_left_out(
    fake: FakeApiServer, make_source: Factory, caplog: Any
) -> None:
    seed(fake)
    bad = model_obj("bad", "x")
    bad["spec"]["criticality"] = "Whenever"
    fake.put(bad, "inferencemodels")
    source, store = await make_source(write_status=False)
    await source.start()
    assert store.snapshot().resolve("x") is None
    assert "InferenceModel/default/bad: spec.criticality" in caplog.text


async def test_named_pools_only(fake: FakeApiServer, make_source: Factory) -> None:
    seed(fake)
    fake.put(pool_obj("other", app="other"), "inferencepools")
    fake.put(model_obj("mo", "other-model", pool="other"), "inferencemodels")
    source, store = await make_source(write_status=False, pool_names=("pool",))
    await source.start()
    assert store.snapshot().pool_keys() == (POOL,)
    assert set(source.statuses()) == {"default/m"}  # the other pool's models are not ours


async def test_seed_era_pools_and_objectives_are_read(
    fake: FakeApiServer, make_source: Factory
) -> None:
    fake.unserved.add(("inference.networking.x-k8s.io", "v1alpha2", "inferencepools"))
    fake.unserved.add(("llm-d.ai", "v1alpha2", "inferenceobjectives"))  # a GIE v1.x cluster
    old_pool = pool_obj()
    old_pool["apiVersion"] = "inference.networking.x-k8s.io/v1alpha1"
    old_pool["spec"]["extensionRef"] = {"name": "epp"}
    fake.put(old_pool, "inferencepools")
    fake.put(pod_obj("p0", "10.0.0.1"), "pods")
    objective = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": "urgent", "namespace": NS},
        "spec": {"priority": 5, "poolRef": {"name": "pool"}},
    }
    fake.put(objective, "inferenceobjectives")
    source, store = await make_source(write_status=False)
    await source.start()
    assert source.state.pool_caches[0].kind.version == "v1alpha1"
    assert hostports(store) == ["10.0.0.1:8000"]
    assert source.state.policies()[0].name == "urgent"


async def test_streams_closed_at_once_are_retried_with_backoff(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    sleep = VirtualSleep()
    source, _ = await make_source(
        write_status=False, sleep=sleep, backoff_initial_s=0.5, backoff_max_s=8.0
    )
    fake.empty_watches = True
    await source.start()
    task = asyncio.create_task(source.run())
    try:
        await until(lambda: fake.watch_count >= 6 * 8, "eight empty watches per kind")
        # Each empty stream waited its backoff (0.25 s doubling to 8 s), not a hot loop.
        assert sleep.slept >= 6 * (0.25 + 0.5 + 1 + 2 + 4)
        assert source.in_step()  # the server answers: the watch is not degraded
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
