"""`poolkeeper bbr` (the body-based routing ext_proc service) and `poolkeeper bbr-envoy-config`
(an Envoy bootstrap with BBR first, then per-pool Endpoint Pickers).

poolkeeper bbr --port 9004                                  # BBR ext_proc + gRPC health
poolkeeper bbr-envoy-config -f examples/ > envoy-bbr.json   # every pool via poolkeeper's EPP
poolkeeper bbr-envoy-config -f pools/ --epp default/phi-pool=10.0.0.9:9002  # a pool's own EPP

Opt-in, for a BBR Envoy on the same host: `poolkeeper bbr --max-connections-per-client N`
(bound to loopback) counts connections per client address for the Envoy of
`bbr-envoy-config --count-connections`: the listener asks it on each connection's first bytes
and reports each close, on the BBR cluster (extproc/conncap.py), and the kernel's list of the
listener's connections settles lost closes and late checks; the connection over the cap is
closed, a warning logged, and `poolkeeper_client_connections_refused_total` counts it
(`--metrics-port`). Loopback only: the counter takes no token and reads this host's kernel.

Routes come from the resource files: each model name the datastore's model index serves
(InferenceModel modelName, InferenceModelRewrite exact match) is routed to its pool; the pool's
EPP is poolkeeper's own (`listeners.extProc`) unless `--epp` names another one.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.files import FileResourceSource
from poolkeeper.datastore.snapshot import DatastoreSnapshot
from poolkeeper.datastore.store import Datastore
from poolkeeper.envoy.bbr import BbrParams, PoolRoute, build_bbr_bootstrap, render
from poolkeeper.envoy.params import CLIENT_MAX_HEADER_KB, CLIENT_MAX_HEADERS, BootstrapParams
from poolkeeper.errors import ConfigError
from poolkeeper.extproc.bbr import BbrServicer
from poolkeeper.extproc.conncap import ConnectionCounter
from poolkeeper.extproc.conncap_service import add_conncap_service
from poolkeeper.extproc.heap import keep_freed_pages
from poolkeeper.extproc.server import build_server
from poolkeeper.server.envoy_bootstrap import bootstrap_params
from poolkeeper.telemetry.epp_collectors import client_connections_app
from poolkeeper.telemetry.health import HealthService
from poolkeeper.telemetry.logs import configure_logging

BBR_PORT = 9004  # upstream's BBR chart serves ext_proc on 9004


def register(subparsers: Any) -> None:
    bbr: argparse.ArgumentParser = subparsers.add_parser(
        "bbr",
        help="run the body-based routing ext_proc service (model -> x-gateway-model-name)",
        description="Serve upstream's body-based routing: copy the request body's `model` into "
        "the x-gateway-model-name header so routes can pick the InferencePool.",
    )
    bbr.add_argument("--address", default="127.0.0.1", help="bind address (127.0.0.1)")
    bbr.add_argument("--port", type=int, default=BBR_PORT, help=f"ext_proc port ({BBR_PORT})")
    bbr.add_argument("--max-body-bytes", type=int, default=16 << 20, help="413 above this")
    bbr.add_argument(
        "--max-connections-per-client",
        type=int,
        default=0,
        metavar="N",
        help="connections one client address may hold on the listener of a BBR Envoy on this "
        "host (`bbr-envoy-config --count-connections`); more are closed on their first bytes. "
        "Needs --address on loopback (the counter takes no token). 0: no cap (0)",
    )
    bbr.add_argument(
        "--envoy-port",
        type=int,
        default=0,
        metavar="PORT",
        help="the BBR Envoy's public listener port, whose connections settle the cap's counts "
        "(0: learnt from the first check)",
    )
    bbr.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve /metrics (the connection cap's counts; needs the cap) on this port (0: none)",
    )
    bbr.add_argument("--log-level", default="info", help="debug, info, warning, error")
    bbr.set_defaults(handler=run_bbr)

    cfg: argparse.ArgumentParser = subparsers.add_parser(
        "bbr-envoy-config",
        help="print an Envoy bootstrap with BBR in front of per-pool endpoint pickers",
        description="Print an Envoy bootstrap (JSON) that runs BBR first and routes each model "
        "to its InferencePool's endpoint picker and model servers.",
    )
    cfg.add_argument(
        "-f",
        "--filename",
        dest="paths",
        action="extend",
        nargs="+",
        required=True,
        metavar="PATH",
        help="YAML/JSON files or directories with pools, models and a GatewayConfig",
    )
    cfg.add_argument("--bbr", default=f"127.0.0.1:{BBR_PORT}", help="host:port of `poolkeeper bbr`")
    cfg.add_argument(
        "--epp",
        action="append",
        default=[],
        metavar="POOL=HOST:PORT",
        help="a pool's own endpoint picker (pool as namespace/name); default poolkeeper's",
    )
    cfg.add_argument(
        "--count-connections",
        action="store_true",
        help="cap connections per client address: the listener asks `poolkeeper bbr "
        "--max-connections-per-client N` (on this host) on each connection (fails open)",
    )
    cfg.add_argument("-o", "--output", type=Path, default=None, help="write to a file")
    cfg.set_defaults(handler=run_bbr_envoy_config)


def _hostport(value: str, what: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    return value


def bbr_params(
    config: GatewayConfig,
    snapshot: DatastoreSnapshot,
    *,
    bbr: str,
    epps: dict[str, str],
    count_connections: bool = False,
) -> BbrParams:
    """BBR bootstrap inputs: one route per served model name, to its pool's EPP."""
    base = bootstrap_params(config, snapshot)
    unknown = sorted(set(epps) - set(snapshot.pool_keys()))
    if unknown:
        raise ConfigError(f"--epp names pools that are not loaded: {', '.join(unknown)}")
    own = f"{base.extproc_address}:{base.extproc_port}"
    index = snapshot.model_index
    routes = []
    for pool_key in snapshot.pool_keys():
        models = tuple(n for n in index.names() if index.by_name[n].pool_key == pool_key)
        endpoints = tuple(e.hostport for e in snapshot.endpoints(pool_key))
        routes.append(PoolRoute(pool_key, models, epps.get(pool_key, own), endpoints))
    if not routes:
        raise ConfigError("no InferencePool is loaded")
    return BbrParams(base, bbr, tuple(routes), client_cap=count_connections)


