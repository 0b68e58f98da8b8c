"""The floor under poolkeeper's added latency, measured beside it (`bench overhead --floor`).

Two gateways that do strictly less than poolkeeper does, on the same Envoy binary, in front of
the same simulator:

- `envoy`: Envoy proxying straight to the simulator, no filter but the router: what every
  Envoy-based gateway pays before any endpoint picker.
- `envoy+ext_proc`: the same Envoy with one ext_proc filter set as poolkeeper's is for requests
  (request headers sent, request body FULL_DUPLEX_STREAMED, nothing of the response), in front
  of a minimal Python ExternalProcessor on grpc.aio (uvloop, as `serve`): no parsing, no model
  lookup, no scheduling; it answers the headers with one route header once the body has ended,
  and passes the body back as it came. The only route needs that header (otherwise Envoy
  answers 503), so every 200 through it shows the processor was asked.
- `envoy+ext_proc (lean)`: the same again, the processor served by the lean transport
  (extproc/h2/) instead of grpc.aio: what the transport alone costs or saves.

What poolkeeper adds above `envoy+ext_proc` is its own work (Director, scheduler, metadata,
access log); what `envoy+ext_proc` adds above `envoy` is the price of a Python gRPC stream,
which no amount of EPP tuning removes. The processor runs as its own process
(`python -m poolkeeper.bench.overhead.overhead_floor --port N`) so that its CPU per request can
be read like the EPP's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)

from poolkeeper.bench.live import live_processes as procs
from poolkeeper.envoy.params import (
    EXT_PROC_TYPE,
    HCM,
    HTTP_OPTS_TYPE,
    ROUTER_TYPE,
    T,
    lb_endpoints,
    socket_address,
)
from poolkeeper.envoy.process import find_envoy
from poolkeeper.extproc import messages as msg
from poolkeeper.extproc.h2.rpc import bidi
from poolkeeper.extproc.h2.server import LeanServer
from poolkeeper.extproc.heap import keep_freed_pages
from poolkeeper.extproc.lean import PROCESS_PATH
from poolkeeper.netutil import free_ports

ENVOY = "envoy"
EXT_PROC = "envoy+ext_proc"
EXT_PROC_LEAN = "envoy+ext_proc (lean)"  # the same processor on the lean transport (extproc/h2)
ROUTED_HEADER = "x-floor-routed"  # set by the minimal processor; the route requires it
PROCESSOR_MODULE = "poolkeeper.bench.overhead.overhead_floor"  # run as its own process


def _cluster(name: str, port: int, *, h2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": lb_endpoints([f"127.0.0.1:{port}"])}],
        },
    }
    if h2:  # gRPC
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                T: HTTP_OPTS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def bootstrap(
    listen: int,
    admin: int,
    upstream: int,
    ext_proc: int | None,
    access_log: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A one-listener Envoy in front of `upstream`; with `ext_proc`, the processor on that port
    must route each request (see the module docstring). `access_log`: one access logger's
    config (a measuring script's timing log), else none."""
    filters: list[dict[str, Any]] = []
    route: dict[str, Any] = {"prefix": "/"}
    routes: list[dict[str, Any]] = [{"match": route, "route": {"cluster": "upstream",
                                                               "timeout": "0s"}}]  # fmt: skip
    clusters = [_cluster("upstream", upstream)]
    if ext_proc is not None:
        route["headers"] = [{"name": ROUTED_HEADER, "present_match": True}]
        routes.append({"match": {"prefix": "/"}, "direct_response": {"status": 503}})
        filters.append({
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                T: EXT_PROC_TYPE,
                "grpc_service": {"envoy_grpc": {"cluster_name": "processor"}},
                "failure_mode_allow": False,
                "message_timeout": "5s",
                "processing_mode": {
                    "request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND", "response_header_mode": "SKIP",
                    "response_body_mode": "NONE", "response_trailer_mode": "SKIP",
                },
            },
        })  # fmt: skip
        clusters.append(_cluster("processor", ext_proc, h2=True))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {T: ROUTER_TYPE}})
    manager = {
        T: HCM,
        "stat_prefix": "floor",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": filters,
    }
    if access_log is not None:
        manager["access_log"] = [access_log]
    return {
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [{
                "name": "floor",
                "address": socket_address("127.0.0.1", listen),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": manager,
                }]}],
            }],
            "clusters": clusters,
        },
    }  # fmt: skip


class MinimalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Routes every request to the one upstream: the least an ext_proc EPP can do."""

    def __init__(self) -> None:
        self.route = msg.header_mutation({ROUTED_HEADER: "1"})
        self.streams = 0

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext | None = None,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        self.streams += 1
        body = bytearray()
        async for request in request_iterator:
            kind = request.WhichOneof("request")
            ended = (kind == "request_headers" and request.request_headers.end_of_stream) or (
                kind == "request_body" and request.request_body.end_of_stream
            )
            if kind == "request_body":
                body += request.request_body.body
            if ended or kind == "request_trailers":
                yield msg.request_headers_reply(self.route, clear_route_cache=True)
                if kind != "request_headers":
                    for reply in msg.streamed_body_replies(
                        bytes(body), end_of_stream=kind == "request_body"
                    ):
                        yield reply
                if kind == "request_trailers":
                    yield msg.trailers_reply(response=False)
                return


async def serve_processor(port: int, transport: str = "grpcio") -> None:
    """Run the minimal processor on 127.0.0.1:`port` until cancelled, on grpc.aio or on the
    lean transport (`listeners.extProcTransport`'s two choices)."""
    processor = MinimalProcessor()
    if transport == "lean":
        lean = LeanServer({
            PROCESS_PATH: bidi(processor.Process, pb.ProcessingRequest.FromString,
                               pb.ProcessingResponse.SerializeToString),
        })  # fmt: skip
        await lean.listen("127.0.0.1", port)
        try:
            await asyncio.Event().wait()
        finally:
            await lean.stop(0)
        return
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"cannot bind the minimal ext_proc processor to 127.0.0.1:{port}")
    await server.start()
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(0)


@contextlib.contextmanager
def floor_gateways(
    work: Path,
    upstream: int,
    cpu_seconds: Callable[[int], float],
    access_log: Callable[[str], dict[str, Any]] | None = None,
) -> Iterator[dict[str, tuple[str, dict[str, Callable[[], float]]]]]:
    """Start both floor gateways in front of 127.0.0.1:`upstream`; yields name -> (chat
    completions URL, CPU clocks to read in a closed loop) and stops them on exit.
    `access_log(slug)`: an access logger for the gateway named `slug`, else none."""
    listen, admin, listen2, admin2, processor, listen3, admin3, lean = free_ports(8)
    envoy = find_envoy()
    out: dict[str, tuple[str, dict[str, Callable[[], float]]]] = {}
    with contextlib.ExitStack() as stack:
        pids: dict[int, int] = {}
        for port, transport in ((processor, "grpcio"), (lean, "lean")):
            pids[port] = stack.enter_context(procs.process(
                [sys.executable, "-m", PROCESSOR_MODULE, "--port", str(port),
                 "--transport", transport],
                work / f"floor-processor-{transport}.log",
            )).pid  # fmt: skip
        for name, port, admin_port, ext in (
            (ENVOY, listen, admin, None),
            (EXT_PROC, listen2, admin2, processor),
            (EXT_PROC_LEAN, listen3, admin3, lean),
        ):
            slug = name.replace("+", "-").replace(" (", "-").rstrip(")")
            config = work / f"floor-{slug}.json"
            logger = access_log(slug) if access_log is not None else None
            config.write_text(json.dumps(bootstrap(port, admin_port, upstream, ext, logger)))
            cmd = [envoy, "-c", str(config), "--concurrency", "1", "--log-level", "warning",
                   "--disable-hot-restart"]  # fmt: skip
            envoy_proc = stack.enter_context(procs.process(cmd, config.with_suffix(".log")))
            procs.wait_http(f"http://127.0.0.1:{admin_port}/ready", lambda s: s == 200, 30, name)
            clocks: dict[str, Callable[[], float]] = {
                "envoy": functools.partial(cpu_seconds, envoy_proc.pid)
            }
            if ext is not None:
                clocks["ext_proc"] = functools.partial(cpu_seconds, pids[ext])
            out[name] = (f"http://127.0.0.1:{port}/v1/chat/completions", clocks)
        yield out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the minimal ext_proc processor of --floor")
    parser.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    parser.add_argument("--transport", choices=["grpcio", "lean"], default="grpcio")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error("--port must be in 1..65535")
    keep_freed_pages()  # as `serve` does (extproc/heap.py): the same allocator as the EPP's
    try:
        import uvloop  # as `serve` (cli/serve.py: loop_factory); asyncio where it is missing

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve_processor(args.port, args.transport))
    return 0


if __name__ == "__main__":
    sys.exit(main())
