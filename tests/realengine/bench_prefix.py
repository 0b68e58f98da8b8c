"""Shared-prefix chat on a real engine: poolkeeper against round-robin and the peer routers.

    python -m tests.realengine.bench_prefix [--groups 12] [--requests 96] [--rate 0.8]
        [--targets poolkeeper,round-robin,vllm-router,sglang-router] [--out FILE]

Three `llama-server` processes (SmolLM2-135M, the settings of tests/realengine/llama.py) are
started afresh for every target, so every target begins with empty caches. The workload is the
same for all: `requests` chat requests arriving as a Poisson process at `rate` per second, each
with one of `groups` long system prompts (about 250 real tokens each) and a short question of
its own, streamed, 8 output tokens. Reported per target: TTFT p50 / p90 (first content chunk,
measured by the client), the prompt-cache hit rate from the engines' own counters
(`llamacpp:prompt_tokens_cached_total` over that plus `llamacpp:prompt_tokens_total`, summed
over the three servers), requests per server, errors, and the machine's load average around
the run (the machine may be shared: docs/benchmarks-real-engine.md says how to read that).

Targets: `poolkeeper` (`poolkeeper serve`: Envoy + EPP, default profile, engine `llamacpp`);
`round-robin` (the same Envoy binary, a static ROUND_ROBIN cluster: a Kubernetes Service
stand-in); `vllm-router` and `sglang-router` in `cache_aware` mode (installed by
scripts/install-peers.sh; skipped with a note when absent or when they cannot use llama-server).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

from poolkeeper.bench.live.live_targets import envoy_rr_bootstrap
from poolkeeper.netutil import free_ports
from tests.realengine.llama import BASE_MODEL, LlamaServer, start_server, wait_healthy

TARGETS = ("poolkeeper", "round-robin", "vllm-router", "sglang-router")
SERVERS = 3
MAX_TOKENS = 8
READY_S = 60.0
_WORDS = str.split(
    "garden soil water light shade root leaf flower seed season compost frost pot prune "
    "harvest tomato basil fern rose tulip moss gravel clay loam drainage sunlight morning "
    "evening orchard hedge lawn mulch insect bee worm fungus spore branch stem bark bloom "
    "valley river meadow stone path fence gate wind rain cloud summer winter autumn spring"
)


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds after the start
    group: int
    question: str


@dataclass(slots=True)
class Outcome:
    ttft: float | None = None
    error: str | None = None
    server: str | None = None


@dataclass(slots=True)
class Result:
    target: str
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    cache_hit_rate: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ok: int = 0
    errors: int = 0
    per_server: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0
    note: str = ""


def system_prompt(group: int) -> str:
    rng = random.Random(1000 + group)
    words = " ".join(rng.choice(_WORDS) for _ in range(200))
    return f"You are garden assistant number {group}. Reference notes: {words}."


def workload(groups: int, requests: int, rate: float, seed: int = 1) -> list[Arrival]:
    rng = random.Random(seed)
    at = 0.0
    out = []
    for i in range(requests):
        at += rng.expovariate(rate)
        topic = " ".join(rng.choice(_WORDS) for _ in range(4))
        out.append(Arrival(at, rng.randrange(groups), f"Question {i}: what about {topic}?"))
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def process(cmd: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            list(cmd), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def wait_ok(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=2) as resp,
        ):
            if resp.status == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{what} not ready at {url} after {READY_S:g} s")


def poolkeeper_config(path: Path, servers: Sequence[LlamaServer]) -> tuple[list[str], str]:
    http, ext_proc, metrics, health, admin = free_ports(5)
    endpoints = "".join(
        f"    - {{name: llama-{i}, address: 127.0.0.1, port: {s.port}, labels: {{app: llama}},"
        " engine: llamacpp}\n"
        for i, s in enumerate(servers)
    )
    path.write_text(f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: default}}
spec:
  listeners: {{http: {http}, extProc: {ext_proc}, metrics: {metrics}, health: {health},
    admin: {admin}}}
  scraping: {{intervalMs: 100, timeoutMs: 3000, stalenessMs: 2000}}
  endpoints:
{endpoints}---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: llama, namespace: default}}
spec:
  selector: {{app: llama}}
  targetPortNumber: 8000
  extensionRef: {{name: llama-epp, failureMode: FailClose}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: smollm2, namespace: default}}
spec:
  modelName: {BASE_MODEL}
  criticality: Standard
  poolRef: {{name: llama}}
""")
    cmd = [sys.executable, "-m", "poolkeeper", "serve", "-f", str(path),
           "--workdir", str(path.parent / "envoy"), "--log-level", "warning"]  # fmt: skip
    return cmd, f"http://127.0.0.1:{http}"


def round_robin_config(path: Path, servers: Sequence[LlamaServer]) -> tuple[list[str], str]:
    """Envoy alone, round-robin over the servers: the same bootstrap `bench live` uses."""
    port, admin = free_ports(2)
    envoy_rr_bootstrap(path, port, admin, [s.port for s in servers])
    envoy = Path(sys.executable).parent / "envoy"
    cmd = [str(envoy), "-c", str(path), "--concurrency", "1", "--log-level", "warn",
           "--disable-hot-restart"]  # fmt: skip
    return cmd, f"http://127.0.0.1:{port}"


