"""An outside probe of `poolkeeper serve` (real Envoy, simulators), loopback only, bounded.

The fault and bad-input scenarios of the reliability checklist and of issue 34's outside probe
that a client on this host can try, each printed PASS/FAIL with what was seen:

    .venv/bin/python scripts/probe_sweep.py            # about 1-2 minutes; exit 1 on a FAIL
    .venv/bin/python scripts/probe_sweep.py -k header  # only scenarios whose name matches

Everything listens on 127.0.0.x; clients use 127.0.0.1-127.0.0.4 as source addresses. The
last scenarios stop the EPP for a moment (SIGSTOP) and end the gateway (SIGTERM under load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)

from poolkeeper.netutil import free_ports

MODEL = "m"
PER_CLIENT = 16  # edge.maxConnectionsPerClient of the probed gateway
EPP_TIMEOUT_S = 31.0  # must exceed the flow-control queue TTLs (30 s)
CHAT = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()


def chat(model: str = MODEL, *, stream: bool = False, tokens: int = 4, **extra: object) -> bytes:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": tokens,
        **extra,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def post(body: bytes, *, path: str = "/v1/chat/completions", headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


@dataclass
class Gateway:
    http: int
    ext_proc: int
    metrics: int
    health: int
    sims: list[int]
    config: Path
    serve: subprocess.Popen[bytes]
    canary_hits: list[int]


async def raw(port: int, data: bytes, *, source: str = "127.0.0.1", wait_s: float = 5.0) -> bytes:
    """Send `data` on a new connection; what came back until close, or a complete answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    out = b""
    try:
        writer.write(data)
        await writer.drain()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            except (TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            out += chunk
            if _complete(out):
                break
    finally:
        writer.close()
    return out


def _complete(answer: bytes) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep or head.startswith(b"HTTP/1.1 100"):
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
        if name.strip().lower() == b"transfer-encoding":
            return body.endswith(b"0\r\n\r\n")
    return False


def status(answer: bytes) -> int:
    codes = [
        int(line.split()[1])
        for line in answer.split(b"\r\n")
        if line.startswith(b"HTTP/1.") and len(line.split()) > 1
    ]
    return codes[-1] if codes else 0


def error_code(answer: bytes) -> str | None:
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    try:
        parsed = json.loads(body or b"null")
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return str(error.get("code") or error.get("type")) if isinstance(error, dict) else None


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return out


# -- the scenarios: each returns (passed, what was seen) -------------------------------------
Result = tuple[bool, str]


async def s_served(g: Gateway) -> Result:
    answer = await raw(g.http, post(CHAT))
    return status(answer) == 200, f"status {status(answer)}"


async def s_stream_done(g: Gateway) -> Result:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{g.http}/v1/chat/completions",
            data=chat(stream=True, tokens=20),
            headers={"content-type": "application/json"},
        ) as resp,
    ):
        text = await resp.text()
    return resp.status == 200 and "data: [DONE]" in text, f"{resp.status}, [DONE] seen"


async def s_admin_paths(g: Gateway) -> Result:
    paths = [
        "/metrics",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/health",
        "/reset_prefix_cache",
        "/sim/state",
        "/debug/pprof/",
        "/v1/chat/completions/../../metrics",
        "/%2e%2e/metrics",
        "//metrics",
        "/v1/models/../../health",
        "/tokenize",
    ]
    served = []
    for path in paths:
        for method in ("GET", "POST"):
            answer = await raw(
                g.http,
                f"{method} {path} HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\n\r\n{{}}".encode(),
            )
            if status(answer) in (200, 0) or (status(answer) != 301 and not error_code(answer)):
                served.append(f"{method} {path}: {status(answer)}")
    return not served, f"{len(paths) * 2} tried, reached a server or unanswered: {served or 0}"


async def s_declared_oversize(g: Gateway) -> Result:
    start = time.monotonic()
    answer = await raw(
        g.http,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
        b"content-type: application/json\r\ncontent-length: 200000000\r\n\r\n{",
    )
    ms = (time.monotonic() - start) * 1e3
    return status(answer) == 413 and ms < 1000, f"{status(answer)} in {ms:.0f} ms"


