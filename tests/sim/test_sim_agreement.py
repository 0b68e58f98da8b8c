"""The same small scenario in real time (sockets) and virtual time must agree closely."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.sim.params import DEFAULT_MODEL
from poolkeeper.sim.server import Listening, SimCluster
from poolkeeper.sim.virtual import Arrival, VirtualFleet

pytestmark = pytest.mark.integration

StartCluster = Callable[..., Awaitable[tuple[SimCluster, list[Listening]]]]

TIME_SCALE = 4.0  # 4x slower than an H100: ~26 ms steps, robust against event-loop jitter
SETTINGS = {"max_num_seqs": 4, "time_scale": TIME_SCALE, "lora_adapters": ["a"], "max_loras": 1}


def scenario() -> list[Arrival]:
    out = []
    for i in range(10):
        group = "Shared instructions for group one. " if i % 2 else "Other group's preamble. "
        model = "a" if i in (3, 7) else DEFAULT_MODEL
        out.append(Arrival(0.08 * i, f"r{i}", model, group * 12 + f"question {i}",
                           max_tokens=12 + 3 * i))  # fmt: skip
    return out


async def run_real(
    url: str, arrivals: list[Arrival]
) -> tuple[dict[str, tuple[float, float]], list[Arrival]]:
    """(TTFT, end-to-end) per request, and the arrivals as they really happened.

    The sleeps only schedule the open-loop arrivals; a late wake-up (a loaded machine) is no
    error because the virtual run replays the arrival times measured here.
    """
    loop = asyncio.get_running_loop()
    results: dict[str, tuple[float, float]] = {}
    happened: list[Arrival] = []

    async def one(http: aiohttp.ClientSession, arrival: Arrival, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + arrival.time - loop.time()))
        start = loop.time()
        happened.append(dataclasses.replace(arrival, time=start - t0))
        body = {"model": arrival.model, "prompt": arrival.prompt,
                "max_tokens": arrival.max_tokens, "stream": True}  # fmt: skip
        first = None
        async with http.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if first is None and line.startswith(b'data: {"id"'):
                    first = loop.time()
        assert first is not None
        results[arrival.request_id] = (first - start, loop.time() - start)

    async with aiohttp.ClientSession() as http:
        t0 = loop.time() + 0.05
        await asyncio.gather(*(one(http, a, t0) for a in arrivals))
    return results, sorted(happened, key=lambda a: a.time)


async def test_real_time_and_virtual_time_agree(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, **SETTINGS)
    real, happened = await run_real(where.url, scenario())
    assert [a.request_id for a in happened] == [a.request_id for a in scenario()]  # same order

    specs = build_fleet(count=1, cli=ServerSettings.model_validate(SETTINGS))
    virtual = VirtualFleet(specs).run(happened, lambda a, s, now: 0)
    expected = {r.request_id: (r.ttft or 0.0, r.e2e or 0.0) for r in virtual.requests}
    assert all(r.finish is not None for r in virtual.requests)

    step = 0.0066 * TIME_SCALE  # one decode step: the granularity of any disagreement
    for rid, (v_ttft, v_e2e) in expected.items():
        r_ttft, r_e2e = real[rid]
        assert abs(r_e2e - v_e2e) <= 0.05 * v_e2e + 1.5 * step, (rid, r_e2e, v_e2e)
        assert abs(r_ttft - v_ttft) <= 0.05 * v_ttft + 1.5 * step, (rid, r_ttft, v_ttft)
    mean_real = statistics.mean(e for _, e in real.values())
    mean_virtual = statistics.mean(e for _, e in expected.values())
    assert mean_real == pytest.approx(mean_virtual, rel=0.05)
    # The scenario exercises queueing and adapter swaps, not just idle decoding.
    assert max(t for t, _ in expected.values()) > 5 * step
    assert sum(r.adapter_loaded for r in virtual.requests) >= 1
