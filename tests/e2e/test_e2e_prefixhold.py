"""End to end: `holdNewPrefixes` through real Envoy and `poolkeeper serve` over one simulated
server with slow prefill steps (2,048 tokens a step, about a second each).

A long new prompt (a, 9,000 tokens) fills the server's prefill backlog; a second new long
prompt (b) is then held in the EPP, visible in `poolkeeper_flow_control_held_requests`; a
request sharing a's prefix (c), sent after b, goes at once; a's first byte releases b. So c's
first byte comes before b's. Without the hold, b is ahead of c in the server's
first-come-first-served queue and c's first byte comes with b's (measured once with
`flowControl: {}` and a of 6,000 tokens: both 1.4 s after a's; with the hold, c's came with
a's and b's 1.55 s later). Asserts the order of events and the EPP's counts, not durations.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.test_rel_restart import _serve
from tests.support.gateway_files import gateway_ports, one_pool
from tests.support.processes import Proc, listening_ports, poolkeeper

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "m"
SPEC = """\
  scheduling: {preset: prefill-backlog}
  flowControl: {holdNewPrefixes: {maxHoldMs: 10000}}
"""


def _prompt(word: str, words: int) -> str:
    return f"{word} " * words  # 6 characters a word: 1.5 prompt tokens


async def _metrics(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, float]:
    """(status, monotonic time of the first body chunk) of a streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        first = 0.0
        async for _chunk in resp.content.iter_any():
            if not first:
                first = time.monotonic()
        return resp.status, first


async def test_a_new_prefix_waits_for_the_first_byte_and_a_placed_one_passes_it(
    tmp_path: Path,
) -> None:
    sim = poolkeeper(
        ["sim", "--port", "0", "--model", MODEL, "--time-scale", "10",
         "--max-num-batched-tokens", "2048"],
        tmp_path / "sim.log",
    )  # fmt: skip
    gw: Proc | None = None
    try:
        (sim_port,) = await asyncio.to_thread(listening_ports, sim, 1)
        ports = gateway_ports()
        directory = one_pool(tmp_path / "config", sim_port, model=MODEL, spec=SPEC, ports=ports)
        gw = await asyncio.to_thread(_serve, directory, ports, tmp_path / "gw")
        url = f"http://127.0.0.1:{ports['http']}"
        held = "poolkeeper_flow_control_held_requests{inference_pool=pool}"
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # a: 9,000 new prompt tokens, five prefill steps (about 4.5 s): time to see b held.
            a = asyncio.create_task(_stream(session, url, _prompt("alpha", 6000)))

            async def sim_busy() -> bool:
                sim_metrics = await _metrics(session, sim_port)
                return any(
                    v > 0
                    for k, v in sim_metrics.items()
                    if k.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
                )

            await _until_async(sim_busy, "a reached the server")
            # b: a new long prefix while the one server's backlog is 9,000 tokens: held.
            b = asyncio.create_task(_stream(session, url, _prompt("bravo", 2000)))
            seen: dict[str, float] = {}

            async def b_held() -> bool:
                seen.update(await _metrics(session, ports["metrics"]))
                return seen.get(held) == 1

            await _until_async(b_held, "b held in the EPP")
            assert not a.done()
            # c: a's prefix and a short question: placed, it goes at once, past b.
            c = asyncio.create_task(_stream(session, url, _prompt("alpha", 6000) + "and then?"))
            (a_status, a_first), (b_status, b_first), (c_status, c_first) = await asyncio.gather(
                a, b, c
            )
            assert (a_status, b_status, c_status) == (200, 200, 200)
            b_s, c_s = b_first - a_first, c_first - a_first
            print(f"first bytes after a's: b {b_s:.3f} s, c {c_s:.3f} s")
            assert c_first < b_first  # c passed the held b
            assert a_first < b_first  # b went once a's prefill was over
            after = await _metrics(session, ports["metrics"])
        hold = "poolkeeper_flow_control_hold_duration_seconds_count"
        assert after[f"{hold}{{inference_pool=pool,outcome=released}}"] == 1  # by a's first byte
        assert after.get(f"{hold}{{inference_pool=pool,outcome=capped}}", 0) == 0
        assert after[held] == 0
    finally:
        if gw is not None:
            gw.stop()
        sim.stop()


async def _until_async(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """`until` for a coroutine condition (each check one scrape of a metrics page)."""
    deadline = time.monotonic() + 60
    while not await condition():
        assert time.monotonic() < deadline, f"not within 60 s: {what}"
        await asyncio.sleep(0.02)