async def s_chunked_oversize(g: Gateway) -> Result:
    reader, writer = await asyncio.open_connection("127.0.0.1", g.http)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: "
        b"application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    piece = b"a" * 65536
    sent = 0
    try:
        while sent < 20 << 20:
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await asyncio.wait_for(writer.drain(), 5)
            sent += len(piece)
    except (ConnectionError, TimeoutError):
        pass
    with contextlib.suppress(ConnectionError, TimeoutError):
        writer.write(b"0\r\n\r\n")
    try:
        answer = await asyncio.wait_for(reader.read(4096), 10)
    except (ConnectionError, TimeoutError):
        answer = b""
    writer.close()
    return status(answer) in (413, 503), f"{status(answer)} after {sent >> 20} MiB sent"


async def s_metrics_cardinality(g: Gateway) -> Result:
    """1,050 distinct unknown model names (and one of 100 KB with a newline): the model
    labels keep at most 1,000 values (upstream's cap), then `other`, each at most 128 long."""

    async def sender(first: int) -> None:
        async with aiohttp.ClientSession() as s:
            for i in range(first, 1050, 10):
                async with s.post(url, data=chat(f"probe-model-{i}")) as resp:
                    await resp.read()

    url = f"http://127.0.0.1:{g.http}/v1/chat/completions"
    await asyncio.gather(*(sender(i) for i in range(10)))
    await raw(g.http, post(chat("x" * 100_000 + "\nforged 1")))
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{g.metrics}/metrics") as r:
        page = await r.text()
    # Both model labels share the cap; an empty target (a rejected request) is no value.
    names = set(re.findall(r'(?:^|[{,])(?:target_)?model_name="([^"]+)"', page, re.MULTILINE))
    longest = max((len(n) for n in names), default=0)
    forged = any(line.startswith("forged") for line in page.splitlines())
    ok = len(names) <= 1001 and longest <= 128 and not forged
    return ok, f"{len(names)} model names exported (cap 1,000 + other), longest {longest}"


async def s_unknown_model(g: Gateway) -> Result:
    answer = await raw(g.http, post(chat("no-such-model")))
    return status(answer) == 404 and error_code(answer) == "model_not_found", (
        f"{status(answer)} {error_code(answer)}"
    )


async def s_bad_json(g: Gateway) -> Result:
    seen = []
    for body in (b"{not json", b"[1,2]", b'{"model": 5}', b'{"messages": []}'):
        answer = await raw(g.http, post(body))
        seen.append(status(answer))
    return all(s == 400 for s in seen), f"statuses {seen}"


async def s_empty_body(g: Gateway) -> Result:
    answer = await raw(g.http, post(b""))
    return status(answer) == 400, f"{status(answer)} {error_code(answer)}"


async def s_json_bomb(g: Gateway) -> Result:
    start = time.monotonic()
    answer = await raw(g.http, post(b"[" * 100_000))
    ms = (time.monotonic() - start) * 1e3
    return status(answer) == 400 and ms < 2000, f"{status(answer)} in {ms:.0f} ms"


async def s_100_headers(g: Gateway) -> Result:
    extra = "".join(f"x-h{i}: v\r\n" for i in range(95))
    answer = await raw(g.http, post(CHAT, headers=extra))
    return status(answer) == 200, f"{status(answer)}"


async def s_too_many_headers(g: Gateway) -> Result:
    seen = {}
    for count in (114, 120):
        extra = "".join(f"x-h{i}: v\r\n" for i in range(count))
        answer = await raw(g.http, post(CHAT, headers=extra))
        seen[count] = (status(answer), error_code(answer))
    ok = all(s == 431 for s, _ in seen.values())
    return ok, f"{seen}"


async def s_huge_header(g: Gateway) -> Result:
    # 61 KiB: over the client's 60 KiB. (A header under it passes the gateway; the simulator,
    # aiohttp, refuses fields over 8,190 bytes with its own 400.)
    answer = await raw(g.http, post(CHAT, headers=f"x-big: {'a' * 62_464}\r\n"))
    return status(answer) == 431, f"{status(answer)} {error_code(answer)}"


