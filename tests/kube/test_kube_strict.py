"""The controller against the stricter API-server double: 410 mid-change, 409 on a stale
status write, 429 with Retry-After, 403 named, slow lists, and a 60 s outage on 3 replicas.

Time: backoffs and staleness run on `ManualClock` (virtual seconds, advanced by the test), so
"60 s down, converged within 5 s" is exact in virtual time and takes well under a second of
real time; the real HTTP against the double is awaited, never timed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from poolkeeper.api.status import Verdict
from poolkeeper.controller.kubernetes.client import KubeApi, load_config
from poolkeeper.controller.kubernetes.objects import parse_model
from poolkeeper.controller.kubernetes.source import KubernetesResourceSource
from poolkeeper.controller.kubernetes.source_state import KubeSettings
from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import ConfigError
from tests.kube.conftest import (
    API_TIMEOUT_S,
    NS,
    Factory,
    ManualClock,
    X,
    model_obj,
    pod_obj,
)
from tests.kube.fakeapi import FakeApiServer
from tests.kube.test_kube_faults import api_endpoints, hostports, running, seed
from tests.support.waiting import until

ACCEPTED = Verdict("True", "Accepted", "serving", "default/pool")


class Recorder:
    """An injected sleep that records every delay asked for."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await asyncio.sleep(0.005)


# --- the double itself speaks the protocol --------------------------------------------------


async def _get(fake: FakeApiServer, path: str) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as session, session.get(fake.url + path) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def test_double_selectors_versions_and_refusals(fake: FakeApiServer) -> None:
    fake.put(pod_obj("a", "10.0.0.1", app="vllm"), "pods")
    fake.put(pod_obj("b", "10.0.0.2", app="sglang"), "pods")
    pods = f"/api/v1/namespaces/{NS}/pods"
    names = lambda body: [i["metadata"]["name"] for i in body["items"]]  # noqa: E731
    assert names((await _get(fake, pods + "?labelSelector=app%3Dvllm"))[2]) == ["a"]
    assert names((await _get(fake, pods + "?labelSelector=app+notin+(vllm)"))[2]) == ["b"]
    assert names((await _get(fake, pods + "?labelSelector=!app"))[2]) == []
    assert names((await _get(fake, pods + "?fieldSelector=metadata.name%3Db"))[2]) == ["b"]
    code, _, body = await _get(fake, pods + "?fieldSelector=spec.containers%3Dx")
    assert (code, body["message"]) == (400, "field label not supported: spec.containers")
    code, _, body = await _get(fake, pods)
    rv = int(body["metadata"]["resourceVersion"])
    assert rv == fake.rv
    code, _, body = await _get(fake, f"{pods}?resourceVersion={rv + 5}")
    assert (code, body["reason"]) == (504, "Timeout")
    fake.compact()
    code, _, body = await _get(fake, f"{pods}?resourceVersion=101&resourceVersionMatch=Exact")
    assert (code, body["reason"]) == (410, "Expired")
    fake.throttle(1, retry_after_s=3)
    code, headers, body = await _get(fake, pods)
    assert (code, headers["Retry-After"], body["details"]["retryAfterSeconds"]) == (429, "3", 3)
    fake.forbid("list", "pods")
    code, _, body = await _get(fake, pods)
    assert code == 403
    assert (
        'cannot list resource "pods" in API group "" in the namespace "default"'
        in (body["message"])
    )


async def test_double_watch_selector_turns_leaving_into_deleted(fake: FakeApiServer) -> None:
    fake.put(pod_obj("a", "10.0.0.1"), "pods")
    since = fake.rv
    fake.put(pod_obj("a", "10.0.0.1", app="other"), "pods")  # leaves app=vllm
    fake.put(pod_obj("a", "10.0.0.1"), "pods")  # and comes back
    path = f"/api/v1/namespaces/{NS}/pods?watch=true&resourceVersion={since}"
    async with aiohttp.ClientSession() as session:
        async with session.get(fake.url + path + "&labelSelector=app%3Dvllm") as resp:
            first = [await resp.content.readline() for _ in range(2)]
        fake.end_watches()
    assert [line.split(b'"')[3] for line in first] == [b"DELETED", b"ADDED"]


# --- the controller against it ---------------------------------------------------------------


