"""Real Envoy + in-process EPP (fake router) + aiohttp backends, for the tests in this folder."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from poolkeeper.envoy.bootstrap import BootstrapParams, build_bootstrap, render
from poolkeeper.envoy.params import EPP_CLUSTER
from poolkeeper.envoy.process import EnvoyOptions, EnvoySupervisor, find_envoy
from poolkeeper.errors import BadRequest, NoReadyEndpoint
from poolkeeper.extproc.accesslog import AccessLogReceiver, DetachedExchanges, FirstByteReceiver
from poolkeeper.extproc.lean import start_lean
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.netutil import free_port
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision, Usage
from poolkeeper.server.transport import health_methods
from poolkeeper.telemetry.health import HealthService


@dataclass
class Backend:
    """A tiny OpenAI-ish server that echoes what it received."""

    name: str
    port: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    # Model "gated": the second streamed event is written only once the test sets this.
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        self.seen.append({"headers": dict(request.headers), "body": body, "path": request.path})
        if body.get("stream"):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            chunk: dict[str, Any]
            if body.get("model") == "cut":  # die mid-stream: an RST after the first event
                await resp.write(b'data: {"choices": [{"delta": {"content": "hel"}}]}\n\n')
                await asyncio.sleep(0.05)
                assert request.transport is not None
                request.transport.abort()
                return resp
            if body.get("model") == "trickle":  # the stream in 3-byte writes, 2 ms apart
                with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                events: list[dict[str, Any]] = [
                    {"choices": [{"index": 0, "delta": {"content": word}}]}
                    | ({"usage": None} if with_usage else {})
                    for word in ("hello", "world", "again")
                ]
                if with_usage:  # vLLM's form: `"usage": null` in every event, then the counts
                    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
                    events.append({"choices": [], "usage": usage})
                raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                raw += b"data: [DONE]\n\n"
                for i in range(0, len(raw), 3):
                    await resp.write(raw[i : i + 3])
                    await asyncio.sleep(0.002)
                await resp.write_eof()
                return resp
            for word in ("hello", "world"):
                chunk = {"choices": [{"index": 0, "delta": {"content": word}}], "usage": None}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if word == "hello" and body.get("model") == "gated":
                    await self.gate.wait()
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
                chunk = {"choices": [], "usage": usage}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        reply = {
            "served_by": self.name,
            "model": body.get("model"),
            "received_bytes": len(raw),
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
        return web.json_response(reply)

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        self.port = int(sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class Canary:
    """A TCP listener that only counts connections: nothing may ever reach it."""

    port: int = 0
    connections: int = 0
    server: asyncio.Server | None = None

    async def start(self) -> None:
        async def on_connect(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            w.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@dataclass
class RoundRobinRouter:
    """Routes every request to the next backend; rewrites `alias` to `real`."""

    backends: list[Backend]
    completed: list[tuple[int, Usage | None, str | None]] = field(default_factory=list)
    turn: int = 0
    moved: list[tuple[str, str]] = field(default_factory=list)
    fixed: tuple[str, ...] | None = None  # when set: this primary + fallbacks list, always
    inject_usage: bool = True  # ask streams for usage the client did not ask for
    first_byte_after: list[float | None] = field(default_factory=list)

    async def route(self, request: IncomingRequest) -> RoutingDecision:
        if not self.backends:
            raise NoReadyEndpoint("no ready endpoint")
        pick = self.backends[self.turn % len(self.backends)]
        self.turn += 1
        hostports = self.fixed or (pick.hostport,)
        if not request.body:
            return RoutingDecision(request.request_id, hostports, "default/pool")
        try:
            obj = json.loads(request.body)
        except ValueError as exc:
            raise BadRequest("not JSON") from exc
        body = None
        injected = False
        if obj.get("model") == "alias":
            obj["model"] = "real"
            body = json.dumps(obj).encode()
        asked = (obj.get("stream_options") or {}).get("include_usage")
        if self.inject_usage and obj.get("stream") and not asked:
            obj["stream_options"] = {"include_usage": True}
            body = json.dumps(obj).encode()
            injected = True
        return RoutingDecision(
            request.request_id,
            hostports,
            "default/pool",
            model_name=str(obj.get("model")),
            stream=bool(obj.get("stream")),
            body=body,
            include_usage_injected=injected,
        )

    def complete(
        self,
        decision: RoutingDecision,
        *,
        status: int,
        usage: Usage | None,
        served_endpoint: str | None = None,
    ) -> None:
        self.completed.append((status, usage, served_endpoint))

    def served(self, decision: RoutingDecision, endpoint: str) -> None:
        self.moved.append((decision.request_id, endpoint))

    def first_byte(self, decision: RoutingDecision, *, after_s: float | None = None) -> None:
        self.first_byte_after.append(after_s)

    def model_names(self) -> list[str]:
        return ["alias"]

    def ready(self) -> bool:
        return True


def rig_params(
    backends: list[Backend], epp_port: int, endpoints_path: Path, *, fail_open: bool, **more: Any
) -> BootstrapParams:
    """The bootstrap of the tests' rigs: the backends are the fallbacks, fresh local ports."""
    return BootstrapParams(
        listen_port=free_port(),
        extproc_port=epp_port,
        admin_port=free_port(),
        fail_open=fail_open,
        fallback_endpoints=tuple(b.hostport for b in backends),
        endpoints_file=str(endpoints_path),
        **more,
    )


