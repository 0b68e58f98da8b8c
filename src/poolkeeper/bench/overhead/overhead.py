"""`bench overhead`: what the gateway costs, by running the project's overhead benchmarks.

Two measurements, each owned by the benchmark module of the part it measures:

- `poolkeeper.bench.overhead.scheduler_decision` (the scheduler's): CPU time of one scheduling
  decision at 10, 100 and 1,000 endpoints (decision time vs fleet size);
- `poolkeeper.bench.overhead.gateway_overhead` (the gateway's): added latency of Envoy + EPP
  versus going direct, and EPP requests/s per core; with `--peers`, the same light load
  interleaved through vllm-router and sglang-router too (`bench.overhead.overhead_peers`), with
  `--floor` through Envoy alone and Envoy + a do-nothing Python ext_proc on grpc.aio and on
  the lean transport (`bench.overhead.overhead_floor`), with `--grpcio` through a second
  poolkeeper on the grpcio ext_proc transport (the first runs the default, lean), with
  `--prompt-bytes` per prompt size.

Both ship in the package, so the installed command works anywhere (no checkout needed). Each
runs in a child process of the current interpreter (`python -m ...`), bounded in time, and its
output is stored verbatim in `<out>/overhead.json`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from poolkeeper.bench.results.report import command_line, machine_info, write_json

SCRIPT_TIMEOUT_S = 420.0
DECISION_MODULE = "poolkeeper.bench.overhead.scheduler_decision"
GATEWAY_MODULE = "poolkeeper.bench.overhead.gateway_overhead"


def _run_module(module: str, args: Sequence[str], timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return {"module": module, "args": list(args), "rc": None, "timed_out": True,
                "stdout": out, "wall_s": time.perf_counter() - started}  # fmt: skip
    return {
        "module": module,
        "args": list(args),
        "rc": proc.returncode,
        "timed_out": False,
        "stdout": proc.stdout,
        "stderr_tail": proc.stderr[-2000:],
        "wall_s": time.perf_counter() - started,
    }


def run_overhead(
    *,
    sizes: Sequence[int],
    decisions: int,
    out_dir: Path,
    quick: bool,
    peers: Sequence[str] = (),
    prompt_bytes: str = "",
    floor: bool = False,
    grpcio: bool = False,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "kind": "bench-overhead",
        "command": command_line(),
        "machine": machine_info(),
    }
    size_arg = ",".join(str(s) for s in sizes)
    progress(f"decision time vs fleet size: {DECISION_MODULE}")
    args = ["--sizes", size_arg, "--decisions", str(decisions)]
    if quick:
        args += ["--warmup", "300"]
    result["scheduler_decision"] = _run_module(DECISION_MODULE, args, SCRIPT_TIMEOUT_S)
    progress(result["scheduler_decision"]["stdout"])
    progress(f"gateway overhead: {GATEWAY_MODULE}")
    args = (
        ["--rates", "10,50", "--duration", "5", "--loop-seconds", "5"]
        if quick
        else ["--rates", "10,50,100", "--duration", "10", "--loop-seconds", "10"]
    )
    if peers:
        args += ["--peers", ",".join(peers)]
    if floor:
        args.append("--floor")
    if grpcio:
        args.append("--grpcio")
    if prompt_bytes:
        args += ["--prompt-bytes", prompt_bytes]
    # Peers, the floor and prompt sizes add their own timed sections (each bounded by
    # --duration).
    limit = SCRIPT_TIMEOUT_S * (2 if peers or floor or grpcio or prompt_bytes else 1)
    result["gateway_overhead"] = _run_module(GATEWAY_MODULE, args, limit)
    progress(result["gateway_overhead"]["stdout"])
    write_json(out_dir / "overhead.json", result)
    return result
