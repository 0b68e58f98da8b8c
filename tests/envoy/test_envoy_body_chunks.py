"""What real Envoy sends for a large request body reaches the Exchange as wire body chunks.

`wire.body_chunk` reads Envoy's body messages without the protobuf parser (a view of the
message, where a parse copies the body twice). Envoy 1.40 ends every message with an empty
`metadata_context`; a reader that knew only the bare form sent every chunk of a 1 MiB body to
the parser in `serve` while the unit tests (built without it) passed. Only a real Envoy shows
what it sends.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.extproc import lean
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.extproc.wire import WIRE_FROM_BYTES, BodyChunk, Request, read_request
from poolkeeper.netutil import free_port
from tests.envoy.envoy_harness import (
    Backend,
    RoundRobinRouter,
    rig_params,
    running_envoy,
    start_epp,
)

pytestmark = pytest.mark.integration


async def test_envoys_large_body_messages_are_read_as_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, bool]] = []  # (message bytes, read as a BodyChunk)

    def recording(raw: bytes) -> Request:
        request = read_request(raw)
        seen.append((len(raw), isinstance(request, BodyChunk)))
        return request

    monkeypatch.setattr(lean, "read_request", recording)  # before the methods are built
    backend = Backend("a")
    await backend.start()
    epp_port = free_port()
    server = await start_epp("lean", ExtProcServicer(RoundRobinRouter([backend])), epp_port)
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write([backend.hostport])
    params = rig_params([backend], epp_port, endpoints.path, fail_open=False)
    big = "the quick brown fox " * 45_000  # 900,000 bytes: several messages of Envoy's
    try:
        async with (
            running_envoy(params, tmp_path),
            aiohttp.ClientSession() as session,
            session.post(
                f"http://127.0.0.1:{params.listen_port}/v1/completions",
                json={"model": "alias", "prompt": big},
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
            assert json.loads(await resp.read())["received_bytes"] > 900_000
    finally:
        await server.stop(None)
        await backend.stop()
    assert backend.seen[-1]["body"]["prompt"] == big
    large = [chunk for size, chunk in seen if size >= WIRE_FROM_BYTES]
    assert len(large) >= 2, seen  # the body came in several messages
    assert all(large), seen  # every one of them read off the wire, none parsed
