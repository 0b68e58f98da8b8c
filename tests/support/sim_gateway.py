"""A gateway in the test's own process: one simulated model server (`poolkeeper.sim`) and
the composition root `serve` runs (`GatewayRuntime`, with its managed Envoy unless the
options say otherwise), each started on entry and always stopped on the way out.

    async with sim_server() as sim_port, running_gateway(
        ServeOptions(source=file_source([one_pool(tmp_path, sim_port)]), ready_wait_s=5)
    ) as runtime:
        ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet

MODEL = "m"


@asynccontextmanager
async def sim_server(model: str = MODEL, host: str = "127.0.0.1") -> AsyncIterator[int]:
    """One real-time simulated server of `model` on `host` (no step jitter); yields its
    port. An OSError from binding `host` (no IPv6 loopback, say) comes out of the entry."""
    cluster = SimCluster(
        build_fleet(count=1, cli=ServerSettings(model=model, step_jitter=0.0)), host=host
    )
    try:
        (sim,) = await cluster.start()
        yield sim.port
    finally:
        await cluster.stop()


@asynccontextmanager
async def running_gateway(options: ServeOptions) -> AsyncIterator[GatewayRuntime]:
    """`GatewayRuntime(options)`, started; stopped without a drain on the way out (a test
    that drains stops it itself first: stopping twice is a no-op)."""
    runtime = GatewayRuntime(options)
    await runtime.start()  # stops whatever it started before raising
    try:
        yield runtime
    finally:
        await runtime.stop(grace_s=0)