async def s_own_errors_shaped(g: Gateway) -> Result:
    """Envoy's own 400s (no Host, a fragment, an encoded NUL) and a model server's answer to an
    allowlisted path it does not serve (embeddings on the simulator, `/v1/models/`) are OpenAI
    errors, not empty or text/plain bodies (outside audit)."""
    body = b"content-length: 2\r\n\r\n{}"
    malformed = "400 malformed_request"  # Envoy's own, with the gateway's code
    unserved = "404 404"  # the simulator's, as vLLM's handler answers (code: the status)
    requests = {  # name: (request, the status and error code it must get)
        "no Host": (b"POST /v1/chat/completions HTTP/1.1\r\n" + body, malformed),
        "fragment": (b"POST /v1/chat/completions#x HTTP/1.1\r\nhost: gw\r\n" + body, malformed),
        "%00": (b"POST /v1/chat/completions%00 HTTP/1.1\r\nhost: gw\r\n" + body, malformed),
        "embeddings": (
            post(json.dumps({"model": MODEL, "input": "hi"}).encode(), path="/v1/embeddings"),
            unserved,
        ),
        "models/": (b"GET /v1/models/ HTTP/1.1\r\nhost: gw\r\n\r\n", unserved),
    }
    seen = {}
    for name, (data, _) in requests.items():
        answer = await raw(g.http, data)
        seen[name] = f"{status(answer)} {error_code(answer)}"
    # Each against its own answer: a 404 where Envoy's 400 was due is a failure.
    ok = all(seen[name] == expected for name, (_, expected) in requests.items())
    return ok, f"{seen}"


async def s_http10(g: Gateway) -> Result:
    answer = await raw(
        g.http,
        (
            f"POST /v1/chat/completions HTTP/1.0\r\ncontent-type: "
            f"application/json\r\ncontent-length: {len(CHAT)}\r\n\r\n"
        ).encode()
        + CHAT,
    )
    return status(answer) == 200, f"{status(answer)}"


async def s_wrong_methods(g: Gateway) -> Result:
    seen = {}
    for method in ("GET", "PUT", "DELETE", "TRACE", "PATCH"):
        answer = await raw(
            g.http,
            f"{method} /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
            "content-length: 0\r\n\r\n".encode(),
        )
        seen[method] = status(answer)
    return all(s == 405 for s in seen.values()), f"{seen}"


async def s_options_asterisk(g: Gateway) -> Result:
    answer = await raw(g.http, b"OPTIONS * HTTP/1.1\r\nhost: gw\r\n\r\n")
    return status(answer) == 404 and error_code(answer) == "not_found", (
        f"{status(answer)} {error_code(answer)}"
    )


async def s_fault_header_stripped(g: Gateway) -> Result:
    seen = [
        status(await raw(g.http, post(CHAT, headers="x-sim-fault: status=500\r\n")))
        for _ in range(5)
    ]
    return all(s == 200 for s in seen), f"statuses {seen} (simulators obey x-sim-fault)"


async def s_content_encoding(g: Gateway) -> Result:
    answer = await raw(g.http, post(CHAT, headers="content-encoding: gzip\r\n"))
    return status(answer) == 415, f"{status(answer)} {error_code(answer)}"


async def s_smuggling(g: Gateway) -> Result:
    cases = {
        "CL+TE": b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 4\r\n"
        b"transfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /metrics HTTP/1.1\r\nhost: gw\r\n\r\n",
        "two CLs": b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\n"
        b"content-length: 40\r\n\r\n{}",
        "TE gzip,chunked": b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
        b"transfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        "underscore": b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nx_forwarded: a\r\n"
        b"content-length: 2\r\n\r\n{}",
    }
    seen = {name: status(await raw(g.http, data, wait_s=3)) for name, data in cases.items()}
    return all(s in (0, 400) for s in seen.values()), f"{seen} (0: closed)"


