"""`OwnLoopServer`: a grpc.aio server on a thread and event loop of its own (server/own_loop.py)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from envoy.service.auth.v3 import external_auth_pb2 as auth_pb2, external_auth_pb2_grpc

from poolkeeper.server.own_loop import OwnLoopServer


class _Allow(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    async def Check(
        self, request: auth_pb2.CheckRequest, context: object
    ) -> auth_pb2.CheckResponse:
        response = auth_pb2.CheckResponse()
        response.status.code = 7  # what only this servicer answers
        return response


def _server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(_Allow(), server)
    return server, server.add_insecure_port("127.0.0.1:0")


def _check(port: int, answers: list[int]) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = external_auth_pb2_grpc.AuthorizationStub(channel)
        answers.append(stub.Check(auth_pb2.CheckRequest(), timeout=10).status.code)


async def test_it_answers_while_the_callers_loop_is_blocked() -> None:
    server = OwnLoopServer(_server, "own-loop-test")
    await server.start()
    try:
        assert server.port > 0
        answers: list[int] = []
        client = threading.Thread(target=_check, args=(server.port, answers))
        client.start()
        client.join(15)  # this loop is blocked meanwhile: the answer cannot come from it
        assert answers == [7]
        assert any(t.name == "own-loop-test" for t in threading.enumerate())
    finally:
        await server.stop(None)
    await server.stop(None)  # idempotent
    assert not any(t.name == "own-loop-test" for t in threading.enumerate())


async def test_a_failure_to_build_is_raised_by_start() -> None:
    def broken() -> tuple[grpc.aio.Server, int]:
        raise OSError("cannot bind")

    server = OwnLoopServer(broken, "own-loop-broken")
    with pytest.raises(OSError, match="cannot bind"):
        await server.start()
    await server.stop(None)  # nothing to stop
    for _ in range(100):
        if not any(t.name == "own-loop-broken" for t in threading.enumerate()):
            break
        await asyncio.sleep(0.01)
    assert not any(t.name == "own-loop-broken" for t in threading.enumerate())
