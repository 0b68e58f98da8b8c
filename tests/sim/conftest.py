"""Shared fixture of the simulator tests: start SimClusters on free ports, stop them after."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from poolkeeper.sim.cluster import Listening, SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet

StartCluster = Callable[..., Awaitable[tuple[SimCluster, list[Listening]]]]


@pytest.fixture
async def sim_cluster() -> AsyncIterator[StartCluster]:
    clusters: list[SimCluster] = []

    async def start(count: int = 1, **settings: Any) -> tuple[SimCluster, list[Listening]]:
        specs = build_fleet(count=count, cli=ServerSettings.model_validate(settings))
        cluster = SimCluster(specs, host="127.0.0.1", base_port=0)
        clusters.append(cluster)
        return cluster, await cluster.start()

    yield start
    for cluster in clusters:
        await cluster.stop()