def run_bbr_envoy_config(args: argparse.Namespace) -> int:
    try:
        epps: dict[str, str] = {}
        for entry in args.epp:
            pool, sep, hostport = entry.partition("=")
            if not sep:
                raise ConfigError(f"--epp: expected POOL=HOST:PORT, got {entry!r}")
            epps[pool if "/" in pool else f"default/{pool}"] = _hostport(hostport, "--epp")
        datastore = Datastore()
        config = asyncio.run(FileResourceSource(args.paths, datastore).start())
        params = bbr_params(
            config,
            datastore.snapshot(),
            bbr=_hostport(args.bbr, "--bbr"),
            epps=epps,
            count_connections=args.count_connections,
        )
        text = render(build_bbr_bootstrap(params))
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.output is not None:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


def _cap_error(args: argparse.Namespace) -> str | None:
    """Why the connection-cap options cannot run as given, or None."""
    limit = args.max_connections_per_client
    if limit < 0:
        return f"--max-connections-per-client must be >= 0, got {limit}"
    if limit and not _loopback(args.address):
        # Its service takes no token (serve's has the run's: a forged check would count) and
        # reads this host's kernel for closes it missed, so its Envoy must be on this host.
        return (
            "--max-connections-per-client needs --address on loopback (the BBR Envoy on this "
            "host): its counter takes no token and reads this host's connections; got "
            f"{args.address}"
        )
    if not 0 <= args.envoy_port < 65536:
        return f"--envoy-port must be a port (0-65535), got {args.envoy_port}"
    if args.metrics_port and not limit:
        return "--metrics-port serves the connection cap's counts: set --max-connections-per-client"
    return None


def run_bbr(args: argparse.Namespace) -> int:
    if (problem := _cap_error(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logs = configure_logging(args.log_level, json_lines=True, queued=True)
    keep_freed_pages()  # large bodies without a page fault per 4 KiB (extproc/heap.py)

    async def main() -> None:
        health = HealthService.for_gateway(live=lambda: True, ready=lambda: True)
        limit = args.max_connections_per_client
        counter = ConnectionCounter(limit) if limit > 0 else None

        def extra(server: grpc.aio.Server) -> None:
            health.register(server)
            if counter is not None:  # what the BBR Envoy's listener asks (envoy/conncap.py)
                # The listener's port: given, or learnt from the first check (Envoy is on
                # this host).
                add_conncap_service(
                    server,
                    counter,
                    BootstrapParams().conncap_timeout_s,
                    listen_port=args.envoy_port,
                    learn_listen_port=not args.envoy_port,
                )

        server, port = build_server(
            BbrServicer(
                max_body_bytes=args.max_body_bytes,
                # The limits `bbr-envoy-config`'s listener leaves room above (envoy/params.py).
                client_header_limits=(CLIENT_MAX_HEADERS, CLIENT_MAX_HEADER_KB),
            ),
            f"{args.address}:{args.port}",
            extra=extra,
        )
        await server.start()
        runner = None
        if args.metrics_port and counter is not None:
            runner = web.AppRunner(client_connections_app(counter.exported), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, args.address, args.metrics_port).start()
        print(f"poolkeeper bbr ready on {args.address}:{port}", file=sys.stderr, flush=True)
        try:
            await server.wait_for_termination()
        finally:
            if runner is not None:
                await runner.cleanup()

    try:
        asyncio.run(main())
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if logs is not None:
            logs.close()
    return 0
