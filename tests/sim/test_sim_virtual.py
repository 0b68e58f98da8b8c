"""The virtual-time fleet: routing callback, scrape staleness, determinism, scale."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.virtual import HOLD, Send, VirtualFleet
from poolkeeper.sim.virtual_results import Arrival, RequestResult

BASE = EngineConfig()
MODEL = BASE.model


def poisson(rate: float, seconds: float, seed: int, groups: int = 8) -> Iterator[Arrival]:
    rng = random.Random(seed)
    prefixes = [f"system prompt of group {g}. " * 30 for g in range(groups)]
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return
        i += 1
        prompt = rng.choice(prefixes) + f"question {i} " * 5
        yield Arrival(t, f"r{i}", MODEL, prompt, max_tokens=rng.randint(20, 200))


def least_inflight(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int:
    return min(range(len(states)), key=lambda i: (states[i].inflight_requests, i))


def test_same_seed_gives_identical_results() -> None:
    def once(seed: int) -> list[tuple[str, int, float | None, int]]:
        configs = [replace(BASE, step_jitter=0.05)] * 4
        fleet = VirtualFleet(configs, seed=seed)
        result = fleet.run(poisson(40, 5, seed=3), least_inflight)
        return [(r.request_id, r.server, r.finish, r.cached_tokens) for r in result.requests]

    first = once(1)
    assert len(first) > 150
    assert first == once(1)
    assert first != once(2)


def test_results_carry_latencies_prefix_hits_and_server_counters() -> None:
    fleet = VirtualFleet([BASE] * 3, seed=0)
    result = fleet.run(poisson(30, 5, seed=1, groups=2), least_inflight)
    done = [r for r in result.requests if r.status == "ok"]
    assert len(done) == len(result.requests)
    for r in done:
        assert r.ttft is not None
        assert r.e2e is not None
        assert 0 < r.ttft <= r.e2e
        assert r.finish_reason == "length"
        assert r.completion_tokens >= 20
    assert sum(r.cached_tokens for r in done) > 0  # two prompt groups over three servers
    assert sum(s.routed for s in result.servers) == len(done)
    assert sum(s.counters.prefix_hits for s in result.servers) == sum(r.cached_tokens for r in done)
    summary = result.summary()
    assert summary["completed"] == len(done)
    assert 0 < summary["ttft_p50"] <= summary["ttft_p99"]
    assert summary["prefix_hit_rate"] > 0.3


def test_router_sees_metrics_as_of_the_last_scrape_tick() -> None:
    seen: list[tuple[float, float, int, int, int]] = []

    def route(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int:
        s = states[0]
        seen.append((now, s.metrics.updated_at, s.metrics.running, s.inflight_requests,
                     s.unseen_requests))  # fmt: skip
        return 0

    arrivals = [Arrival(0.001 * i, f"r{i}", MODEL, "x" * 400, max_tokens=500) for i in range(5)]
    arrivals.append(Arrival(0.12, "late", MODEL, "y" * 400, max_tokens=5))
    VirtualFleet([BASE], scrape_interval=0.05).run(arrivals, route)
    # Within the first tick nothing is visible in the scraped metrics, only router-side counts.
    assert [x[2] for x in seen[:5]] == [0, 0, 0, 0, 0]
    assert [x[3] for x in seen[:5]] == [0, 1, 2, 3, 4]
    assert [x[4] for x in seen[:5]] == [0, 1, 2, 3, 4]
    _now, updated_at, running, inflight, unseen = seen[5]
    assert updated_at == pytest.approx(0.10)
    assert running == 5
    assert inflight == 5
    assert unseen == 0


@pytest.mark.parametrize("answers_seen", [True, False])
def test_unseen_requests_that_answered_are_shown_to_a_router_that_sees_answers(
    answers_seen: bool,
) -> None:
    seen: list[tuple[float, int, int]] = []

    def route(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int:
        seen.append((now, states[0].unseen_requests, states[0].unseen_answered))
        return 0

    # Two short prompts at once, then one 30 ms later within the same 1 s scrape tick: the
    # first two have their first token by then (one ~10 ms step), so they are running.
    arrivals = [
        Arrival(0.100, "a", MODEL, "x" * 40, max_tokens=50),
        Arrival(0.100, "b", MODEL, "y" * 40, max_tokens=50),
        Arrival(0.130, "c", MODEL, "z" * 40, max_tokens=50),
        Arrival(1.010, "d", MODEL, "w" * 40, max_tokens=5),  # after a scrape: nothing unseen
    ]
    fleet = VirtualFleet([BASE], scrape_interval=1.0, answers_seen=answers_seen)
    results = {r.request_id: r for r in fleet.run(arrivals, route).requests}
    assert results["b"].first_token is not None
    assert results["b"].first_token < 0.130
    assert seen[2][1] == 2  # a and b were routed since the last scrape
    assert seen[2][2] == (2 if answers_seen else 0)
    assert seen[3][1:] == (0, 0)


def test_fresh_scrapes_when_interval_is_zero() -> None:
    running_seen: list[int] = []

    def route(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int:
        running_seen.append(states[0].metrics.running)
        return 0

    arrivals = [Arrival(0.05 * i, f"r{i}", MODEL, "x" * 400, max_tokens=500) for i in range(3)]
    VirtualFleet([BASE], scrape_interval=0).run(arrivals, route)
    assert running_seen == [0, 1, 2]


def test_scrape_settings_have_one_home_and_cannot_be_changed_after_construction() -> None:
    fleet = VirtualFleet([BASE], scrape_interval=0.2, timestamp_refresh=0.5, answers_seen=True)
    assert (fleet.scrape_interval, fleet.timestamp_refresh, fleet.answers_seen) == (0.2, 0.5, True)
    # A later assignment would reach the fleet's copy and not the scraper that uses it.
    with pytest.raises(AttributeError):
        fleet.answers_seen = False  # type: ignore[misc]


def test_scraped_metrics_name_each_servers_base_model() -> None:
    # What a scraper reads from the `model_name` label, on fresh and on unchanged scrapes.
    other = replace(BASE, model="other/base-model")
    seen: list[tuple[str | None, ...]] = []

    def route(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int:
        seen.append(tuple(s.metrics.served_model for s in states))
        return 0

    arrivals = [Arrival(0.04 * i, f"r{i}", MODEL, "x" * 400, max_tokens=5) for i in range(8)]
    VirtualFleet([BASE, other], scrape_interval=0.05).run(arrivals, route)
    # Server 1 gets no traffic: after its first scrape only the time moves, the name stays.
    assert seen == [(MODEL, "other/base-model")] * 8


def test_rejections_errors_and_on_finish() -> None:
    finished: list[RequestResult] = []
    config = replace(BASE, lora_adapters=("a",))

    def route(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int | None:
        return None if arrival.request_id == "shed" else 0

    arrivals = [
        Arrival(0.0, "ok", "a", "hello", max_tokens=3, payload={"k": 1}),
        Arrival(0.1, "shed", MODEL, "hello", max_tokens=3),
        Arrival(0.2, "bad", "unknown-model", "hello", max_tokens=3),
    ]
    result = VirtualFleet([config]).run(arrivals, route, on_finish=finished.append)
    by_id = {r.request_id: r for r in result.requests}
    assert by_id["ok"].status == "ok"
    assert by_id["ok"].adapter_loaded
    assert by_id["ok"].payload == {"k": 1}
    assert by_id["shed"].status == "rejected"
    assert by_id["bad"].status == "error"
    assert "does not exist" in (by_id["bad"].error or "")
    assert [r.request_id for r in finished] == ["ok"]


def test_the_router_sees_its_in_flight_requests_by_target_model() -> None:
    """As the EPP's tracker counts them (flow control tells adapter-deferred requests apart)."""
    seen: list[dict[str, int]] = []

    def route(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int:
        seen.append(dict(states[0].inflight_models))
        return 0

    arrivals = [
        Arrival(0.0, "a1", "a", "hello", max_tokens=400),
        Arrival(0.001, "a2", "a", "hello", max_tokens=400),
        Arrival(0.002, "b1", MODEL, "hello", max_tokens=2),
        Arrival(5.0, "late", MODEL, "hello", max_tokens=2),
    ]
    VirtualFleet([replace(BASE, lora_adapters=("a",))]).run(arrivals, route)
    assert seen == [{}, {"a": 1}, {"a": 2}, {}]


def test_token_times_recorded_on_request() -> None:
    arrivals = [Arrival(0.0, "r", MODEL, "hello", max_tokens=4)]
    result = VirtualFleet([BASE]).run(arrivals, lambda a, s, n: 0, record_token_times=True)
    times = result.requests[0].token_times
    assert times is not None
    assert len(times) == 4
    assert times == sorted(times)
    assert result.requests[0].itl_max == pytest.approx(
        max(b - a for a, b in itertools.pairwise(times))
    )


def test_out_of_order_arrivals_and_bad_routes_are_errors() -> None:
    arrivals = [Arrival(1.0, "a", MODEL, "x"), Arrival(0.5, "b", MODEL, "x")]
    with pytest.raises(ValueError, match="time order"):
        VirtualFleet([BASE]).run(arrivals, lambda a, s, n: 0)
    with pytest.raises(IndexError):
        VirtualFleet([BASE]).run([Arrival(0.0, "a", MODEL, "x")], lambda a, s, n: 5)


def test_a_large_fleet_runs_many_requests() -> None:
    fleet = VirtualFleet([replace(BASE, max_num_seqs=32)] * 300, seed=0)
    rng = random.Random(5)
    arrivals = (
        Arrival(i * 0.001, f"r{i}", MODEL, f"p{i % 50} " * 100, max_tokens=rng.randint(5, 30))
        for i in range(6000)
    )
    result = fleet.run(arrivals, lambda a, s, n: int(a.request_id[1:]) % 300)
    assert sum(1 for r in result.requests if r.finish is not None) == 6000
    assert len({r.server for r in result.requests}) == 300


@pytest.mark.parametrize(
    "config",
    [
        BASE,
        replace(BASE, num_gpu_blocks=40, max_num_seqs=8),  # KV pressure: preemptions
        replace(BASE, lora_adapters=("a", "b"), max_loras=1),
    ],
    ids=["plain", "kv-pressure", "lora"],
)
def test_fused_decode_steps_change_nothing_but_speed(config: EngineConfig) -> None:
    def once(fuse: int) -> list[tuple[str, int, float, float, int, int, float]]:
        rng = random.Random(4)
        arrivals = []
        t = 0.0
        for i in range(300):
            t += rng.expovariate(20)
            model = rng.choice(("a", "b", MODEL)) if config.lora_adapters else MODEL
            prompt = f"group {i % 4} " * 60 + f"q{i}"
            arrivals.append(Arrival(t, f"r{i}", model, prompt, max_tokens=rng.randint(1, 120)))
        fleet = VirtualFleet([config] * 3, seed=1, fuse_decode_steps=fuse)
        result = fleet.run(arrivals, lambda a, s, n: int(a.request_id[1:]) % 3)
        return [
            (r.request_id, r.server, r.first_token or 0.0, r.finish or 0.0, r.cached_tokens,
             r.preemptions, r.itl_max)
            for r in result.requests
        ]  # fmt: skip

    stepwise, fused = once(1), once(64)
    assert len(stepwise) == 300
    for a, b in zip(stepwise, fused, strict=True):
        assert a[:2] == b[:2]
        assert a[2] == pytest.approx(b[2], abs=1e-9)
        assert a[3] == pytest.approx(b[3], abs=1e-9)
        assert a[4:6] == b[4:6]
        assert a[6] == pytest.approx(b[6], abs=1e-9)
    if config.num_gpu_blocks == 40:
        assert sum(x[5] for x in stepwise) > 0


def test_a_router_can_hold_arrivals_and_release_them_later() -> None:
    """HOLD keeps an arrival in the router; `release` runs after completions and at scrape
    ticks while something is held; a released request's TTFT counts from its arrival."""
    held: list[str] = []
    calls: list[float] = []

    def route(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int | None:
        if states[0].inflight_requests >= 2:
            held.append(arrival.request_id)
            return HOLD
        return 0

    def release(states: Sequence[EndpointState], now: float, send: Send) -> None:
        calls.append(now)
        while held and states[0].inflight_requests < 2:
            send(held.pop(0), 0, None)  # states update before send returns
        if held and now > 3.0:
            send(held.pop(), None, "expired")

    arrivals = [Arrival(0.01 * i, f"r{i}", MODEL, "hello " * 20, max_tokens=50) for i in range(8)]
    result = VirtualFleet([BASE], seed=1).run(arrivals, route, release=release)
    statuses = {r.request_id: r.status for r in result.requests}
    assert list(statuses.values()).count("ok") >= 6
    assert all(s in ("ok", "rejected") for s in statuses.values())
    assert not held
    assert calls == sorted(calls)
    late = [r for r in result.requests if r.status == "ok" and r.request_id not in ("r0", "r1")]
    assert all(r.ttft is not None and r.ttft > 0.05 for r in late)  # they waited for a slot
    first = {r.request_id: r for r in result.requests}
    assert first["r0"].ttft is not None
    assert first["r0"].ttft < min(r.ttft for r in late if r.ttft is not None)


def test_release_on_first_token_releases_when_a_prefill_ends() -> None:
    """With `release_on_first_token` the fleet asks the router again when a request's first
    token is out (the EPP wakes its pump on each first byte), not only after completions and at
    scrape ticks: a request held until the first one's prefill ends goes at that moment."""

    def run(on_first: bool) -> dict[str, RequestResult]:
        firsts: list[float] = []
        held: list[str] = []

        def route(arrival: Arrival, states: Sequence[EndpointState], now: float) -> int | None:
            if arrival.request_id == "r0":
                return 0
            held.append(arrival.request_id)
            return HOLD

        def release(states: Sequence[EndpointState], now: float, send: Send) -> None:
            if firsts and held:
                send(held.pop(0), 0, None)

        def first_token(result: RequestResult) -> None:
            firsts.append(result.first_token or 0.0)

        arrivals = [  # a long answer: r0 finishes long after its first token
            Arrival(0.0, "r0", MODEL, "hello " * 400, max_tokens=400),
            Arrival(0.001, "r1", MODEL, "hello " * 20, max_tokens=4),
        ]
        result = VirtualFleet([BASE], seed=1, scrape_interval=1.0).run(
            arrivals, route, release=release, on_first_token=first_token,
            release_on_first_token=on_first,
        )  # fmt: skip
        return {r.request_id: r for r in result.requests}

    woken, polled = run(True), run(False)
    first = woken["r0"].first_token
    assert first is not None
    assert first < 0.5
    assert woken["r1"].first_token is not None
    assert woken["r1"].first_token < first + 0.1
    # Without it, r1 waits for the next scrape tick (1 s).
    assert polled["r1"].first_token is not None
    assert polled["r1"].first_token >= 1.0


def test_holding_without_release_is_an_error() -> None:
    with pytest.raises(ValueError, match="release"):
        VirtualFleet([BASE], seed=1).run([Arrival(0.0, "r0", MODEL, "hi")], lambda a, s, n: HOLD)


def test_follow_adds_arrivals_a_closed_loop_of_clients() -> None:
    """`follow` returns each client's next request when its answer (or refusal) comes back;
    the run ends when the clients stop."""
    fleet = VirtualFleet([EngineConfig(max_num_seqs=1)], seed=1)
    sent: list[float] = []

    def follow(result: RequestResult, now: float) -> list[Arrival]:
        sent.append(now)
        if len(sent) >= 5:
            return []
        return [Arrival(now, f"r{len(sent)}", EngineConfig().model, "hi", max_tokens=4)]

    def route(a: Arrival, states: Sequence[EndpointState], now: float) -> int | None:
        return None if a.request_id == "r2" else 0  # one refusal: its client sends again

    result = fleet.run([Arrival(0.0, "r0", EngineConfig().model, "hi", max_tokens=4)], route,
                       follow=follow)  # fmt: skip
    assert [r.request_id for r in result.requests] == ["r0", "r1", "r2", "r3", "r4"]
    assert [r.status for r in result.requests] == ["ok", "ok", "rejected", "ok", "ok"]
    assert sent == sorted(sent)
    assert sent[2] == sent[1]  # the refusal came back at once
    with pytest.raises(ValueError, match="follow returned"):
        VirtualFleet([EngineConfig()], seed=1).run(
            [Arrival(1.0, "a", EngineConfig().model, "hi", max_tokens=2)],
            lambda a, s, n: 0,
            follow=lambda r, now: [Arrival(0.0, "b", EngineConfig().model, "hi")],
        )
