"""gRPC health as llm-d-router's EPP answers it (`poolkeeper-epp`: `for_upstream_epp`), over a
real gRPC server on 127.0.0.1: one answer for every name without leader election; with it,
`liveness` always SERVING, readiness leader-gated, any other name SERVICE_UNKNOWN."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc

from poolkeeper.telemetry.health import (
    EXT_PROC_SERVICE,
    NOT_SERVING,
    SERVICE_UNKNOWN,
    SERVING,
    HealthService,
    check_health,
)


@asynccontextmanager
async def serving(
    ready: Callable[[], bool], leading: Callable[[], bool | None]
) -> AsyncIterator[str]:
    server = grpc.aio.server()
    HealthService.for_upstream_epp(ready=ready, leading=leading).register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def _statuses(address: str) -> dict[str, int]:
    names = ["", "liveness", "readiness", EXT_PROC_SERVICE, "inference-extension"]
    return {name: await check_health(address, name) for name in names}


async def test_without_leader_election_every_name_gets_the_readiness_answer() -> None:
    state = {"ready": False}
    async with serving(lambda: state["ready"], lambda: None) as address:
        assert set((await _statuses(address)).values()) == {NOT_SERVING}
        state["ready"] = True
        assert set((await _statuses(address)).values()) == {SERVING}  # the chart's probe too


async def test_with_leader_election_readiness_follows_the_lease() -> None:
    state = {"leader": False}
    async with serving(lambda: True, lambda: state["leader"]) as address:
        standby = await _statuses(address)
        assert standby == {
            "": NOT_SERVING,
            "liveness": SERVING,  # a standby is alive: the kubelet must not restart it
            "readiness": NOT_SERVING,
            EXT_PROC_SERVICE: NOT_SERVING,
            "inference-extension": SERVICE_UNKNOWN,
        }
        state["leader"] = True
        leader = await _statuses(address)
        assert leader == {**standby, "": SERVING, "readiness": SERVING, EXT_PROC_SERVICE: SERVING}


def test_both_transports_answer_unknown_names_alike() -> None:
    """The lean ext_proc transport's Check asks `check_status` too (server/transport.py)."""
    electing = HealthService.for_upstream_epp(ready=lambda: True, leading=lambda: True)
    assert electing.check_status("inference-extension") == SERVICE_UNKNOWN
    assert electing.check_status("liveness") == SERVING
    plain = HealthService.for_gateway(live=lambda: True, ready=lambda: True)
    assert plain.check_status("inference-extension") == SERVING  # its default: ext_proc's answer