async def s_connect_upgrade(g: Gateway) -> Result:
    connect = await raw(g.http, b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nhost: 127.0.0.1:22\r\n\r\n")
    ws = await raw(
        g.http,
        b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\n"
        b"upgrade: websocket\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"sec-websocket-version: 13\r\n\r\n",
    )
    seen = (status(connect), status(ws))
    return all(s in (403, 405) for s in seen), f"CONNECT {seen[0]}, websocket {seen[1]}"


async def s_spoofed_destination(g: Gateway) -> Result:
    canary = f"127.0.0.1:{g.canary_hits[0]}"
    before = len(g.canary_hits) - 1
    seen = []
    for header in ("x-gateway-destination-endpoint", "x-envoy-original-dst-host"):
        seen.append(status(await raw(g.http, post(CHAT, headers=f"{header}: {canary}\r\n"))))
    for key in ("api_base", "base_url"):
        body = json.loads(CHAT) | {key: f"http://{canary}"}
        seen.append(status(await raw(g.http, post(json.dumps(body).encode()))))
    hits = len(g.canary_hits) - 1 - before
    return hits == 0 and all(s == 200 for s in seen), f"statuses {seen}, canary connections {hits}"


async def s_epp_port_direct(g: Gateway) -> Result:
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode())
            for k, v in {
                ":method": "POST",
                ":path": "/v1/chat/completions",
                ":authority": "gw",
            }.items()
        ]
    )
    codes = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{g.ext_proc}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(
            iter(
                [
                    pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)),
                    pb.ProcessingRequest(request_body=pb.HttpBody(body=CHAT, end_of_stream=True)),
                ]
            )
        )
        try:
            await asyncio.wait_for(call.read(), 5)
            codes.append("ANSWERED")
        except grpc.aio.AioRpcError as error:
            codes.append(error.code().name)
        entry = accesslog_pb2.HTTPAccessLogEntry()
        entry.response.response_code.value = 200
        message = als_pb2.StreamAccessLogsMessage()
        message.http_logs.log_entry.append(entry)
        try:
            await asyncio.wait_for(
                als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([message])), 5
            )
            codes.append("ACCEPTED")
        except grpc.aio.AioRpcError as error:
            codes.append(error.code().name)
    ok = codes[0] in ("UNAUTHENTICATED", "INTERNAL") and codes[1] == "UNAUTHENTICATED"
    return ok, f"ext_proc {codes[0]}, forged access log {codes[1]}"


async def s_epp_ports_loopback(g: Gateway) -> Result:
    def reachable(host: str, port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((host, port)) == 0

    public = reachable("127.0.0.2", g.http)
    private = {p: reachable("127.0.0.2", p) for p in (g.ext_proc, g.health, g.metrics)}
    return public and not any(private.values()), (
        f"public listener on 127.0.0.2: {public}; EPP ports there: {sorted(private.values())}"
    )


async def s_silent_connection(g: Gateway) -> Result:
    reader, writer = await asyncio.open_connection("127.0.0.1", g.http)
    start = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(1), 15)
    except TimeoutError:
        data = b"held"
    writer.close()
    held = time.monotonic() - start
    return data == b"" and held < 12, f"closed after {held:.1f} s (idle timeout 10 s)"


