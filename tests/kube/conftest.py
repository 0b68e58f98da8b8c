"""Fixtures for the Kubernetes source tests: the fake API server and object builders."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from poolkeeper.controller.kubernetes.client import KubeApi, load_config
from poolkeeper.controller.kubernetes.leader import LeaseTiming
from poolkeeper.controller.kubernetes.source import KubernetesResourceSource
from poolkeeper.controller.kubernetes.source_state import KubeSettings
from poolkeeper.datastore.store import Datastore
from tests.kube.fakeapi import FakeApiServer

X = "inference.networking.x-k8s.io"
NS = "default"


def pool_obj(name: str = "pool", app: str = "vllm", port: int = 8000) -> dict[str, Any]:
    return {
        "apiVersion": f"{X}/v1alpha2",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"app": app},
            "targetPortNumber": port,
            "extensionRef": {"name": "epp"},
        },
    }


def model_obj(name: str, model_name: str, pool: str = "pool") -> dict[str, Any]:
    return {
        "apiVersion": f"{X}/v1alpha2",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"modelName": model_name, "poolRef": {"name": pool}},
    }


def pod_obj(name: str, ip: str | None, *, ready: bool = True, app: str = "vllm") -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": status,
    }


class VirtualSleep:
    """An injected sleep: counts the seconds asked for and yields to the loop briefly."""

    def __init__(self) -> None:
        self.slept = 0.0

    async def __call__(self, seconds: float) -> None:
        self.slept += seconds
        await asyncio.sleep(0.005)


FAST = LeaseTiming(lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


Factory = Callable[..., Awaitable[tuple[KubernetesResourceSource, Datastore]]]

# The API clients' timeout against the double bounds a hang only: 2 s failed a TokenReview with
# ConnectTimeout at load 16-20 on 2 cores, and no test waits for it to fire.
API_TIMEOUT_S = 30.0


@pytest.fixture
async def make_source(fake: FakeApiServer) -> AsyncIterator[Factory]:
    made: list[KubernetesResourceSource] = []

    async def make(
        identity: str = "epp-0", *, sleep: Any = None, elector: Any = None, **settings: Any
    ) -> tuple[KubernetesResourceSource, Datastore]:
        api = KubeApi(load_config(server=fake.url), NS, timeout_s=API_TIMEOUT_S)
        store = Datastore()
        options: dict[str, Any] = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05} | settings
        source = KubernetesResourceSource(
            api,
            store,
            KubeSettings(namespace=NS, identity=identity, **options),
            sleep=sleep or VirtualSleep(),
            rng=random.Random(7),
            elector=elector,
        )
        made.append(source)
        return source, store

    yield make
    for source in made:
        await source.api.close()


class ManualClock:
    """A monotonic clock and sleep that only move when the test says so (`advance`): several
    replicas' backoffs run against one virtual timeline, so "the API server is down for 60 s"
    takes a fraction of a second and never depends on the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self.now + seconds, future)
        self._sleepers.append(entry)
        try:
            await future
        finally:
            if entry in self._sleepers:
                self._sleepers.remove(entry)

    async def advance(self, seconds: float, *, step: float = 0.1) -> None:
        """Move time on by `seconds` in `step`s, waking every sleeper that is due and letting
        the loop run (real I/O against the fake API server) after each step."""
        target = self.now + seconds
        while self.now < target - 1e-9:
            self.now = min(target, self.now + step)
            for deadline, future in list(self._sleepers):
                if deadline <= self.now and not future.done():
                    future.set_result(None)
            for _ in range(3):
                await asyncio.sleep(0.002)