@asynccontextmanager
async def supervised_envoy(
    config: Path, admin_port: int, *, restart_initial_s: float = 0.5
) -> AsyncIterator[EnvoySupervisor]:
    """The Envoy binary `serve` finds, supervised, on the bootstrap file `config` (its log
    beside it, `.log`); ready (admin `/ready` LIVE) when entered, stopped on the way out."""
    supervisor = EnvoySupervisor(
        EnvoyOptions(
            binary=find_envoy(),
            config_path=config,
            log_path=config.with_suffix(".log"),
            admin_url=f"http://127.0.0.1:{admin_port}",
            restart_initial_s=restart_initial_s,
        )
    )
    await supervisor.start()
    try:
        await supervisor.wait_ready()
        yield supervisor
    finally:
        await supervisor.stop()


@asynccontextmanager
async def running_envoy(
    params: BootstrapParams, workdir: Path, *, epp_up: bool = True
) -> AsyncIterator[EnvoySupervisor]:
    """Envoy for `params`, ready; with `epp_up` (an EPP answers health checks) also until it
    counts the EPP healthy: `/ready` can come before the first health check passed on a loaded
    machine, and a FailClose pool answers 503 until then (`serve` waits the same way)."""
    config = workdir / f"envoy-{params.listen_port}.json"
    config.write_text(render(build_bootstrap(params)))
    async with supervised_envoy(config, params.admin_port, restart_initial_s=0.2) as supervisor:
        if epp_up and params.epp_health_interval_s > 0:
            assert await supervisor.wait_healthy(EPP_CLUSTER), supervisor.log_tail()
        yield supervisor


@dataclass
class Epp:
    """The EPP's ext_proc server of a rig, on either transport."""

    server: Any  # grpc.aio.Server or LeanServer: both have stop(grace)
    port: int

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)


async def start_epp(
    transport: str,
    servicer: ExtProcServicer,
    port: int,
    *,
    detached: DetachedExchanges | None = None,
) -> Epp:
    """`servicer` (with the response observer's receivers for `detached`, and gRPC health)
    served on 127.0.0.1:`port` by `transport`: the ext_proc tests run on both."""
    health = HealthService.for_gateway(live=lambda: True, ready=lambda: True)
    if transport == "lean":
        lean = await start_lean(
            servicer, "127.0.0.1", port, detached=detached, more=health_methods(health)
        )
        return Epp(lean, lean.port)

    def register(server: grpc.aio.Server) -> None:
        health.register(server)
        if detached is not None:
            AccessLogReceiver(detached).register(server)
            FirstByteReceiver(detached).register(server)

    server, bound = build_server(servicer, f"127.0.0.1:{port}", extra=register)
    await server.start()
    return Epp(server, bound)
