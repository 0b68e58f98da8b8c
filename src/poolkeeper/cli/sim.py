"""`poolkeeper sim`: serve simulated vLLM model servers on consecutive local ports.

    poolkeeper sim --count 4 --port 8000 --lora-adapters sql-lora,chat-lora --max-loras 2
    poolkeeper sim --config fleet.yaml --time-scale 0.1

Prints one line per server (name and URL), serves until Ctrl-C or SIGTERM, then stops cleanly
with exit code 0. Engine flags mean what vLLM's flags of the same name mean; see
docs/simulator.md for the model and its calibration.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from poolkeeper.errors import ConfigError
from poolkeeper.server.signals import on_stop_signals
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet, load_fleet_file
from poolkeeper.sim.params import DEFAULT_MODEL


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="serve simulated vLLM model servers (no GPU needed)",
        description="Serve N simulated vLLM-compatible model servers on ports P..P+N-1.",
    )
    parser.add_argument("--count", type=int, default=None, help="number of servers (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="first port (default 8000)")
    parser.add_argument(
        "--kv-events-port-offset",
        type=int,
        default=None,
        help="publish each server's KV-cache events as vLLM does (msgpack over ZMQ PUB) on "
        "its HTTP port plus this offset (needs the kv-events extra)",
    )
    parser.add_argument("--model", default=None, help=f"served model name ({DEFAULT_MODEL})")
    parser.add_argument(
        "--lora-adapters", default=None, help="comma-separated adapters the servers can load"
    )
    parser.add_argument("--max-loras", type=int, default=None, help="adapter GPU slots (1)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="running slots (256)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per step (8192)"
    )
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (28000)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per block (16)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="multiplies every modelled duration: 0.1 = 10x faster, 2 = 2x slower (1)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (0)")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="tokens per streamed event after the first, as vLLM's --stream-interval (1)",
    )
    parser.add_argument("--config", default=None, help="YAML file with per-server settings")
    parser.add_argument(
        "--fault-headers",
        action="store_true",
        help="obey the x-sim-fault request header (fault injection by the client; off by "
        "default, so a client cannot make the server fail)",
    )
    parser.set_defaults(handler=run_sim)


def _cli_settings(args: argparse.Namespace) -> ServerSettings:
    values: dict[str, Any] = {
        "model": args.model,
        "max_loras": args.max_loras,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_gpu_blocks": args.num_gpu_blocks,
        "block_size": args.block_size,
        "time_scale": args.time_scale,
        "seed": args.seed,
        "stream_interval": args.stream_interval,
    }
    if args.lora_adapters is not None:
        values["lora_adapters"] = [a.strip() for a in args.lora_adapters.split(",") if a.strip()]
    if getattr(args, "fault_headers", False):
        values["faults"] = {"header_faults": True}
    return ServerSettings.model_validate({k: v for k, v in values.items() if v is not None})


def run_sim(args: argparse.Namespace) -> int:
    try:
        if args.count is not None and args.count < 1:
            raise ConfigError("--count must be at least 1")
        if not 0 <= args.port <= 65535:
            raise ConfigError("--port must be 0..65535")
        try:
            cli = _cli_settings(args)
        except ValueError as exc:
            raise ConfigError(f"bad command-line value: {exc}") from None
        file = load_fleet_file(args.config) if args.config else None
        specs = build_fleet(count=args.count, cli=cli, file=file)
        if args.port and args.port + len(specs) - 1 > 65535:
            raise ConfigError(f"ports {args.port}..{args.port + len(specs) - 1} exceed 65535")
    except ConfigError as exc:
        print(f"poolkeeper sim: {exc.message}", file=sys.stderr)
        return 2
    try:
        cluster = SimCluster(
            specs,
            host=args.host,
            base_port=args.port,
            kv_events_port_offset=args.kv_events_port_offset,
        )
        return asyncio.run(_serve(cluster))
    except OSError as exc:
        print(f"poolkeeper sim: cannot listen: {exc}", file=sys.stderr)
        return 1


async def _serve(cluster: SimCluster) -> int:
    stop = asyncio.Event()
    on_stop_signals(asyncio.get_running_loop(), stop.set)  # the loop ends with this function
    listening = await cluster.start()
    try:
        for where in listening:
            server = cluster.servers[[s.name for s in cluster.servers].index(where.name)]
            config = server.engine.config
            print(
                f"{where.name} listening on {where.url} model={config.model} "
                f"max_num_seqs={config.max_num_seqs} num_gpu_blocks={config.num_gpu_blocks} "
                f"max_loras={config.max_loras} time_scale={config.time_scale}",
                flush=True,
            )
        print(f"serving {len(listening)} simulated server(s); Ctrl-C to stop", flush=True)
        await stop.wait()
    finally:
        await cluster.stop()
    print("stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `sim` alone (`python -m poolkeeper.cli.sim ...`), without the other commands."""
    parser = argparse.ArgumentParser(prog="poolkeeper")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sim", *(sys.argv[1:] if argv is None else argv)])
    handler = args.handler
    assert callable(handler)
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
