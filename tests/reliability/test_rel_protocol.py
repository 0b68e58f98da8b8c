"""Round 2, finding 6 at the edge, against a real Envoy running our bootstrap: HTTP/1.0 clients
got an empty reply; GET/PUT/DELETE/TRACE on the chat path reached a model server; a client's
`x-sim-fault` reached the simulator (any client could make it fail requests); the EPP ignored
`Content-Encoding`, so the gateway and the server could read different bodies."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from tests.reliability.rel_harness import gate, raw_http, status_of

pytestmark = pytest.mark.integration

CHAT = b'{"model":"m","messages":[]}'


def _error(answer: bytes) -> dict[str, object]:
    _, _, body = answer.partition(b"\r\n\r\n")
    start, end = body.find(b"{"), body.rfind(b"}")
    parsed = json.loads(body[start : end + 1])
    assert isinstance(parsed, dict)
    error = parsed["error"]
    assert isinstance(error, dict)
    return error


async def test_http_10_is_answered(tmp_path: Path) -> None:
    async with gate(tmp_path) as g:
        for host in ("host: x\r\n", ""):
            request = (
                f"POST /v1/chat/completions HTTP/1.0\r\n{host}content-type: application/json\r\n"
                f"content-length: {len(CHAT)}\r\n\r\n"
            ).encode() + CHAT
            answer = await raw_http(g.port, request)
            assert status_of(answer) == 200, answer[:300]
            assert b'"served_by"' in answer


async def test_only_the_paths_method_reaches_a_server(tmp_path: Path) -> None:
    async with gate(tmp_path) as g, aiohttp.ClientSession() as session:
        for method in ("GET", "PUT", "DELETE", "TRACE", "PATCH"):
            async with session.request(method, g.url + "/v1/chat/completions", data=CHAT) as resp:
                body = await resp.json(content_type=None)
                assert resp.status == 405, (method, body)
                assert body["error"]["code"] == "method_not_allowed"
        async with session.post(g.url + "/v1/models", data=CHAT) as resp:
            assert resp.status == 405
        assert not any(b.seen for b in g.backends)
        assert g.router.turn == 0  # refused before the EPP was asked
        async with session.get(g.url + "/v1/models") as resp:
            assert resp.status == 200
        async with session.post(g.url + "/v1/chat/completions", data=CHAT) as resp:
            assert resp.status == 200


async def test_internal_headers_are_stripped_at_the_public_listener(tmp_path: Path) -> None:
    async with gate(tmp_path) as g, aiohttp.ClientSession() as session:
        headers = {"x-sim-fault": "status=503", "x-sim-anything": "1", "x-poolkeeper-x": "1"}
        async with session.post(g.url + "/v1/chat/completions", data=CHAT, headers=headers) as r:
            assert r.status == 200
        (seen,) = [s for b in g.backends for s in b.seen]
        names = {name.lower() for name in seen["headers"]}
        assert not any(n.startswith(("x-sim-", "x-poolkeeper-")) for n in names), names


async def test_a_compressed_body_gets_415_in_openai_shape(tmp_path: Path) -> None:
    async with gate(tmp_path) as g:
        for encoding in ("gzip", "br", "deflate", "GZIP", "identity, gzip"):
            request = (
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                f"\r\ncontent-encoding: {encoding}\r\ncontent-length: {len(CHAT)}\r\n\r\n"
            ).encode() + CHAT
            answer = await raw_http(g.port, request)
            assert status_of(answer) == 415, (encoding, answer[:300])
            assert _error(answer)["code"] == "unsupported_media_type"
        assert g.router.turn == 0
        assert not any(b.seen for b in g.backends)
        request = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            f"\r\ncontent-encoding: identity\r\ncontent-length: {len(CHAT)}\r\n\r\n"
        ).encode() + CHAT
        assert status_of(await raw_http(g.port, request)) == 200


async def test_connect_and_upgrades_are_refused_at_once(tmp_path: Path) -> None:
    """CONNECT has no path, so no route matched it: the EPP was asked and waited for a body
    that never came (the stream held 60 s, then 504). Now CONNECT and a WebSocket upgrade get
    403 in OpenAI's shape at once, and an h2c upgrade is not taken (served over HTTP/1.1)."""
    async with gate(tmp_path) as g:
        for request in (
            b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nhost: 127.0.0.1:22\r\n\r\n",
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
        ):
            answer = await raw_http(g.port, request, read_timeout_s=10.0)
            assert status_of(answer) == 403, answer[:300]
            assert _error(answer)["code"] == "upgrade_not_supported"
        turns = g.router.turn
        h2c = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings"
            "\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(CHAT)}\r\n\r\n"
        ).encode() + CHAT
        answer = await raw_http(g.port, h2c)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert g.router.turn == turns + 1


async def test_options_asterisk_gets_a_well_formed_error(tmp_path: Path) -> None:
    """`OPTIONS *` (RFC 9110's server-wide form) has no path a route can match: Envoy answered
    an empty 404. It gets an OpenAI error at once now, the EPP not asked."""
    async with gate(tmp_path) as g:
        turns = g.router.turn
        answer = await raw_http(g.port, b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status_of(answer) in (404, 405), answer[:300]
        assert _error(answer)["type"] == "invalid_request_error", answer[:300]
        assert g.router.turn == turns


async def test_envoys_own_400_and_408_get_openai_errors(tmp_path: Path) -> None:
    """Outside audit: an HTTP/1.1 request without Host, a target with a fragment or an encoded
    NUL got Envoy's empty 400, and headers that did not arrive in time its text/plain 408. Each
    is an OpenAI error now; the EPP's own 400 (a body without `model`) keeps its message."""
    async with gate(tmp_path, request_headers_timeout_s=1.0) as g:
        body = b"content-length: 2\r\n\r\n{}"
        for request, detail in (
            (b"POST /v1/chat/completions HTTP/1.1\r\n" + body, "missing_host_header"),
            (b"POST /v1/chat/completions#part HTTP/1.1\r\nhost: x\r\n" + body,
             "path_normalization_failed"),
            (b"POST /v1/chat/completions%00 HTTP/1.1\r\nhost: x\r\n" + body,
             "path_normalization_failed"),
        ):  # fmt: skip
            answer = await raw_http(g.port, request)
            assert status_of(answer) == 400, answer[:300]
            error = _error(answer)
            assert error["code"] == "malformed_request", answer[:300]
            # Which cause it was, in Envoy's %RESPONSE_CODE_DETAILS% (review of the audit).
            assert f"malformed request ({detail})" in str(error["message"]), answer[:300]
        answer = await raw_http(
            g.port, b"POST /v1/chat/completions?a=#b HTTP/1.1\r\nhost: x\r\n" + body
        )
        assert _error(answer)["code"] == "malformed_request", answer[:300]
        bad = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{x"
        answer = await raw_http(g.port, bad)
        assert status_of(answer) == 400, answer[:300]
        assert "JSON" in str(_error(answer)["message"]), answer[:300]
        slow = await raw_http(
            g.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost:", read_timeout_s=10.0
        )
        assert status_of(slow) == 408, slow[:300]
        assert _error(slow)["code"] == "request_timeout", slow[:300]
