"""The gateway under test in the overhead benchmarks: its request, its config, its processes.

`MODEL` and `BODY` (the benchmark request, `body_of` for a prompt of a given size), the
GatewayConfig over one simulator (`write_config`) and the simulator's own (`SIM_CONFIG`), the
processes started (`start`) and waited for (`wait_http`), and the CPU clock they are measured by
(`cpu_seconds`). Shared by `gateway_overhead` and the profiling scripts under scripts/.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

MODEL = "bench-model"
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 1,
}
JSON = {"content-type": "application/json"}
_WORDS = "the quick brown fox jumps over the lazy dog while a model server answers "


def body_of(prompt_bytes: int) -> dict[str, Any]:
    """The benchmark request with a user message of `prompt_bytes` bytes (1 output token)."""
    text = (_WORDS * (prompt_bytes // len(_WORDS) + 1))[:prompt_bytes]
    return {**BODY, "messages": [{"role": "user", "content": text}]}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_config(
    directory: Path,
    sim_port: int,
    ports: list[int],
    preset: str = "default",
    transport: str = "lean",
    *,
    observe_responses: bool = False,
    max_connections_per_client: int | None = None,
) -> None:
    """The benchmark gateway over one simulator (also scripts/route_profile.py's, which turns
    the response observer on as the Envoy `serve` runs have it, without running Envoy, and
    scripts/conncap_cost.py's, which sets the per-client connection cap)."""
    http, ext_proc, metrics, health, admin = ports
    edge_keys = ["observeResponses: true"] if observe_responses else []
    if max_connections_per_client is not None:
        edge_keys.append(f"maxConnectionsPerClient: {max_connections_per_client}")
    edge = f"  edge: {{{', '.join(edge_keys)}}}\n" if edge_keys else ""
    (directory / "gateway.yaml").write_text(f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: bench}}
spec:
  listeners: {{http: {http}, extProc: {ext_proc}, metrics: {metrics}, health: {health},
    admin: {admin}, extProcTransport: {transport}}}
{edge}  scraping: {{intervalMs: 50}}
  scheduling: {{preset: {preset}}}
  endpoints:
    - {{name: sim-0, address: 127.0.0.1, port: {sim_port}, labels: {{app: bench}}}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: bench, namespace: default}}
spec:
  selector: {{app: bench}}
  targetPortNumber: 8000
  extensionRef: {{name: bench-epp}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: bench, namespace: default}}
spec: {{modelName: {MODEL}, criticality: Critical, poolRef: {{name: bench}}}}
""")


async def wait_http(url: str, within_s: float = 120) -> None:  # startup on a loaded machine
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.post(url, json=BODY) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


# The simulator behind every row, direct and gateway alike: a context long enough for the
# largest prompt (1 MB of text is ~262k tokens), and no per-token prompt work (no prefix-cache
# hashing, no prefill time, any prompt in one step of one KV block), so that a 1 MB prompt
# costs it a few ms (its JSON parse) rather than ~300 ms of hashing and chunked prefill, and
# the 1 MB rows measure the gateway. Output tokens keep their pace (`--sim-time-scale`).
SIM_CONFIG = (
    "defaults: {max_model_len: 2500000, num_gpu_blocks: 4000, block_size: 65536,\n"
    "  enable_prefix_caching: false, prefill_token_s: 0, max_num_batched_tokens: 3000000}\n"
)


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`poolkeeper ARGS` in a session of its own, as the peers and the floor's processors run
    (`live_processes.process`): with the kernel's autogroup scheduling each session gets an
    equal share of a busy machine, so in its caller's session a `serve` would share one with
    this driver, its clients and the simulator while each peer had one to itself."""
    return subprocess.Popen(
        [sys.executable, "-m", "poolkeeper", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
