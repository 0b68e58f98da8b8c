"""Whether the per-client-address connection cap holds on a loaded gateway (loopback only).

`poolkeeper serve` (the cap at `--cap`) over one simulator, `--clients` streaming clients
back to back, each on a keep-alive connection from an address of its own (127.0.1.x), so
the EPP is busy. Meanwhile a prober on 127.0.0.2 holds `--cap` keep-alive connections (a
request on each every 2 s, so none idles out) and every `--every` seconds opens one more and
sends a request: refused (closed unanswered) is the cap holding; answered is an over-cap
connection let in, which happens when Envoy's 250 ms check times out (it fails open).

With `--before-src DIR` (the `src` of another checkout, e.g. `git archive 0d329ba src`) a
second `serve` runs that code, and the two are measured in alternating rounds (A B, B A, ...).
Prints per variant: probes, over-cap connections let in, the time to a probe's refusal
(median, p95), Envoy's check time (its histogram of answered checks: P50, P95), and checks
that failed open (`ext_authz.client_cap.failure_mode_allowed`) of all checks.

    .venv/bin/python scripts/conncap_load.py [--before-src /tmp/before/src] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from poolkeeper.bench.live import live_processes as procs
from poolkeeper.bench.overhead.overhead_gateway import MODEL, write_config
from poolkeeper.netutil import free_ports

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _request(stream: bool, max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello there, how are you"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )


STREAM = _request(True, 64)
SHORT = _request(False, 1)


async def _answer(reader: asyncio.StreamReader) -> int:
    """Read one whole answer (content-length or chunked); its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in lines[1:])}
    if b"content-length" in headers:
        await reader.readexactly(int(headers[b"content-length"]))
    else:  # chunked
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return int(lines[0].split(b" ", 2)[1])


async def _client(port: int, source: str, until: float) -> None:
    conn: Conn | None = None
    while time.monotonic() < until:
        try:
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
            conn[1].write(STREAM)
            await _answer(conn[0])
        except (OSError, asyncio.IncompleteReadError, ValueError):
            if conn is not None:
                conn[1].close()
            conn = None
            await asyncio.sleep(0.05)
    if conn is not None:
        conn[1].close()


class Prober:
    def __init__(self, port: int, cap: int) -> None:
        self.port, self.cap = port, cap
        self.held: list[Conn | None] = [None] * cap
        self.refused_s: list[float] = []  # time from the request sent to the close
        self.let_in = 0
        self.probes = 0

    async def keep(self, index: int, until: float) -> None:
        """One of the `cap` held connections: a request every 2 s, reopened if it closed."""
        while time.monotonic() < until:
            try:
                conn = self.held[index]
                if conn is None:
                    conn = await asyncio.open_connection(
                        "127.0.0.1", self.port, local_addr=("127.0.0.2", 0)
                    )
                    self.held[index] = conn
                conn[1].write(SHORT)
                await _answer(conn[0])
            except (OSError, asyncio.IncompleteReadError, ValueError):
                old = self.held[index]
                if old is not None:
                    old[1].close()
                self.held[index] = None
            await asyncio.sleep(2.0)

    async def probe(self) -> None:
        if any(conn is None for conn in self.held):
            return  # the address is not at its cap now: a probe would rightly get in
        self.probes += 1
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.port, local_addr=("127.0.0.2", 0)
        )
        start = time.perf_counter()
        writer.write(SHORT)
        try:
            await asyncio.wait_for(_answer(reader), 30)
            self.let_in += 1
        except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError):
            self.refused_s.append(time.perf_counter() - start)
        writer.close()


def _stats(admin: int) -> str:
    url = f"http://127.0.0.1:{admin}/stats?filter=client_cap|poolkeeper_conncap"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text: str = resp.read().decode()
    return text


def _counter(text: str, name: str) -> int:
    found = re.search(rf"^{re.escape(name)}: (\d+)$", text, re.M)
    return int(found.group(1)) if found else 0


