"""`serve` with a scheduler that learns from first tokens: Envoy's Lua filter reports each
streamed response's first byte to the EPP while the stream is still open, so the
prefill-backlog scorer stops counting a request's prompt once its prefill is over, not only
when the whole answer has been generated.

Real parts throughout: the managed Envoy, the EPP runtime, a real-time simulated model server
(`poolkeeper.sim`) on 127.0.0.1 and the official `openai` client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from poolkeeper.controller.files import file_source
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server.runtime import GatewayRuntime, ServeOptions
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.sim.server import SimCluster

pytestmark = pytest.mark.integration

MODEL = "m"


def _config(tmp_path: Path, sim_port: int) -> Path:
    http, ext_proc, metrics, health, admin = free_ports(5)
    (tmp_path / "gw.yaml").write_text(
        f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: default}}
spec:
  listeners: {{http: {http}, extProc: {ext_proc}, metrics: {metrics}, health: {health},
    admin: {admin}}}
  scheduling: {{preset: prefill-backlog}}
  endpoints:
    - {{name: sim-0, address: 127.0.0.1, port: {sim_port}, labels: {{app: sim}}}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: pool, namespace: default}}
spec:
  selector: {{app: sim}}
  targetPortNumber: 8000
  extensionRef: {{name: epp}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: m, namespace: default}}
spec: {{modelName: {MODEL}, poolRef: {{name: pool}}}}
"""
    )
    return tmp_path


async def _until(condition: Callable[[], object], seconds: float = 30.0) -> bool:
    """Polls until `condition` holds; False once the bound passes."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.01)
    return False


async def _until_serving(client: openai.AsyncOpenAI, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            return True
        except openai.InternalServerError:
            await asyncio.sleep(0.1)
    return False


async def test_the_backlog_forgets_a_prompt_at_its_first_byte_not_at_the_end(
    tmp_path: Path,
) -> None:
    # One server serving `m`, about 5 ms per generated token: 8,000 tokens take ~40 s after
    # the first one, longer than the report may take even on a loaded machine (the test
    # closes the stream once it has seen enough).
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings(model=MODEL, step_jitter=0.0)))
    (sim,) = await cluster.start()
    runtime = GatewayRuntime(
        ServeOptions(source=file_source([_config(tmp_path, sim.port)]), ready_wait_s=5)
    )
    await runtime.start()
    try:
        assert runtime.director is not None
        assert runtime.config is not None
        scheduler, inflight = runtime.director.scheduler, runtime.director.inflight
        assert isinstance(scheduler, Scheduler)
        assert isinstance(inflight, InflightTracker)
        scorer = scheduler.plugins["prefill-backlog-scorer"]
        assert isinstance(scorer, PrefillBacklogScorer)
        port = runtime.config.spec.listeners.http
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30
        )
        # Envoy is ready once its admin says so; its first health check of the EPP may pass
        # later on a loaded machine (a FailClose 503 meanwhile): wait until it serves.
        assert await _until_serving(client)
        await _until(lambda: len(scorer.backlog) == 0 and len(inflight) == 0)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me a long story " * 20}],
            max_tokens=8000,
            stream=True,
        )
        chunks = 0
        forgotten_while_open = False
        async for chunk in stream:
            chunks += 1
            if chunks == 1:
                # The report travels Lua -> EPP asynchronously: wait for it ...
                forgotten_while_open = await _until(lambda: len(scorer.backlog) == 0)
                # ... while the EPP still counts the request in flight: the stream is open.
                assert len(inflight) == 1
            del chunk
            if chunks > 100:
                break
        await stream.close()
        assert chunks > 100
        assert forgotten_while_open
        await client.close()
    finally:
        await runtime.stop(grace_s=0)
        await cluster.stop()
