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
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server.options import ServeOptions
from tests.support.gateway_files import one_pool
from tests.support.sim_gateway import MODEL, running_gateway, sim_server

pytestmark = pytest.mark.integration

PREFILL_BACKLOG = "  scheduling: {preset: prefill-backlog}\n"


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
    async with (
        sim_server() as sim_port,
        running_gateway(
            ServeOptions(
                source=file_source([one_pool(tmp_path, sim_port, spec=PREFILL_BACKLOG)]),
                ready_wait_s=5,
            )
        ) as runtime,
    ):
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
