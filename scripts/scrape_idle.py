"""An idle `poolkeeper serve` EPP's CPU per second over N simulated servers, by scrape client.

    .venv/bin/python scripts/scrape_idle.py [--endpoints 20] [--rounds 4] [--seconds 10]

Starts `poolkeeper sim --count N` once, then, in interleaved rounds (order flipped every round),
`poolkeeper serve --no-envoy` over those N servers with `scraping.client` lean, aiohttp, and a
floor variant that scrapes once a minute (`intervalMs: 60000`: the EPP's own idle cost). No
requests are sent. Each EPP gets `--settle` seconds (8) to start and spread its scrape phases,
then its CPU (utime + stime from /proc, the whole process) is read over `--seconds`. Prints
CPU ms per second per variant (median and range of rounds), what the scrapes cost over the
floor, and `uptime` at start and end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from poolkeeper.netutil import free_ports

VARIANTS = {
    "lean": "{intervalMs: 50, timeoutMs: 1000, client: lean}",
    "aiohttp": "{intervalMs: 50, timeoutMs: 1000, client: aiohttp}",
    "floor": "{intervalMs: 60000, timeoutMs: 1000}",
}
TICK = os.sysconf("SC_CLK_TCK")


def gateway_yaml(scraping: str, sim_ports: list[int]) -> str:
    http, ext_proc, metrics, health, admin = free_ports(5)
    eps = "".join(
        f"    - {{name: sim-{i}, address: 127.0.0.1, port: {port}, labels: {{app: sim}}}}\n"
        for i, port in enumerate(sim_ports)
    )
    return f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: default}}
spec:
  listeners: {{http: {http}, extProc: {ext_proc}, metrics: {metrics}, health: {health},
    admin: {admin}}}
  scraping: {scraping}
  endpoints:
{eps}---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: pool, namespace: default}}
spec:
  selector: {{app: sim}}
  targetPortNumber: 8000
  extensionRef: {{name: pool-epp}}
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def one(variant: str, sim_ports: list[int], seconds: float, settle: float, workdir: Path) -> float:
    directory = workdir / variant
    directory.mkdir(exist_ok=True)
    (directory / "gateway.yaml").write_text(gateway_yaml(VARIANTS[variant], sim_ports))
    epp = subprocess.Popen(
        [sys.executable, "-m", "poolkeeper", "serve", "-f", str(directory), "--no-envoy"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(settle)
        if epp.poll() is not None:
            raise SystemExit(f"serve ({variant}) exited with {epp.returncode}")
        started, wall = cpu_seconds(epp.pid), time.monotonic()
        time.sleep(seconds)
        spent, wall = cpu_seconds(epp.pid) - started, time.monotonic() - wall
        return spent / wall * 1e3
    finally:
        epp.terminate()
        epp.wait(timeout=30)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=8.0, help="start-up, not measured")
    args = parser.parse_args()
    first = free_ports(1)[0] + 100
    sim_ports = [first + i for i in range(args.endpoints)]
    command = ["-m", "poolkeeper", "sim", "--count", str(args.endpoints), "--port", str(first)]
    sim = subprocess.Popen(
        [sys.executable, *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    print(f"start: {uptime()}", flush=True)
    try:
        time.sleep(2.0)
        with tempfile.TemporaryDirectory(prefix="scrape-idle-") as tmp:
            names = list(VARIANTS)
            for round_ in range(args.rounds):
                for name in names if round_ % 2 == 0 else names[::-1]:
                    results[name].append(one(name, sim_ports, args.seconds, args.settle, Path(tmp)))
                print(f"round {round_ + 1}: {uptime()}", flush=True)
    finally:
        sim.terminate()
        sim.wait(timeout=30)
    floor = statistics.median(results["floor"])
    print(f"\n{args.endpoints} endpoints, every 50 ms; EPP CPU ms per second:")
    for name, values in results.items():
        median = statistics.median(values)
        over = "" if name == "floor" else f", scrapes {median - floor:.0f} over the floor"
        print(f"  {name:8s} {median:6.1f} [{min(values):.1f}-{max(values):.1f}]{over}")
    print(f"end: {uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
