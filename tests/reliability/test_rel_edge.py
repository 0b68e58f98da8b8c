"""Findings 1, 3, 5 and 7 at the edge, against a real Envoy running our bootstrap: the
inference-API allowlist, early 413 on a declared length, the header-count headroom for the
EPP's mutation, a bounded wait for a hung EPP, and refused obs-fold / bare-LF requests.
Raw-socket probes (checklist E2-E4) and aiohttp clients, all on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from tests.reliability.rel_harness import gate, raw_http, status_of

pytestmark = pytest.mark.integration

CHAT = b'{"model":"m","messages":[]}'


def _post(path: str, body: bytes = CHAT, extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


async def test_only_inference_paths_reach_model_servers(tmp_path: Path) -> None:
    """Finding 1 (F7): admin paths of model servers are never proxied; 404 in OpenAI JSON."""
    async with gate(tmp_path) as g, aiohttp.ClientSession() as session:
        refused = [
            ("POST", "/v1/unload_lora_adapter"),
            ("POST", "/v1/load_lora_adapter"),
            ("GET", "/metrics"),
            ("GET", "/health"),
            ("POST", "/admin/faults"),
            ("POST", "/v1/chat/completions/../../v1/unload_lora_adapter"),
            ("POST", "/v1/chat/completionsX"),
            ("GET", "/"),
        ]
        for method, path in refused:
            async with session.request(method, g.url + path, data=CHAT) as resp:
                body = await resp.json(content_type=None)
                assert resp.status == 404, (path, resp.status)
                assert body["error"]["code"] == "not_found"
        assert not any(seen for b in g.backends for seen in b.seen)
        for path in ("/v1/chat/completions", "/v1/completions/", "/v1/embeddings?x=1"):
            async with session.post(g.url + path, data=CHAT) as resp:
                assert resp.status == 200, (path, await resp.text())
        async with session.get(g.url + "/v1/models") as resp:
            assert resp.status == 200


async def test_allowlist_is_configurable(tmp_path: Path) -> None:
    async with (
        gate(tmp_path, inference_paths=("/v1/chat/completions", "/tokenize")) as g,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(g.url + "/tokenize", data=CHAT) as resp:
            assert resp.status == 200
        async with session.post(g.url + "/v1/completions", data=CHAT) as resp:
            assert resp.status == 404


async def test_declared_oversize_body_is_refused_before_100_continue(tmp_path: Path) -> None:
    """Finding 3 (E4): Content-Length over the limit → 413 at once, no `100 Continue`, no
    body read; the EPP never sees the request."""
    async with gate(tmp_path, max_body_bytes=1 << 20) as g:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: 200000000\r\n\r\n"
        )
        answer = await raw_http(g.port, head + b"{" * 1000)
        assert status_of(answer) == 413
        assert b"request_too_large" in answer
        assert g.router.turn == 0


async def test_oversize_body_with_continue_is_not_read(tmp_path: Path) -> None:
    """Envoy answers `100 Continue` itself (proxying it would deadlock with ext_proc holding the
    headers); the 413 follows at once and the connection closes without reading a body."""
    async with gate(tmp_path, max_body_bytes=1 << 20) as g:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 200000000\r\n"
            b"expect: 100-continue\r\n\r\n"
        )
        answer = await raw_http(g.port, head)
        assert status_of(answer) == 413
        assert g.router.turn == 0


async def test_underlimit_expect_continue_still_works(tmp_path: Path) -> None:
    async with gate(tmp_path) as g, aiohttp.ClientSession() as session:
        headers = {"expect": "100-continue", "content-type": "application/json"}
        async with session.post(g.url + "/v1/chat/completions", data=CHAT, headers=headers) as resp:
            assert resp.status == 200


async def test_94_to_100_client_headers_are_served(tmp_path: Path) -> None:
    """Finding 5: the EPP's header mutation must not push a request with <= 100 client
    headers over Envoy's limit (it answered 503 'endpoint picker unavailable')."""
    async with gate(tmp_path) as g, aiohttp.ClientSession() as session:
        for count in (94, 97, 100):
            # aiohttp adds host, accept, accept-encoding, user-agent, content-length, content-type
            headers = {f"x-h{i}": "v" for i in range(count - 6)}
            headers["content-type"] = "application/json"
            async with session.post(
                g.url + "/v1/chat/completions", data=CHAT, headers=headers
            ) as resp:
                assert resp.status == 200, (count, await resp.text())
        too_many = "".join(f"x-h{i}: v\r\n" for i in range(300))
        answer = await raw_http(g.port, _post("/v1/chat/completions", extra=too_many))
        assert status_of(answer) in (0, 431)  # refused (Envoy's HTTP/1 codec may just close)


