"""`bench flow --live`: a fair-share case (`fleet.fairshare.FairCase`) run live, as a user would.

`poolkeeper sim` serves the case's fleet (`--max-num-seqs` = its batch slots, its time scale),
`poolkeeper serve` (real Envoy, the EPP with the default `spec.flowControl`, 50 ms scraping)
routes two Standard models, `alpha` and `beta`, and a Critical `probe`; closed-loop clients
over loopback each send a streaming chat completion, read it to the end, and send the next
(after `RETRY_S` when refused) until the case's duration; one Critical request is sent at a
third of it. Measured as the virtual run measures it (`fairshare.run_case`): tokens (prompt +
output, from the stream's usage) served in the last two thirds (`fairshare.served_in`), per
model per second; beta/alpha; Standard refusals by status and `x-llm-d-request-dropped-reason`; the
probe's status and TTFT. The virtual fleet must agree with this on beta/alpha (issue 35).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from poolkeeper.bench.fleet.fairshare import (
    ALPHA,
    BETA,
    PROBE,
    PROMPT_TOKENS,
    RETRY_S,
    FairCase,
    case_summary,
    served_in,
)
from poolkeeper.bench.live.live_processes import READY_TIMEOUT_S, process, repo_root, wait_http
from poolkeeper.bench.live.live_targets import POOLKEEPER, envoy_binary, router_command
from poolkeeper.bench.live.loadgen import check_loopback
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports

MODELS = [(ALPHA, "Standard", "base-model"), (BETA, "Standard", "base-model"),
          (PROBE, "Critical", "base-model")]  # fmt: skip
DRAIN_S = 60.0  # after the duration, how long requests still in flight may take to finish
REQUEST_TIMEOUT_S = 120.0  # what each client waits at most (the clients)


@dataclass(slots=True)
class _Done:
    model: str
    status: int
    start: float
    finish: float
    first: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    reason: str = ""


@dataclass(slots=True)
class _Run:
    t0: float
    case: FairCase
    done: list[_Done] = field(default_factory=list)
    seq: int = 0


async def _request(
    session: aiohttp.ClientSession, url: str, run: _Run, model: str, client: str
) -> _Done:
    run.seq += 1
    prompt = f"{client} request {run.seq} " + "tok " * PROMPT_TOKENS
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": run.case.outputs(model), "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.monotonic() - run.t0
    done = _Done(model, 0, start, start)
    chunks = 0
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        ) as resp:
            done.status = resp.status
            done.reason = resp.headers.get("x-llm-d-request-dropped-reason", "")
            if resp.status != 200:
                await resp.read()
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    try:
                        event = json.loads(line[5:])
                    except ValueError:
                        continue
                    choices = event.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        chunks += 1
                        if done.first is None:
                            done.first = time.monotonic() - run.t0 - start
                    usage = event.get("usage") or {}
                    if usage:
                        done.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        done.output_tokens = int(usage.get("completion_tokens") or 0)
    except (aiohttp.ClientError, TimeoutError) as exc:
        done.status, done.reason = 0, type(exc).__name__
    if done.status == 200 and not done.output_tokens:
        done.output_tokens = chunks
    done.finish = time.monotonic() - run.t0
    run.done.append(done)
    return done


async def _client(
    session: aiohttp.ClientSession, url: str, run: _Run, model: str, client: str, delay: float
) -> None:
    await asyncio.sleep(delay)
    while time.monotonic() - run.t0 < run.case.duration_s:
        done = await _request(session, url, run, model, client)
        if done.status != 200:
            await asyncio.sleep(RETRY_S)


async def _drive(base_url: str, case: FairCase, seed: int) -> _Run:
    check_loopback(base_url)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    rng = random.Random(f"{seed}:clients")
    connector = aiohttp.TCPConnector(limit=1024)
    async with aiohttp.ClientSession(connector=connector) as session:
        run = _Run(time.monotonic(), case)
        clients = [
            (model, f"{model}{c}", rng.uniform(0.0, 0.5))
            for model, n in ((ALPHA, case.alpha_clients), (BETA, case.beta_clients))
            for c in range(n)
        ]
        tasks = [
            asyncio.create_task(_client(session, url, run, model, name, delay))
            for model, name, delay in clients
        ]

        async def probe() -> None:
            await asyncio.sleep(case.duration_s / 3)
            await _request(session, url, run, PROBE, PROBE)

        tasks.append(asyncio.create_task(probe()))
        _done, pending = await asyncio.wait(tasks, timeout=case.duration_s + DRAIN_S)
        for task in pending:
            task.cancel()
    return run


def measure(run: _Run) -> dict[str, Any]:
    """The measurements of `fairshare.run_case`, from the live requests."""
    case = run.case
    lo, hi = case.duration_s / 3, case.duration_s
    served = dict.fromkeys((ALPHA, BETA), 0.0)
    ok: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    probe: dict[str, Any] = {"status": "missing"}
    for d in run.done:
        if d.model == PROBE:
            probe = {"status": "ok" if d.status == 200 else str(d.status), "ttft_s": d.first}
            continue
        if d.status == 200:
            ok[d.model] += 1
            first = d.finish if d.first is None else d.start + d.first
            served[d.model] += served_in(lo, hi, first, d.finish, d.prompt_tokens, d.output_tokens)
        else:
            refused[f"{d.status} {d.reason}".strip()] += 1
    return case_summary(served, hi - lo, ok, refused, probe, len(run.done))


def run_fair_live(
    case: FairCase,
    *,
    seed: int = 1,
    log_level: str = "warning",
    keep: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One live run of `case` through `poolkeeper serve` (see the module docstring)."""
    if envoy_binary() is None:
        raise ConfigError("Envoy is not installed next to this Python (.venv/bin/envoy)")
    root = repo_root()
    with tempfile.TemporaryDirectory(prefix="poolkeeper-fairlive-") as tmp:
        work = keep if keep is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        sim_ports = free_ports(case.servers, consecutive=True)
        sim_cmd = [sys.executable, "-m", "poolkeeper", "sim", "--count", str(case.servers),
                   "--port", str(sim_ports[0]), "--model", "base-model",
                   "--max-num-seqs", str(case.slots), "--time-scale", str(case.time_scale),
                   "--seed", str(seed)]  # fmt: skip
        with process(sim_cmd, work / "sim.log"):
            for p in sim_ports:
                wait_http(f"http://127.0.0.1:{p}/health", lambda s: s == 200, READY_TIMEOUT_S,
                          "sim")  # fmt: skip
            cmd, port, ready = router_command(POOLKEEPER, root, work, sim_ports, MODELS)
            cmd[cmd.index("--log-level") + 1] = log_level
            with process(cmd, work / "poolkeeper.log", env={"HF_HUB_OFFLINE": "1"}):
                wait_http(ready, lambda s: s < 500, READY_TIMEOUT_S, POOLKEEPER)
                time.sleep(1.0)  # let the scraper see every server once
                run = asyncio.run(_drive(f"http://127.0.0.1:{port}", case, seed))
    result = {"case": case.label(), "spec": asdict(case), "seed": seed, **measure(run)}
    progress(
        f"live {case.label()}: beta/alpha {result['beta_to_alpha']:.2f}, Jain "
        f"{result['jain']:.3f}, goodput {result['goodput_tok_s']:.0f} tok/s, completed "
        f"{result['completed']}, refused {result['refused'] or 0}, probe {result['probe']}"
    )
    return result
