"""The same small scenario in real time (sockets) and virtual time must agree.

Real time runs on whatever machine runs the suite, so the default test compares what does not
depend on its speed: the engine's schedule (when each step ends) given the arrivals the server
saw, which the real-time driver keeps even when it runs late, and causality on the one clock
client and server share (no token is received before its step ends). How close the client's
view comes to that schedule (the delivery lag) is a matter of the machine's speed: the
opt-in `timing` test checks it (`make timing`) on a quiet machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from poolkeeper.sim.cluster import Listening, SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.sim.driver import TokenWaiter
from poolkeeper.sim.engine import SimRequest
from poolkeeper.sim.params import DEFAULT_MODEL
from poolkeeper.sim.virtual import VirtualFleet
from poolkeeper.sim.virtual_results import Arrival, RequestResult

pytestmark = pytest.mark.integration

StartCluster = Callable[..., Awaitable[tuple[SimCluster, list[Listening]]]]

TIME_SCALE = 4.0  # 4x slower than an H100: ~26 ms steps, robust against event-loop jitter
SETTINGS = {"max_num_seqs": 4, "time_scale": TIME_SCALE, "lora_adapters": ["a"], "max_loras": 1}
STEP = 0.0066 * TIME_SCALE  # one decode step: the granularity of any disagreement


def scenario() -> list[Arrival]:
    out = []
    for i in range(10):
        group = "Shared instructions for group one. " if i % 2 else "Other group's preamble. "
        model = "a" if i in (3, 7) else DEFAULT_MODEL
        out.append(Arrival(0.08 * i, f"r{i}", model, group * 12 + f"question {i}",
                           max_tokens=12 + 3 * i))  # fmt: skip
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """One request as the client saw it, on the event loop's clock (seconds)."""

    start: float
    first_token: float
    end: float


async def run_real(url: str, arrivals: list[Arrival]) -> dict[str, Seen]:
    """Send the arrivals open-loop and note when each one started, got its first token and
    ended. The sleeps only schedule the arrivals; a late wake-up (a loaded machine) is no error
    because the virtual runs replay the arrival times measured here."""
    loop = asyncio.get_running_loop()
    seen: dict[str, Seen] = {}

    async def one(http: aiohttp.ClientSession, arrival: Arrival, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + arrival.time - loop.time()))
        start = loop.time()
        body = {"model": arrival.model, "prompt": arrival.prompt,
                "max_tokens": arrival.max_tokens, "stream": True}  # fmt: skip
        first = None
        async with http.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if first is None and line.startswith(b'data: {"id"'):
                    first = loop.time()
        assert first is not None
        seen[arrival.request_id] = Seen(start, first, loop.time())

    async with aiohttp.ClientSession() as http:
        t0 = loop.time() + 0.05
        await asyncio.gather(*(one(http, a, t0) for a in arrivals))
    return seen


async def serve_scenario(
    sim_cluster: StartCluster, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Seen], dict[str, SimRequest]]:
    """Run the scenario against a real-time server; return what the client saw and the
    engine's own requests (arrival, first token and finish on the engine's clock)."""
    cluster, (where,) = await sim_cluster(1, **SETTINGS)
    by_length = {a.max_tokens: a.request_id for a in scenario()}  # lengths are unique
    served: dict[str, SimRequest] = {}
    submit = cluster.driver.submit

    def record(index: int, request: SimRequest, waiter: TokenWaiter) -> None:
        served[by_length[request.max_tokens]] = request
        submit(index, request, waiter)

    monkeypatch.setattr(cluster.driver, "submit", record)
    seen = await run_real(where.url, scenario())
    assert served.keys() == seen.keys()
    assert all(r.finish_time is not None for r in served.values())
    return seen, served


def replay(arrival_times: dict[str, float]) -> dict[str, RequestResult]:
    """The scenario in virtual time, each request arriving at the time given for it."""
    by_id = {a.request_id: a for a in scenario()}
    arrivals = sorted(
        (dataclasses.replace(by_id[rid], time=t) for rid, t in arrival_times.items()),
        key=lambda a: a.time,
    )
    specs = build_fleet(count=1, cli=ServerSettings.model_validate(SETTINGS))
    virtual = VirtualFleet(specs).run(arrivals, lambda a, s, now: 0)
    assert all(r.finish is not None for r in virtual.requests)
    # The scenario exercises queueing and adapter swaps, not just idle decoding.
    assert max(r.ttft or 0.0 for r in virtual.requests) > 5 * STEP
    assert sum(r.adapter_loaded for r in virtual.requests) >= 1
    return {r.request_id: r for r in virtual.requests}


async def test_the_real_time_engine_keeps_the_virtual_schedule(
    sim_cluster: StartCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given the arrivals as the server stamped them, the real-time engine's first tokens and
    finishes are exactly the virtual fleet's, however late the loaded machine ran the driver;
    and the client, on the same clock, never sees a request before it arrived or a token before
    its step ended."""
    seen, served = await serve_scenario(sim_cluster, monkeypatch)
    expected = replay({rid: r.arrival for rid, r in served.items()})
    for rid, request in served.items():
        virtual, client = expected[rid], seen[rid]
        assert request.first_token_time == pytest.approx(virtual.first_token, abs=1e-6), rid
        assert request.finish_time == pytest.approx(virtual.finish, abs=1e-6), rid
        assert request.adapter_loaded == virtual.adapter_loaded, rid
        assert client.start <= request.arrival, rid
        assert request.first_token_time is not None
        assert request.first_token_time <= client.first_token, rid
        assert request.finish_time is not None
        assert request.finish_time <= client.end, rid


@pytest.mark.timing
async def test_real_time_and_virtual_time_agree(
    sim_cluster: StartCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a quiet machine, what the client sees (TTFT, end-to-end from the moment it sent)
    is within 5 % and a step and a half of the virtual fleet's: the real-time server's
    delivery lag is small. Opt-in (`make timing`): a loaded machine delays delivery."""
    seen, _ = await serve_scenario(sim_cluster, monkeypatch)
    t0 = min(s.start for s in seen.values())
    expected = replay({rid: s.start - t0 for rid, s in seen.items()})
    real = {rid: (s.first_token - s.start, s.end - s.start) for rid, s in seen.items()}
    for rid, result in expected.items():
        v_ttft, v_e2e = result.ttft or 0.0, result.e2e or 0.0
        r_ttft, r_e2e = real[rid]
        assert abs(r_e2e - v_e2e) <= 0.05 * v_e2e + 1.5 * STEP, (rid, r_e2e, v_e2e)
        assert abs(r_ttft - v_ttft) <= 0.05 * v_ttft + 1.5 * STEP, (rid, r_ttft, v_ttft)
    mean_real = statistics.mean(e for _, e in real.values())
    mean_virtual = statistics.mean(r.e2e or 0.0 for r in expected.values())
    assert mean_real == pytest.approx(mean_virtual, rel=0.05)
