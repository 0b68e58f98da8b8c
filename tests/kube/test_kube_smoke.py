"""First list and watch against the fake API server."""

from __future__ import annotations

import asyncio

from tests.kube.conftest import Factory, model_obj, pod_obj, pool_obj
from tests.kube.fakeapi import FakeApiServer
from tests.support.waiting import until


async def test_start_lists_and_watch_follows(fake: FakeApiServer, make_source: Factory) -> None:
    fake.put(pool_obj(), "inferencepools")
    fake.put(model_obj("m", "llama"), "inferencemodels")
    fake.put(pod_obj("p1", "10.0.0.1"), "pods")
    source, store = await make_source(write_status=False)
    await source.start()
    snap = store.snapshot()
    assert snap.pool_keys() == ("default/pool",)
    assert [e.hostport for e in snap.endpoints("default/pool")] == ["10.0.0.1:8000"]
    assert snap.resolve("llama") is not None
    task = asyncio.create_task(source.run())
    try:
        await until(lambda: fake.watch_count >= 4, "watches")
        fake.put(pod_obj("p2", "10.0.0.2"), "pods")
        await until(lambda: len(store.snapshot().endpoints("default/pool")) == 2, "p2")
        assert source.healthy()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