def _quantiles(text: str) -> str:
    """P50 and P95 (ms) of the conncap cluster's request time, cumulative."""
    name = "cluster.poolkeeper_conncap.upstream_rq_time:"
    line = next((x for x in text.splitlines() if x.startswith(name)), "")
    found = dict(re.findall(r"P(50|95)\([^,]*,([^)]*)\)", line))
    return f"{found.get('50', '?')} / {found.get('95', '?')}"


async def _round(
    port: int, admin: int, cap: int, clients: int, seconds: float, every: float
) -> Prober:
    until = time.monotonic() + seconds
    prober = Prober(port, cap)
    tasks = [asyncio.create_task(_client(port, f"127.0.1.{i + 1}", until)) for i in range(clients)]
    tasks += [asyncio.create_task(prober.keep(i, until)) for i in range(cap)]
    await asyncio.sleep(3.0)  # the load and the held connections settle
    while time.monotonic() < until - 1.0:
        await prober.probe()
        await asyncio.sleep(every)
    await asyncio.gather(*tasks, return_exceptions=True)
    for conn in prober.held:
        if conn is not None:
            conn[1].close()
    return prober


def _start(stack: contextlib.ExitStack, args: list[str], log: Path, pythonpath: str | None) -> None:
    """`poolkeeper ARGS` for as long as `stack` (`procs.process`: its own session, stopped)."""
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    stack.enter_context(procs.process([sys.executable, "-m", "poolkeeper", *args], log, env))


async def _ready(port: int, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(SHORT)
            status = await asyncio.wait_for(_answer(reader), 10)
            writer.close()
            if status == 200:
                return
        await asyncio.sleep(0.5)
    raise SystemExit(f"gateway on {port} never answered 200")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-src", help="src/ of the code to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=25.0, help="per round and variant")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--cap", type=int, default=4)
    parser.add_argument("--every", type=float, default=0.1, help="seconds between probes")
    parser.add_argument("--time-scale", type=float, default=0.5, help="the simulator's")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="conncap-load-"))
    names = ["after", "before"] if args.before_src else ["after"]
    sim_port, *ports = free_ports(1 + 5 * len(names))
    sim = ["sim", "--count", "1", "--port", str(sim_port), "--model", MODEL,
           "--time-scale", str(args.time_scale)]  # fmt: skip
    with contextlib.ExitStack() as stack:
        _start(stack, sim, tmp / "sim.log", None)
        variants: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            vports = variants[name] = ports[5 * i : 5 * i + 5]
            (tmp / name).mkdir(parents=True)
            write_config(tmp / name, sim_port, vports, max_connections_per_client=args.cap)
            serve = ["serve", "-f", str(tmp / name), "--workdir", str(tmp / f"{name}-envoy")]
            path = args.before_src if name == "before" else None
            _start(stack, [*serve, "--log-level", "warning"], tmp / f"{name}.log", path)
        for vports in variants.values():
            await _ready(vports[0])
        results: dict[str, list[Prober]] = {name: [] for name in names}
        loads: list[str] = []
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                http, *_, admin = variants[name]
                results[name].append(
                    await _round(http, admin, args.cap, args.clients, args.seconds, args.every)
                )
                loads.append(f"{name}: {os.getloadavg()[0]:.1f}")
        print("load average (1 min) after each round:", ", ".join(loads))
        print(f"{'variant':<7} {'probes':>6} {'let in':>6} {'refused in ms p50/p95':>22} "
              f"{'check ms P50/P95':>17} {'failed open/checks':>19}")  # fmt: skip
        for name, probers in results.items():
            probes = sum(p.probes for p in probers)
            let_in = sum(p.let_in for p in probers)
            refused = sorted(s for p in probers for s in p.refused_s)
            p50 = statistics.median(refused) * 1e3 if refused else float("nan")
            p95 = refused[int(0.95 * (len(refused) - 1))] * 1e3 if refused else float("nan")
            text = _stats(variants[name][4])
            failed = _counter(text, "ext_authz.client_cap.failure_mode_allowed")
            total = _counter(text, "ext_authz.client_cap.total")
            print(f"{name:<7} {probes:>6} {let_in:>6} {p50:>10.1f} / {p95:<9.1f} "
                  f"{_quantiles(text):>17} {failed:>9} / {total:<8}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