async def s_idle_flood(g: Gateway) -> Result:
    idle = []
    for _ in range(500):
        with contextlib.suppress(OSError):
            idle.append(
                await asyncio.open_connection("127.0.0.1", g.http, local_addr=("127.0.0.4", 0))
            )
    slow = []
    for _ in range(10):
        _r, w = await asyncio.open_connection("127.0.0.1", g.http, local_addr=("127.0.0.5", 0))
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 1000\r\n\r\n{")
        slow.append(w)
    times = []
    for _ in range(10):
        start = time.monotonic()
        answer = await raw(g.http, post(CHAT), wait_s=2)
        times.append((status(answer), time.monotonic() - start))
    for _r, w in idle:
        w.close()
    for w in slow:
        w.close()
    ok = all(s == 200 and t < 2 for s, t in times)
    return (
        ok,
        f"{len(idle)} idle + 10 slow-body held: {sum(s == 200 for s, _ in times)}/10 served, "
        f"slowest {max(t for _, t in times):.2f} s",
    )


async def s_per_client_cap(g: Gateway) -> Result:
    held = []
    for _ in range(PER_CLIENT):
        r, w = await asyncio.open_connection("127.0.0.1", g.http, local_addr=("127.0.0.3", 0))
        w.write(post(CHAT))
        await r.readuntil(b"\r\n\r\n")
        held.append(w)
    over = await raw(g.http, post(CHAT), source="127.0.0.3", wait_s=3)
    other = await raw(g.http, post(CHAT), source="127.0.0.1")
    for w in held:
        w.close()
    ok = status(over) == 0 and status(other) == 200
    return (
        ok,
        f"connection {PER_CLIENT + 1} from one address: {status(over) or 'closed'}; "
        f"another address: {status(other)}",
    )


async def s_cut_streams(g: Gateway) -> Result:
    clean = errors = 0
    async with aiohttp.ClientSession() as s:
        for _ in range(20):
            try:
                async with s.post(
                    f"http://127.0.0.1:{g.http}/v1/chat/completions",
                    data=chat("cut", stream=True, tokens=30),
                    headers={"content-type": "application/json"},
                ) as resp:
                    text = await resp.text()
                if resp.status == 200 and "[DONE]" not in text:
                    clean += 1  # a clean end without [DONE]: a silent truncation
                else:
                    errors += 1
            except aiohttp.ClientError:
                errors += 1
    return clean == 0, f"20 streams cut by the server: {errors} ended in an error, {clean} silent"


async def s_client_disconnect(g: Gateway) -> Result:
    r, w = await asyncio.open_connection("127.0.0.1", g.http)
    w.write(post(chat(stream=True, tokens=4000)))
    await r.readuntil(b"data:")
    w.close()
    running = -1.0
    for _ in range(50):
        await asyncio.sleep(0.1)
        running = 0.0
        for port in g.sims:
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"http://127.0.0.1:{port}/metrics") as resp,
            ):
                for line in (await resp.text()).splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        running += float(line.rsplit(" ", 1)[1])
        if running == 0:
            break
    return running == 0, f"running on the servers after the client left: {running:g}"


async def s_deleted_models_file(g: Gateway) -> Result:
    models = g.config / "models.yaml"
    saved = models.read_text()
    models.unlink()
    await asyncio.sleep(3)
    answer = await raw(g.http, post(CHAT))
    models.write_text(saved)
    return status(answer) == 200, f"{status(answer)} after the models file was deleted"


async def s_hung_epp(g: Gateway) -> Result:
    os.kill(g.serve.pid, signal.SIGSTOP)  # the EPP (Envoy, its child, keeps running)
    try:
        start = time.monotonic()
        answer = await raw(g.http, post(CHAT), wait_s=EPP_TIMEOUT_S + 5)
        took = time.monotonic() - start
    finally:
        os.kill(g.serve.pid, signal.SIGCONT)
    resumed = time.monotonic()
    back = 0
    while time.monotonic() - resumed < 15 and back != 200:  # served again (health checks)
        back = status(await raw(g.http, post(CHAT)))
        await asyncio.sleep(0.1)
    again = time.monotonic() - resumed
    ok = status(answer) in (503, 504) and error_code(answer) is not None and back == 200
    return ok, (
        f"{status(answer)} {error_code(answer)} after {took:.1f} s (eppTimeoutS "
        f"{EPP_TIMEOUT_S:g}); served again {again:.1f} s after the EPP resumed"
    )