async def test_hung_epp_is_bounded_by_the_message_timeout(tmp_path: Path) -> None:
    """Finding 5: an EPP that accepts the stream and never answers costs a request at most
    the (configurable) message timeout, not 1000 s; FailClose answers in OpenAI JSON."""
    async with (
        gate(tmp_path, hung_epp=True, message_timeout_s=1.0) as g,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(g.url + "/v1/chat/completions", data=CHAT) as resp,
    ):
        body = await resp.json(content_type=None)
        assert resp.status == 504
        assert body["error"]["type"] == "timeout_error"


async def test_hung_epp_under_fail_open_is_bounded_too(tmp_path: Path) -> None:
    """Envoy cannot fail open once the body went to the processor (envoy PR #41276), so a hung
    EPP under FailOpen is bounded, not bypassed (docs/reliability.md)."""
    async with (
        gate(tmp_path, hung_epp=True, message_timeout_s=1.0, fail_open=True) as g,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(g.url + "/v1/chat/completions", data=CHAT) as resp,
    ):
        body = json.loads(await resp.read())
        assert resp.status == 504
        assert body["error"]["code"] == "stream_idle_timeout"


SMUGGLING = {
    "cl-te": _post("/v1/chat/completions", extra="transfer-encoding: chunked\r\n"),
    "two-cl": _post("/v1/chat/completions", extra="content-length: 3\r\n"),
    "te-gzip-chunked": b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
    b"transfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "underscore": _post("/v1/chat/completions", extra="x_under: 1\r\n"),
}
NORMALISED = {
    "obs-fold": _post("/v1/chat/completions", extra="x-a: 1\r\n folded\r\n"),
    "bare-lf": b"POST /v1/chat/completions HTTP/1.1\nhost: x\nx-a: 1\ncontent-length: "
    + str(len(CHAT)).encode()
    + b"\n\n"
    + CHAT,
}


async def test_smuggling_and_malformed_framing_never_reach_upstream(tmp_path: Path) -> None:
    """E2/E3: refused with 400 or a closed connection; nothing reaches a model server or the
    EPP. Then finding 7, as far as Envoy allows: neither of its HTTP/1 parsers (balsa,
    http-parser) can be told to refuse obs-fold or bare LF. RFC 9112 lets a proxy replace
    obs-fold with SP (section 5.2) and accept bare LF (section 2.2) instead; what matters is
    that the model server sees one well-formed request, so nothing is smuggled past the EPP."""
    async with gate(tmp_path) as g:
        for name, probe in SMUGGLING.items():
            answer = await raw_http(g.port, probe)
            assert status_of(answer) in (0, 400), (name, answer[:200])
            assert g.router.turn == 0, name
            assert not any(b.seen for b in g.backends), name
        for name, probe in NORMALISED.items():
            before = sum(len(b.seen) for b in g.backends)
            answer = await raw_http(g.port, probe)
            status = status_of(answer)
            assert status in (0, 400, 200), (name, answer[:200])
            seen = [s for b in g.backends for s in b.seen]
            if status == 200:
                assert len(seen) == before + 1, name
                value = seen[-1]["headers"].get("x-a", "")
                assert "\n" not in value, name
                assert "\r" not in value, name
                assert seen[-1]["body"] == json.loads(CHAT), name
            else:
                assert len(seen) == before, name
