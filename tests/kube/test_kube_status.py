"""Status writes and leader election against the fake API server.

Leader election runs on an injected monotonic clock (`Clock`), so a handover that takes 15 s of
lease time is stepped through without waiting.
"""

from __future__ import annotations

import asyncio

import pytest

from poolkeeper.api.model import InferenceModelStatus
from poolkeeper.controller.kubernetes.client import KubeApi, load_config
from poolkeeper.controller.kubernetes.leader import LeaderElector, LeaseTiming, decide
from poolkeeper.controller.kubernetes.objects import parse_model
from poolkeeper.controller.kubernetes.status import needs_write
from tests.kube.conftest import API_TIMEOUT_S, NS, Factory, model_obj, pod_obj, pool_obj
from tests.kube.fakeapi import FakeApiServer
from tests.support.waiting import until

X = "inference.networking.x-k8s.io/v1alpha2"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status_writes(fake: FakeApiServer, manager: str | None = None) -> int:
    return sum(
        1
        for w in fake.writes
        if w.subresource == "status" and (manager is None or w.field_manager == manager)
    )


def accepted(fake: FakeApiServer, name: str) -> tuple[str, str, int] | None:
    obj = fake.get(X, "inferencemodels", NS, name)
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c["type"] == "Accepted":
            return c["status"], c["reason"], c["observedGeneration"]
    return None


def seed(fake: FakeApiServer) -> None:
    fake.put(pool_obj(), "inferencepools")
    fake.put(pod_obj("p0", "10.0.0.1"), "pods")
    fake.put(model_obj("a", "llama"), "inferencemodels")
    fake.put(model_obj("b", "llama"), "inferencemodels")  # younger: ModelNameInUse


async def elector_for(fake: FakeApiServer, identity: str, clock: Clock) -> LeaderElector:
    api = KubeApi(load_config(server=fake.url), NS, timeout_s=API_TIMEOUT_S)
    return LeaderElector(api, "epp-lease", identity, clock=clock)


def test_decide_follows_client_go() -> None:
    t = LeaseTiming()
    held = {"holderIdentity": "a", "leaseDurationSeconds": 15}
    assert decide(None, "b", 0.0, 0.0, t) == "create"
    assert decide(held, "a", 100.0, 0.0, t) == "renew"
    assert decide(held, "b", 14.9, 0.0, t) == "wait"
    assert decide(held, "b", 15.0, 0.0, t) == "take"
    assert decide({"leaseDurationSeconds": 1}, "b", 0.0, 0.0, t) == "take"  # released
    with pytest.raises(ValueError, match="retry period < renew deadline"):
        LeaseTiming(lease_duration_s=10, renew_deadline_s=10, retry_period_s=2)


def test_needs_write_ignores_timestamps() -> None:
    m, _ = parse_model(
        model_obj("a", "llama")
        | {
            "status": {
                "conditions": [
                    {
                        "type": "Accepted",
                        "status": "True",
                        "reason": "Accepted",
                        "message": "x",
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                        "observedGeneration": 1,
                    }
                ]
            }
        }
    )
    assert m is not None
    same = m.status.model_copy(deep=True)
    same.conditions[0].last_transition_time = same.conditions[0].last_transition_time.replace(
        year=2027
    )
    assert not needs_write(m.status, same)
    other = InferenceModelStatus.model_validate(
        {"conditions": [dict(m.status.conditions[0].to_dict(), observedGeneration=2)]}
    )
    assert needs_write(m.status, other)


