"""`poolkeeper serve` (run the gateway: EPP + supervised Envoy) and `poolkeeper envoy-config`.

poolkeeper serve -f examples/                  # EPP + Envoy on listeners.http
poolkeeper serve -f pool.yaml --no-envoy       # EPP only, for your own Envoy / Gateway
poolkeeper envoy-config -f examples/ > envoy.json && envoy -c envoy.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from poolkeeper.controller.files import FileResourceSource, file_source
from poolkeeper.datastore.store import Datastore
from poolkeeper.envoy.bootstrap import build_bootstrap, render
from poolkeeper.errors import ConfigError
from poolkeeper.server.runtime import (
    GatewayRuntime,
    ServeOptions,
    bootstrap_params,
    serve_until_signalled,
)
from poolkeeper.telemetry.logs import configure_logging


def _add_files(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f",
        "--filename",
        dest="paths",
        action="extend",
        nargs="+",
        required=True,
        metavar="PATH",
        help="YAML/JSON files or directories with InferencePools, InferenceModels and an "
        "optional GatewayConfig",
    )


def register(subparsers: Any) -> None:
    serve: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run the gateway: the endpoint picker and a supervised Envoy",
        description="Load pools, models and the GatewayConfig, start the endpoint picker "
        "(ext_proc, health, metrics) and Envoy in front of it. Ctrl-C drains and stops.",
    )
    _add_files(serve)
    serve.add_argument("--envoy-path", default=None, help="Envoy binary to run")
    serve.add_argument(
        "--no-envoy", action="store_true", help="run only the endpoint picker (own Envoy)"
    )
    serve.add_argument(
        "--workdir", type=Path, default=None, help="where the bootstrap and Envoy log go"
    )
    serve.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy worker threads")
    serve.add_argument("--drain-grace", type=float, default=5.0, help="seconds to drain (5)")
    serve.add_argument("--log-level", default="info", help="debug, info, warning, error")
    serve.add_argument(
        "--log-format", choices=("json", "text"), default="json", help="log line format"
    )
    serve.set_defaults(handler=run_serve)

    cfg: argparse.ArgumentParser = subparsers.add_parser(
        "envoy-config",
        help="print the Envoy bootstrap `serve` would run",
        description="Print the Envoy bootstrap (JSON, also valid YAML) for running your own "
        "Envoy in front of `poolkeeper serve --no-envoy`.",
    )
    _add_files(cfg)
    cfg.add_argument("-o", "--output", type=Path, default=None, help="write to a file")
    cfg.set_defaults(handler=run_envoy_config)


def _check_workdir(workdir: Path | None, paths: list[str]) -> None:
    """Hot reload would read the bootstrap written there as a (bad) resource file."""
    for path in paths:
        if workdir is not None and workdir.resolve().is_relative_to(Path(path).resolve()):
            raise ConfigError(f"workdir {workdir} must not be inside the watched path {path}")


def run_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, json_lines=args.log_format == "json")
    options = ServeOptions(
        source=file_source(args.paths),
        run_envoy=not args.no_envoy,
        envoy_path=args.envoy_path,
        workdir=args.workdir,
        envoy_concurrency=args.envoy_concurrency,
        drain_grace_s=args.drain_grace,
    )
    runtime = GatewayRuntime(options)

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(serve_until_signalled(runtime, started))
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if started.is_set() and options.run_envoy:
            print(f"poolkeeper gateway ready on {runtime.http_url}", file=sys.stderr, flush=True)
        elif started.is_set():
            print(f"poolkeeper endpoint picker ready ({runtime.extproc_address})", file=sys.stderr)
        waiter.cancel()
        await task

    try:
        _check_workdir(args.workdir, args.paths)
        asyncio.run(main())
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def run_envoy_config(args: argparse.Namespace) -> int:
    try:
        datastore = Datastore()
        config = asyncio.run(FileResourceSource(args.paths, datastore).start())
        text = render(build_bootstrap(bootstrap_params(config, datastore.snapshot())))
    except (ConfigError, ValueError) as exc:
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    if args.output is not None:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0