async def s_drain(g: Gateway) -> Result:
    """Truncated: a 200 whose body ended without [DONE]. Closed unanswered: a request sent on
    a keep-alive connection the gateway closed at that instant (HTTP/1.1's own race)."""
    seen = {
        "whole": 0,
        "truncated": 0,
        "closed unanswered": 0,
        "refused at connect": 0,
        "other status": 0,
    }
    other: dict[str, int] = {}  # the statuses counted in "other status"
    stop = asyncio.Event()

    async def one(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bool:
        """One streamed request; True if the connection stays open."""
        r, w = conn
        w.write(post(chat(stream=True, tokens=40)))
        try:
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            seen["closed unanswered"] += 1
            return False
        line = head.split(b"\r\n", 1)[0]
        if b" 200 " not in line:
            seen["other status"] += 1
            code = line.split(b" ")[1].decode() if len(line.split(b" ")) > 1 else "?"
            other[code] = other.get(code, 0) + 1
            return False
        try:
            body = await asyncio.wait_for(r.readuntil(b"\r\n0\r\n\r\n"), 20)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            body = b""
        seen["whole" if b"[DONE]" in body else "truncated"] += 1
        return b"connection: close" not in head.lower() and bool(body)

    async def client() -> None:
        while not stop.is_set():
            try:
                conn = await asyncio.open_connection("127.0.0.1", g.http)
            except OSError:
                seen["refused at connect"] += 1
                await asyncio.sleep(0.05)
                continue
            while not stop.is_set() and await one(conn):
                pass
            conn[1].close()

    tasks = [asyncio.create_task(client()) for _ in range(10)]
    await asyncio.sleep(2)
    g.serve.send_signal(signal.SIGTERM)
    for _ in range(300):
        if g.serve.poll() is not None:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    ok = seen["truncated"] == 0 and seen["whole"] > 0 and g.serve.poll() is not None
    return ok, f"{seen} {other or ''}, serve exited {g.serve.poll()}"


SCENARIOS: list[tuple[str, Callable[[Gateway], Awaitable[Result]]]] = [
    ("served: a chat request", s_served),
    ("served: a stream ends with [DONE]", s_stream_done),
    ("edge: admin and non-inference paths never reach a server", s_admin_paths),
    ("edge: declared oversize body refused at once", s_declared_oversize),
    ("edge: chunked oversize body refused", s_chunked_oversize),
    ("edge: unknown model", s_unknown_model),
    ("edge: invalid JSON / wrong shapes", s_bad_json),
    ("edge: empty POST body", s_empty_body),
    ("edge: JSON bomb", s_json_bomb),
    ("header: 100 headers served", s_100_headers),
    ("header: 114 and 120 headers get 431", s_too_many_headers),
    ("header: one 61 KiB header gets 431", s_huge_header),
    ("protocol: Envoy's and a server's own errors in OpenAI's shape", s_own_errors_shaped),
    ("protocol: HTTP/1.0 answered", s_http10),
    ("protocol: wrong methods on the chat path", s_wrong_methods),
    ("protocol: OPTIONS * well-formed", s_options_asterisk),
    ("protocol: x-sim-fault stripped", s_fault_header_stripped),
    ("protocol: Content-Encoding gzip refused", s_content_encoding),
    ("protocol: smuggling and malformed framing", s_smuggling),
    ("protocol: CONNECT and WebSocket upgrade refused", s_connect_upgrade),
    ("security: spoofed destinations and body URLs", s_spoofed_destination),
    ("security: direct client of the EPP port", s_epp_port_direct),
    ("security: EPP ports on loopback only", s_epp_ports_loopback),
    ("telemetry: metrics cardinality and label length", s_metrics_cardinality),
    ("connections: a silent connection is closed", s_silent_connection),
    ("connections: 500 idle + 10 slow-body, a client still served", s_idle_flood),
    ("connections: per-client-address cap", s_per_client_cap),
    ("upstream: streams cut by the server are never a clean end", s_cut_streams),
    ("upstream: a client disconnect reaches the server", s_client_disconnect),
    ("config: a deleted models file is a bad edit", s_deleted_models_file),
    ("epp: a hung EPP gets a bounded answer", s_hung_epp),
    ("lifecycle: SIGTERM under 10 keep-alive streaming clients", s_drain),
]


def _write_config(directory: Path, ports: list[int], sims: list[int], cutter: int) -> None:
    http, ext_proc, metrics, health, admin = ports
    endpoints = "".join(
        f"    - {{name: sim-{i}, address: 127.0.0.1, port: {p}, labels: {{app: sim}}}}\n"
        for i, p in enumerate(sims)
    )
    (directory / "gateway.yaml").write_text(f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: default}}
