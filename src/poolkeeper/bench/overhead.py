"""`bench overhead`: what the gateway costs, by reusing the project's overhead benchmarks.

Two measurements, each owned by the benchmark script of the part it measures:

- `benchmarks/scheduler_decision.py` (the scheduler's): CPU time of one scheduling decision at
  10, 100 and 1,000 endpoints (decision time vs fleet size);
- `benchmarks/gateway_overhead.py` (the gateway's): added latency of Envoy + EPP versus going
  direct, and EPP requests/s per core.

This command runs whichever of them exist in the source tree (it must be run from a checkout)
with the current interpreter, bounded in time, and stores their output verbatim in
`<out>/overhead.json`. Without the scripts it falls back to timing `Scheduler.schedule` of the
default preset directly, and says so in the result.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from poolkeeper.bench.metrics import percentile
from poolkeeper.bench.report import command_line, machine_info, write_json

SCRIPT_TIMEOUT_S = 420.0


def _repo_root() -> Path | None:
    for start in (Path.cwd(), Path(__file__).resolve()):
        for candidate in (start, *start.parents):
            if (candidate / "benchmarks").is_dir() and (candidate / "pyproject.toml").is_file():
                return candidate
    return None


def _run_script(path: Path, args: Sequence[str], timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(path), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return {"script": str(path), "args": list(args), "rc": None, "timed_out": True,
                "stdout": out, "wall_s": time.perf_counter() - started}  # fmt: skip
    return {
        "script": str(path),
        "args": list(args),
        "rc": proc.returncode,
        "timed_out": False,
        "stdout": proc.stdout,
        "stderr_tail": proc.stderr[-2000:],
        "wall_s": time.perf_counter() - started,
    }


def direct_decision_times(sizes: Sequence[int], decisions: int, seed: int = 7) -> dict[str, Any]:
    """Fallback: wall time of `Scheduler.schedule` (default preset) per fleet size."""
    from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
    from poolkeeper.scheduling.build import build_scheduler
    from poolkeeper.scheduling.presets import preset_config
    from poolkeeper.scheduling.types import LLMRequest

    out: dict[str, Any] = {}
    for n in sizes:
        rng = random.Random(seed)
        sched = build_scheduler(preset_config("default"), rng=random.Random(seed))
        states = [
            EndpointState(
                Endpoint(f"s{i}", f"10.1.{i // 250}.{i % 250 + 1}", 8000),
                EndpointMetrics(
                    waiting=rng.randrange(4),
                    running=rng.randrange(64),
                    kv_cache_usage=rng.random() * 0.8,
                    updated_at=1.0,
                ),
            )
            for i in range(n)
        ]
        systems = [f"system {g} " + "lorem ipsum " * 300 for g in range(64)]
        times: list[float] = []
        for k in range(decisions):
            prompt = systems[k % 64] + f"question {k}"
            req = LLMRequest(f"r{k}", "m", "m", prompt=prompt, prompt_tokens=len(prompt) // 4)
            t = time.perf_counter()
            sched.schedule(req, states, now=1.01)
            times.append(time.perf_counter() - t)
        out[str(n)] = {
            "p50_ms": percentile(times, 50) * 1000,
            "p99_ms": percentile(times, 99) * 1000,
            "decisions": decisions,
        }
    return out


def run_overhead(
    *,
    sizes: Sequence[int],
    decisions: int,
    out_dir: Path,
    quick: bool,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    root = _repo_root()
    result: dict[str, Any] = {
        "kind": "bench-overhead",
        "command": command_line(),
        "machine": machine_info(),
    }
    decision_script = root / "benchmarks" / "scheduler_decision.py" if root else None
    gateway_script = root / "benchmarks" / "gateway_overhead.py" if root else None
    size_arg = ",".join(str(s) for s in sizes)
    if decision_script is not None and decision_script.is_file():
        progress(f"decision time vs fleet size: {decision_script}")
        args = ["--sizes", size_arg, "--decisions", str(decisions)]
        if quick:
            args += ["--warmup", "300"]
        result["scheduler_decision"] = _run_script(decision_script, args, SCRIPT_TIMEOUT_S)
        progress(result["scheduler_decision"]["stdout"])
    else:
        progress("benchmarks/scheduler_decision.py not found: timing Scheduler.schedule directly")
        result["scheduler_decision_direct"] = direct_decision_times(sizes, decisions)
        progress(str(result["scheduler_decision_direct"]))
    if gateway_script is not None and gateway_script.is_file():
        progress(f"gateway overhead: {gateway_script}")
        args = (
            ["--rates", "10,50", "--duration", "5", "--loop-seconds", "5"]
            if quick
            else ["--rates", "10,50,100", "--duration", "10", "--loop-seconds", "10"]
        )
        result["gateway_overhead"] = _run_script(gateway_script, args, SCRIPT_TIMEOUT_S)
        progress(result["gateway_overhead"]["stdout"])
    else:
        result["gateway_overhead"] = {
            "missing": "benchmarks/gateway_overhead.py is not in this tree; "
            "Envoy + EPP added latency was not measured by this run"
        }
        progress(result["gateway_overhead"]["missing"])
    write_json(out_dir / "overhead.json", result)
    return result