def peer_config(target: str, servers: Sequence[LlamaServer]) -> tuple[list[str], str] | None:
    root = Path(__file__).resolve().parents[2] / ".peers"
    port, prom = free_ports(2)
    workers = [f"http://{s.hostport}" for s in servers]
    if target == "vllm-router":
        exe = root / "venv-vllm-router" / "bin" / "vllm-router"
        prefix = [str(exe)] if exe.is_file() else None
    else:
        py = root / "venv-sglang-router" / "bin" / "python"
        prefix = [str(py), "-m", "sglang_router.launch_router"] if py.is_file() else None
    if prefix is None:
        return None
    cmd = [*prefix, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
           "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(prom)]  # fmt: skip
    return cmd, f"http://127.0.0.1:{port}"


async def drive(base_url: str, arrivals: Sequence[Arrival], groups: int) -> list[Outcome]:
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    prompts = [system_prompt(g) for g in range(groups)]
    outcomes = [Outcome() for _ in arrivals]
    start = time.monotonic()

    async def one(i: int, arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
        sent = time.monotonic()
        out = outcomes[i]
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=BASE_MODEL,
                messages=[
                    {"role": "system", "content": prompts[arrival.group]},
                    {"role": "user", "content": arrival.question},
                ],
                max_tokens=MAX_TOKENS, temperature=0, stream=True,
            )  # fmt: skip
            out.server = raw.headers.get("x-gateway-destination-endpoint-served")
            async for chunk in raw.parse():
                if out.ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    out.ttft = time.monotonic() - sent
        except (openai.APIError, OSError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:200]

    try:
        await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    finally:
        await client.close()
    return outcomes


def _counters(servers: Sequence[LlamaServer]) -> tuple[int, int]:
    """Prompt tokens computed and prompt tokens reused from the cache, over all servers."""
    prompt = cached = 0
    for s in servers:
        m = s.metrics()
        prompt += int(m["llamacpp:prompt_tokens_total"])
        cached += int(m["llamacpp:prompt_tokens_cached_total"])
    return prompt, cached


def run_target(target: str, arrivals: Sequence[Arrival], groups: int, work: Path) -> Result:
    result = Result(target)
    work.mkdir(parents=True, exist_ok=True)
    ports = free_ports(SERVERS)
    servers = [start_server(p, work / f"llama-{p}.log") for p in ports]
    try:
        wait_healthy(servers)
        if target == "poolkeeper":
            cmd, url = poolkeeper_config(work / "gateway.yaml", servers)
            ready = f"{url}/v1/models"
        elif target == "round-robin":
            cmd, url = round_robin_config(work / "envoy-rr.yaml", servers)
            ready = f"{url}/health"
        else:
            peer = peer_config(target, servers)
            if peer is None:
                result.note = "not installed (scripts/install-peers.sh)"
                return result
            cmd, url = peer
            ready = f"{url}/health"
        with process(cmd, work / f"{target}.log") as proc:
            try:
                wait_ok(ready, proc, target)
            except (RuntimeError, TimeoutError) as exc:
                result.note = f"did not start with llama-server: {exc}"
                return result
            result.load_before = os.getloadavg()[0]
            started = time.monotonic()
            outcomes = asyncio.run(drive(url, arrivals, groups))
            result.wall_s = round(time.monotonic() - started, 1)
            result.load_after = os.getloadavg()[0]
        ttfts = [o.ttft for o in outcomes if o.ttft is not None]
        result.ok = len(ttfts)
        result.errors = len(outcomes) - len(ttfts)
        errors = Counter(o.error for o in outcomes if o.error)
        if errors:
            result.note = "; ".join(f"{n} x {e}" for e, n in errors.most_common(3))
        p50, p90 = percentile(ttfts, 0.5), percentile(ttfts, 0.9)
        result.ttft_p50_s = None if p50 is None else round(p50, 3)
        result.ttft_p90_s = None if p90 is None else round(p90, 3)
        prompt, cached = _counters(servers)
        result.prompt_tokens, result.cached_tokens = prompt + cached, cached
        if prompt + cached:
            result.cache_hit_rate = round(cached / (prompt + cached), 3)
        result.per_server = requests_per_server(servers)
        return result
    finally:
        for s in servers:
            s.stop()


def requests_per_server(servers: Sequence[LlamaServer]) -> dict[str, int]:
    """Requests each server finished, by its own log (a slot logs `stop processing` as it
    releases a request; /metrics has no request counter)."""
    return {s.hostport: s.log_text().count("stop processing") for s in servers}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.realengine.bench_prefix")
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--logs", type=Path, default=None,
        help="keep every process's log under this directory (default: a temporary one)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    arrivals = workload(args.groups, args.requests, args.rate)
    results = []
    with contextlib.ExitStack() as stack:
        logs = args.logs or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        for target in args.targets.split(","):
            print(f"running {target} ...", file=sys.stderr, flush=True)
            result = run_target(target, arrivals, args.groups, logs / target)
            results.append(result)
            print(json.dumps(asdict(result)), file=sys.stderr, flush=True)
    print(
        "| target | TTFT p50 s | TTFT p90 s | cache hit rate (engines) | ok / errors "
        "| requests per server | wall s | load avg before / after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.note and not r.ok:
            print(f"| {r.target} | - | - | - | - | - | - | {r.note} |")
            continue
        share = " / ".join(str(n) for n in r.per_server.values())
        hit = "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.1%}"
        print(
            f"| {r.target} | {r.ttft_p50_s} | {r.ttft_p90_s} | {hit} | {r.ok} / {r.errors} "
            f"| {share} | {r.wall_s} | {r.load_before:.1f} / {r.load_after:.1f} |"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(
            {"command": sys.argv, "groups": args.groups, "requests": args.requests,
             "rate": args.rate, "results": [asdict(r) for r in results]}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