spec:
  listeners: {{address: 0.0.0.0, http: {http}, extProc: {ext_proc}, metrics: {metrics},
    health: {health}, admin: {admin}}}
  edge: {{eppTimeoutS: {EPP_TIMEOUT_S}, maxConnectionsPerClient: {PER_CLIENT}}}
  scraping: {{intervalMs: 100}}
  endpoints:
{endpoints}    - {{name: cutter, address: 127.0.0.1, port: {cutter}, labels: {{app: cutter}}}}
""")
    (directory / "pools.yaml").write_text("""\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: pool, namespace: default}
spec: {selector: {app: sim}, targetPortNumber: 8000, extensionRef: {name: epp}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: cutpool, namespace: default}
spec: {selector: {app: cutter}, targetPortNumber: 8000, extensionRef: {name: epp}}
""")
    (directory / "models.yaml").write_text(f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: m, namespace: default}}
spec: {{modelName: {MODEL}, poolRef: {{name: pool}}}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: cut, namespace: default}}
spec: {{modelName: cut, poolRef: {{name: cutpool}}}}
""")


async def _canary(hits: list[int]) -> asyncio.Server:
    async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        hits.append(1)
        w.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    hits.insert(0, server.sockets[0].getsockname()[1])  # hits[0]: the canary's port
    return server


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "poolkeeper", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="run only scenarios whose name contains this")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="probe-sweep-"))
    (config := tmp / "config").mkdir()
    sim_a, sim_b, cutter, *ports = free_ports(8)
    _write_config(config, ports, [sim_a, sim_b], cutter)
    (tmp / "cut.yaml").write_text("defaults:\n  faults: {cut_rate: 1.0, cut_after: 3}\n")
    procs = [
        _start(
            [
                "sim",
                "--count",
                "2",
                "--port",
                str(sim_a),
                "--model",
                MODEL,
                "--time-scale",
                "0.01",
                "--fault-headers",
            ],
            tmp / "sim.log",
        ),
        _start(
            [
                "sim",
                "--count",
                "1",
                "--port",
                str(cutter),
                "--model",
                "cut",
                "--time-scale",
                "0.01",
                "--config",
                str(tmp / "cut.yaml"),
            ],
            tmp / "cutter.log",
        ),
    ]
    if sim_b != sim_a + 1:  # `sim --count 2` takes consecutive ports
        _write_config(config, ports, [sim_a, sim_a + 1], cutter)
        sim_b = sim_a + 1
    await asyncio.sleep(1.5)
    serve = _start(
        ["serve", "-f", str(config), "--workdir", str(tmp / "envoy"), "--log-level", "warning"],
        tmp / "serve.log",
    )
    hits: list[int] = []
    canary = await _canary(hits)
    http, ext_proc, metrics, health = ports[:4]
    g = Gateway(http, ext_proc, metrics, health, [sim_a, sim_b], config, serve, hits)
    passed = failed = 0
    try:
        for _ in range(120):
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                if status(await raw(g.http, post(CHAT), wait_s=2)) == 200:
                    break
            await asyncio.sleep(0.5)
        else:
            print(f"the gateway never served: see {tmp}/serve.log")
            return 2
        for name, scenario in SCENARIOS:
            if args.k not in name:
                continue
            start = time.monotonic()
            try:
                ok, seen = await asyncio.wait_for(scenario(g), 90)
            except Exception as error:  # a probe that crashed is a failed scenario
                ok, seen = False, f"probe error: {type(error).__name__}: {error}"
            passed += ok
            failed += not ok
            mark = "PASS" if ok else "FAIL"
            print(f"{mark}  {name:<60} {time.monotonic() - start:5.1f}s  {seen}", flush=True)
        print(f"\n{passed} of {passed + failed} passed (logs: {tmp})")
        return 0 if failed == 0 else 1
    finally:
        canary.close()
        for proc in [serve, *procs]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in [serve, *procs]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