async def test_status_written_once_then_nothing_over_100_resyncs(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    source, _ = await make_source()
    await source.start()
    task = asyncio.create_task(source.run())
    try:
        await until(lambda: accepted(fake, "b") is not None, "both statuses")
        assert accepted(fake, "a") == ("True", "Accepted", 1)
        assert accepted(fake, "b") == ("False", "ModelNameInUse", 1)
        rv = fake.get(X, "inferencemodels", NS, "b")["metadata"]["resourceVersion"]
        models = source.state.models_cache
        await until(
            lambda: models.objects["default/b"]["metadata"]["resourceVersion"] == rv,
            "our write to come back as an event",
        )
        before = status_writes(fake)
        assert before == 2
        # The periodic resync (its sleep injected, so it fires on every loop turn) reconciles
        # every model from the cache: 100 of them write nothing.
        resyncs = source.resyncs
        await until(lambda: source.resyncs >= resyncs + 100, "100 resyncs")
        for _ in range(100):  # and 100 direct reconciles, awaited one by one
            assert await source.reconcile_statuses() == 0
        assert status_writes(fake) == before  # 0 writes over the no-op resyncs
        # A real change is written once: the pool disappears, both models lose it.
        fake.delete(X, "inferencepools", NS, "pool")
        await until(lambda: accepted(fake, "a") == ("False", "PoolNotFound", 1), "PoolNotFound")
        await until(lambda: accepted(fake, "b") == ("False", "PoolNotFound", 1), "b too")
        assert status_writes(fake) == before + 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_conflict_rereads_and_writes_the_new_generation(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    source, _ = await make_source()
    await source.start()
    assert await source.elector.try_once()
    stale = dict(source._models_by_key)
    # Someone edits model a after we read it: generation 2, new resourceVersion.
    edited = model_obj("a", "llama")
    edited["spec"]["criticality"] = "Critical"
    fake.put(edited, "inferencemodels")
    verdicts = source._datastore.snapshot().model_index.verdicts
    writer = source.status_writer
    assert await writer.reconcile(source.state.models_cache.kind, stale, verdicts) == 2
    assert writer.conflicts == 1  # a's patch carried the old resourceVersion
    assert accepted(fake, "a") == ("True", "Accepted", 2)  # re-read: observes generation 2


async def test_injected_409s_are_bounded_then_left_to_the_next_event(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    source, _ = await make_source()
    await source.start()
    assert await source.elector.try_once()
    fake.conflicts = 2
    assert await source.reconcile_statuses() == 2  # a: 409, 409, written; b: written
    assert source.status_writer.conflicts == 2
    fake.put(pool_obj(port=9000), "inferencepools")  # nothing about models changes
    source._apply(resources=True)
    fake.conflicts = 10
    fake.delete(X, "inferencepools", NS, "pool")
    source.state.pool_caches[0].objects.clear()
    source._apply(resources=True)
    patches = sum(1 for r in fake.requests if r.startswith("PATCH"))
    assert await source.reconcile_statuses() == 0
    # Three attempts per model, then it gives up: no retry loop of its own.
    assert sum(1 for r in fake.requests if r.startswith("PATCH")) == patches + 6
    assert source.status_writer.failures == 2


async def test_two_replicas_never_both_write_across_a_handover(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    clock = Clock()
    a = await elector_for(fake, "epp-a", clock)
    b = await elector_for(fake, "epp-b", clock)
    # Field managers told apart here only to count who wrote (the default is one stable name).
    src_a, _ = await make_source("epp-a", elector=None, field_manager="epp-a")
    src_b, _ = await make_source("epp-b", elector=None, field_manager="epp-b")
    for src, elector in ((src_a, a), (src_b, b)):
        src.elector = elector
        src.status_writer.allowed = elector.is_leader
        await src.start()
    timeline: list[tuple[float, str]] = []

    async def step(advance: float) -> None:
        clock.now += advance
        await a.try_once() if not crashed else None
        await b.try_once()
        assert not (a.is_leader() and b.is_leader()), f"both lead at {clock.now}"
        for name, src in (("a", src_a), ("b", src_b)):
            for _ in range(await src.reconcile_statuses()):
                timeline.append((clock.now, name))

    # Contention at start: both try at once; the API server lets exactly one create the Lease.
    results = await asyncio.gather(a.try_once(), b.try_once())
    assert sorted(results) == [False, True]
    leader = a if a.is_leader() else b
    if leader is b:  # make `a` the first leader for the rest of the script
        await b.release()
        assert await a.try_once()
    crashed = False
    await step(0)
    await step(2)
    assert {n for _, n in timeline} == {"a"}
    crashed = True  # a stops renewing (killed without releasing)
    leaders = []
    for _ in range(16):  # a's renew deadline (10 s) passes, then b's view of the lease (15 s)
        await step(1.0)
        leaders.append("a" if a.is_leader() else "b" if b.is_leader() else "-")
    # a stops at 10 s after its last renewal, b starts at 15 s: a 5 s gap with no writer.
    assert leaders == ["a"] * 9 + ["-"] * 5 + ["b"] * 2
    # A status change now is b's to write.
    fake.delete(X, "inferencepools", NS, "pool")
    for src in (src_a, src_b):
        src.state.pool_caches[0].objects.clear()
        src._apply(resources=True)
    await step(1.0)
    writers = [n for _, n in timeline]
    assert writers.count("b") == 2  # the pending PoolNotFound statuses, written by b only
    first_b = min(t for t, n in timeline if n == "b")
    assert all(t < first_b for t, n in timeline if n == "a")
    lease = fake.get("coordination.k8s.io/v1", "leases", NS, "epp-lease")
    assert lease["spec"]["holderIdentity"] == "epp-b"
    assert lease["spec"]["leaseTransitions"] == 1
    assert status_writes(fake, "epp-a") == 2
    assert status_writes(fake, "epp-b") == 2
    for e in (a, b):
        await e.api.close()


async def test_release_hands_over_within_one_retry(fake: FakeApiServer) -> None:
    clock = Clock()
    a = await elector_for(fake, "epp-a", clock)
    b = await elector_for(fake, "epp-b", clock)
    assert await a.try_once()
    assert not await b.try_once()
    await a.release()
    assert not a.is_leader()
    assert await b.try_once()  # no lease duration to wait out
    for e in (a, b):
        await e.api.close()


async def test_leader_steps_down_when_it_cannot_renew(fake: FakeApiServer) -> None:
    clock = Clock()
    a = await elector_for(fake, "epp-a", clock)
    assert await a.try_once()
    await fake.stop()
    clock.now += 9.9
    assert await a.try_once()  # renew failed, but still inside the renew deadline
    clock.now += 0.2
    assert not await a.try_once()  # deadline passed: stop writing before anyone may take over
    await fake.start()
    await a.api.close()
