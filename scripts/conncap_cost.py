"""What the per-client-address connection cap costs a request, side by side (loopback only).

Two `poolkeeper serve` over one simulator, the same configuration but for
`edge.maxConnectionsPerClient` (0: off; the default 1,024: on), measured in alternating rounds:
sequential requests on one keep-alive connection (the cap's check ran once, for the
connection's first request) and sequential requests each on a new connection (every request
pays the check, and every close a log entry). Prints the median and p90 latency per variant.

    .venv/bin/python scripts/conncap_cost.py [--rounds 4] [--keepalive 300] [--fresh 150]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from poolkeeper.bench.live import live_processes as procs
from poolkeeper.bench.overhead.overhead_gateway import MODEL, write_config
from poolkeeper.netutil import free_ports

BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n%b\r\n%b"
)


async def _one(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], close: bool) -> int:
    reader, writer = conn
    writer.write(REQUEST % (len(BODY), b"connection: close\r\n" if close else b"", BODY))
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def keepalive(port: int, n: int) -> list[float]:
    conn = await asyncio.open_connection("127.0.0.1", port)
    out = []
    for _ in range(n):
        start = time.perf_counter()
        assert await _one(conn, close=False) == 200
        out.append(time.perf_counter() - start)
    conn[1].close()
    return out


async def fresh(port: int, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        conn = await asyncio.open_connection("127.0.0.1", port)
        assert await _one(conn, close=True) == 200
        out.append(time.perf_counter() - start)
        conn[1].close()
    return out


async def _ready(port: int, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            conn = await asyncio.open_connection("127.0.0.1", port)
            if await _one(conn, close=True) == 200:
                conn[1].close()
                return
        except (OSError, asyncio.IncompleteReadError, ValueError, StopIteration):
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"gateway on {port} never answered 200")


def _start(stack: contextlib.ExitStack, args: list[str], log: Path) -> None:
    """`poolkeeper ARGS` for as long as `stack` (`procs.process`: its own session, stopped)."""
    stack.enter_context(procs.process([sys.executable, "-m", "poolkeeper", *args], log))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--keepalive", type=int, default=300, help="requests per round")
    parser.add_argument("--fresh", type=int, default=150, help="requests per round")
    parser.add_argument("--cap", type=int, default=1024, help="the 'on' variant's cap")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="conncap-cost-"))
    sim_port, *ports = free_ports(11)
    variants = {"off": (0, ports[:5]), "on": (args.cap, ports[5:])}
    with contextlib.ExitStack() as stack:
        sim = ["sim", "--count", "1", "--port", str(sim_port), "--model", MODEL,
               "--time-scale", "0.001"]  # fmt: skip
        _start(stack, sim, tmp / "sim.log")
        for name, (cap, vports) in variants.items():
            (tmp / name).mkdir(parents=True)
            write_config(tmp / name, sim_port, vports, max_connections_per_client=cap)
            serve = ["serve", "-f", str(tmp / name), "--workdir", str(tmp / f"{name}-envoy")]
            _start(stack, [*serve, "--log-level", "warning"], tmp / f"{name}.log")
        for _cap, vports in variants.values():
            await _ready(vports[0])
        results: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            order = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
            for name in order:
                port = variants[name][1][0]
                results.setdefault((name, "keep-alive"), []).extend(
                    await keepalive(port, args.keepalive)
                )
                results.setdefault((name, "new connection"), []).extend(
                    await fresh(port, args.fresh)
                )
        print(f"{'variant':<8} {'request':<15} {'n':>6} {'median ms':>10} {'p90 ms':>8}")
        for (name, kind), values in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            p90 = statistics.quantiles(values, n=10)[-1]
            print(
                f"{name:<8} {kind:<15} {len(values):>6} "
                f"{statistics.median(values) * 1e3:>10.3f} {p90 * 1e3:>8.3f}"
            )


if __name__ == "__main__":
    asyncio.run(main())
