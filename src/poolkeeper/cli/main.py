"""Entry point of the `poolkeeper` command: builds the argparse tree from the command modules.

Each module in COMMAND_MODULES exposes `register(subparsers)`, which adds its subcommands and
sets `handler` (a callable taking the parsed namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import cast

from poolkeeper import __version__

COMMAND_MODULES: tuple[str, ...] = (
    "poolkeeper.cli.resources",  # validate, status, crds
    "poolkeeper.cli.sim",  # sim
    "poolkeeper.cli.serve",  # serve, envoy-config
    "poolkeeper.cli.bbr",  # bbr, bbr-envoy-config
    "poolkeeper.cli.quickstart",  # quickstart
    "poolkeeper.cli.bench",  # bench
    "poolkeeper.cli.manifests",  # manifests
    "poolkeeper.cli.epp",  # epp (llm-d-router's EPP command line; parsed by cli/epp.py)
)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poolkeeper",
        description="Inference gateway for pools of LLM model servers.",
    )
    parser.add_argument("--version", action="version", version=f"poolkeeper {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["epp"]:  # upstream's pflag syntax, which argparse cannot parse
        from poolkeeper.cli.epp import main as epp_main

        return epp_main(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = cast(Handler | None, getattr(args, "handler", None))
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