async def test_410_relists_and_loses_no_event(fake: FakeApiServer, make_source: Factory) -> None:
    seed(fake, pods=3)
    source, store = await make_source(write_status=False)
    async with running(source, fake):
        await fake.stop()  # the watches drop; while down, every kind of change happens
        fake.delete("v1", "pods", NS, "p0")  # a delete
        fake.put(pod_obj("p1", "10.0.0.2", ready=False), "pods")  # a change
        fake.put(pod_obj("p5", "10.0.0.6"), "pods")  # an add
        fake.put(model_obj("m2", "mistral"), "inferencemodels")
        fake.compact()  # ... and the history is gone: resuming gets 410
        await fake.start()
        await until(lambda: source.in_step() and source.relists >= 4, "re-lists after the 410")
        await until(lambda: hostports(store) == api_endpoints(fake), "the API state")
        assert hostports(store) == ["10.0.0.3:8000", "10.0.0.6:8000"]
        assert store.snapshot().resolve("mistral") is not None
        assert any("resourceVersion" in r and "watch=true" in r for r in fake.requests)


async def test_stale_status_write_gets_409_and_retries_on_the_fresh_object(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    source, _ = await make_source()
    await source.start()
    stale, _ = parse_model(fake.get(f"{X}/v1alpha2", "inferencemodels", NS, "m"))
    assert stale is not None
    # Someone edits the model after our read: a new generation and resourceVersion.
    edited = model_obj("m", "llama")
    edited["spec"]["criticality"] = "Critical"
    fake.put(edited, "inferencemodels")
    writer = source.status_writer
    writer.allowed = lambda: True  # as the leader
    kind = source.state.models_cache.kind
    written = await writer.reconcile(kind, {stale.key: stale}, {stale.key: ACCEPTED})
    assert (written, writer.conflicts, writer.writes) == (1, 1, 1)
    obj = fake.get(f"{X}/v1alpha2", "inferencemodels", NS, "m")
    (condition,) = obj["status"]["conditions"]
    assert condition["observedGeneration"] == 2  # the fresh object's generation
    assert [w.field_manager for w in fake.writes if w.subresource == "status"] == ["poolkeeper-epp"]


async def test_429_backs_off_by_retry_after(fake: FakeApiServer, make_source: Factory) -> None:
    seed(fake)
    sleep = Recorder()
    source, store = await make_source(write_status=False, sleep=sleep)
    fake.throttle(1, retry_after_s=7, verbs=frozenset({"list"}))
    await source.start()  # the first list is turned away, the second one after 7 s answers
    assert 7.0 <= sleep.delays[0] <= 7.7
    assert hostports(store) == api_endpoints(fake)
    async with running(source, fake):
        sleep.delays.clear()
        fake.throttle(2, retry_after_s=11, verbs=frozenset({"list"}))
        fake.drop_watches()
        fake.put(pod_obj("p9", "10.0.0.9"), "pods")
        await until(lambda: "10.0.0.9:8000" in hostports(store), "the re-list after the 429s")
        throttled = [d for d in sleep.delays if d >= 1.0]  # the backoff's own are <= 0.05
        assert len(throttled) == 2
        assert all(11.0 <= d <= 12.1 for d in throttled)


async def test_slow_list_loses_nothing_that_changed_during_it(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    source, store = await make_source(write_status=False)
    fake.list_delay_s = 0.3
    async with running(source, fake):
        fake.compact()
        fake.drop_watches()
        await asyncio.sleep(0.1)  # the re-lists are under way, slowly
        fake.put(pod_obj("p7", "10.0.0.7"), "pods")
        await until(lambda: "10.0.0.7:8000" in hostports(store), "the pod added mid-list")
        assert hostports(store) == api_endpoints(fake)


async def test_forbidden_is_named_at_start(
    fake: FakeApiServer, make_source: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    seed(fake)
    fake.forbid("list", "inferencepools")
    source, _ = await make_source(write_status=False)
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError) as raised:
        await source.start()
    assert 'cannot list resource "inferencepools"' in raised.value.message
    assert any(
        r.levelno == logging.ERROR and 'cannot list resource "inferencepools"' in r.getMessage()
        for r in caplog.records
    )


async def test_forbidden_lease_and_status_writes_are_errors(
    fake: FakeApiServer, make_source: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    seed(fake)
    fake.forbid("create", "leases")
    source, _ = await make_source()
    await source.start()
    with caplog.at_level(logging.ERROR):
        assert not await source.elector.try_once()
        assert not await source.elector.try_once()  # every time, not once
    refused = [r for r in caplog.records if 'cannot create resource "leases"' in r.getMessage()]
    assert [r.levelno for r in refused] == [logging.ERROR, logging.ERROR]
    caplog.clear()
    fake.forbid("patch", "inferencemodels/status")
    source.status_writer.allowed = lambda: True
    model, _ = parse_model(fake.get(f"{X}/v1alpha2", "inferencemodels", NS, "m"))
    assert model is not None
    kind = source.state.models_cache.kind
    with caplog.at_level(logging.ERROR):
        await source.status_writer.reconcile(kind, {model.key: model}, {model.key: ACCEPTED})
    assert any(
        r.levelno == logging.ERROR
        and 'cannot patch resource "inferencemodels/status"' in r.getMessage()
        for r in caplog.records
    )


async def test_lease_writes_carry_the_stable_field_manager(
    fake: FakeApiServer, make_source: Factory
) -> None:
    source, _ = await make_source("epp-7d9f-abcde")
    assert await source.elector.try_once()
    assert await source.elector.try_once()
    leases = [w for w in fake.writes if w.plural == "leases"]
    assert [w.method for w in leases] == ["POST", "PUT"]
    assert {w.field_manager for w in leases} == {"poolkeeper-epp"}


def _converged(store: Datastore, fake: FakeApiServer) -> Callable[[], bool]:
    return lambda: hostports(store) == api_endpoints(fake)


# --- acceptance: 60 s of API outage on three replicas ----------------------------------------


async def test_60s_outage_every_replica_ready_and_routing_then_converged_within_5s(
    fake: FakeApiServer,
) -> None:
    seed(fake, pods=4)
    clock = ManualClock()
    replicas: list[tuple[KubernetesResourceSource, Datastore]] = []
    for i in range(3):
        store = Datastore()
        source = KubernetesResourceSource(
            KubeApi(load_config(server=fake.url), NS, timeout_s=API_TIMEOUT_S),
            store,
            KubeSettings(namespace=NS, identity=f"epp-{i}", write_status=False),
            sleep=clock.sleep,
            clock=clock,
            rng=random.Random(i),
        )
        await source.start()
        replicas.append((source, store))
    watches = fake.watch_count
    tasks = [asyncio.create_task(source.run()) for source, _ in replicas]

    def routes(store: Datastore) -> bool:
        snapshot = store.snapshot()
        return snapshot.resolve("llama") is not None and bool(snapshot.endpoints("default/pool"))

    try:
        await until(lambda: fake.watch_count >= watches + 12, "every replica's watches")
        await fake.stop()
        fake.delete("v1", "pods", NS, "p0")
        fake.put(pod_obj("p6", "10.0.0.7"), "pods")
        fake.put(model_obj("m2", "mistral"), "inferencemodels")
        fake.compact()
        for _ in range(60):  # 60 virtual seconds down: every replica Ready and routing
            await clock.advance(1.0)
            for source, store in replicas:
                assert source.healthy()
                assert routes(store)
        assert all(59.0 <= source.stale_s() <= 60.0 for source, _ in replicas)
        await fake.start()
        back = clock.now
        await clock.advance(5.0)  # no more virtual time than this: the backoff is capped at 4 s
        for source, store in replicas:
            await until(_converged(store, fake), "convergence")
            await until(source.in_step, "every watch back")
            assert store.snapshot().resolve("mistral") is not None
        assert clock.now - back == pytest.approx(5.0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_cancelling_run_releases_the_lease(fake: FakeApiServer, make_source: Factory) -> None:
    """The shutdown path, not `release()` called by hand: cancel run() while leading."""
    seed(fake)
    source, _ = await make_source("epp-0")
    await source.start()
    task = asyncio.create_task(source.run())
    await until(source.elector.is_leader, "the Lease")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    lease = fake.get("coordination.k8s.io/v1", "leases", NS, "poolkeeper-epp")
    assert "holderIdentity" not in lease["spec"]
    assert lease["spec"]["leaseDurationSeconds"] == 1
