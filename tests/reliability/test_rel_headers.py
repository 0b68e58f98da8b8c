"""Round 2, finding 3: header limits the client owns. 114-120 client headers (accepted by the
listener, which leaves room for the EPP's mutation) and a single ~61 KB header got 503 "the
endpoint picker is unavailable": the EPP's header mutation pushed the request over Envoy's
limit, and the failure was reported as the EPP's. Now the client's limits are checked before
the EPP routes: 431 in OpenAI's error shape (or 200 within the limits), never a 503. (First a
Lua filter in Envoy counted them; now the EPP does, from the request headers it is sent,
before its header mutation exists: `ExtProcSettings.client_header_limits`.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import hpack
import pytest

from tests.reliability.rel_harness import gate, raw_http, status_of

pytestmark = pytest.mark.integration

CHAT = b'{"model":"m","messages":[]}'


def _request(headers: list[tuple[str, str]]) -> bytes:
    """A chat request with exactly these headers besides host, content-type, content-length."""
    head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(CHAT)}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers)
    return (head + "\r\n").encode() + CHAT


def _body(answer: bytes) -> dict[str, object]:
    _, _, body = answer.partition(b"\r\n\r\n")
    start, end = body.find(b"{"), body.rfind(b"}")  # plain or one chunk
    parsed = json.loads(body[start : end + 1]) if 0 <= start < end else {}
    return parsed if isinstance(parsed, dict) else {}


@pytest.mark.parametrize("fail_open", [False, True])
async def test_too_many_or_too_large_headers_get_431_never_503(
    tmp_path: Path, fail_open: bool
) -> None:
    async with gate(tmp_path, fail_open=fail_open) as g:
        for total in (101, 104, 110, 114, 117, 120):
            turns = g.router.turn
            answer = await raw_http(g.port, _request([(f"x-h{i}", "v") for i in range(total - 3)]))
            status = status_of(answer)
            assert status in (200, 431), (total, answer[:300])
            if status == 431:
                error = _body(answer)["error"]
                assert isinstance(error, dict)
                assert error["code"] == "request_header_fields_too_large"
                assert g.router.turn == turns, total  # refused before routing
        for size in (60 * 1024 - 200, 61 * 1024, 62 * 1024):
            answer = await raw_http(g.port, _request([("x-big", "v" * size)]))
            status = status_of(answer)
            assert status != 503, (size, answer[:300])
            assert b"endpoint_picker_unavailable" not in answer, size
            if size > 60 * 1024:  # within the limit it reaches the echo server (its own 400)
                assert status in (0, 431), (size, answer[:300])
        # Within the limits: served.
        answer = await raw_http(g.port, _request([(f"x-h{i}", "v") for i in range(97)]))
        assert status_of(answer) == 200


async def test_a_long_url_gets_431_never_503(tmp_path: Path) -> None:
    """The request line is the client's too: a 61-65 KB URL passed the first header check (it
    counted headers only) and, with the EPP's mutation on top, could cross the codec's limit
    (503 naming the EPP) or reach a server. Now 431 before the EPP is asked."""
    async with gate(tmp_path) as g:
        for size in (61 * 1024, 63 * 1024, 65_000):
            turns = g.router.turn
            request = (
                f"POST /v1/chat/completions?q={'a' * size} HTTP/1.1\r\nhost: x\r\n"
                f"content-type: application/json\r\ncontent-length: {len(CHAT)}\r\n\r\n"
            ).encode() + CHAT
            answer = await raw_http(g.port, request)
            assert status_of(answer) == 431, (size, answer[:300])
            assert g.router.turn == turns, size


async def _h2_status(port: int, headers: list[tuple[str, str]]) -> str:
    """One HTTP/2 (prior knowledge, cleartext) chat request with these headers after the
    pseudo headers and content-type: the response's :status, or `reset` / `goaway`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return (
            len(payload).to_bytes(3, "big")
            + bytes([kind, flags])
            + stream.to_bytes(4, "big")
            + payload
        )

    block = hpack.Encoder().encode(
        [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
         (":authority", "x"), ("content-type", "application/json"), *headers]
    )  # fmt: skip
    writer.write(
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + frame(0x4, 0, 0, b"")  # SETTINGS
        + frame(0x1, 0x4, 1, block)  # HEADERS, END_HEADERS
        + frame(0x0, 0x1, 1, CHAT)  # DATA, END_STREAM
    )
    decoder = hpack.Decoder()
    try:
        while True:
            head = await asyncio.wait_for(reader.readexactly(9), 10)
            length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
            payload = await reader.readexactly(length)
            if kind == 0x4 and not flags & 0x1:
                writer.write(frame(0x4, 0x1, 0, b""))  # SETTINGS ACK
            elif kind == 0x1:
                return dict(decoder.decode(payload, raw=True))[b":status"].decode()
            elif kind == 0x3:
                return "reset"
            elif kind == 0x7:
                return "goaway"
    finally:
        writer.close()


async def test_http2_header_limits_are_the_same(tmp_path: Path) -> None:
    """Over HTTP/2 (the public listener speaks it in cleartext too) 100 client headers are
    served (before: 431, a header Envoy adds itself was counted as the client's), 101-120 get
    431 from the EPP's check (before: reset by the codec from 117), and above the codec's limit the
    stream is reset: never a 503."""
    async with gate(tmp_path) as g:
        assert await _h2_status(g.port, [(f"x-h{i}", "v") for i in range(99)]) == "200"
        for total in (101, 110, 117, 120, 140):
            turns = g.router.turn
            status = await _h2_status(g.port, [(f"x-h{i}", "v") for i in range(total - 1)])
            assert status in ("431", "reset"), (total, status)
            assert status == "431" or total > 120, (total, status)
            assert g.router.turn == turns, total
