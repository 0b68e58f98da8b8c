"""The Director with flow control (the real Datastore, scheduler, in-flight tracker, gate):
requests wait instead of failing, are dispatched late-bound when capacity frees, and every way
out of the queue (dispatch, TTL, client gone, full band) leaves nothing behind."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.datastore.endpoint import EndpointMetrics
from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import NoReadyEndpoint, QueueFull, QueueTimeout, RequestShed
from poolkeeper.flowcontrol.drainrate import DrainRate
from poolkeeper.requestcontrol.director import Director
from poolkeeper.requestcontrol.flowgate import FlowGate
from poolkeeper.requestcontrol.types import Usage
from poolkeeper.server.wiring import build_director
from tests.requestcontrol.test_rc_director import NOW, _chat, _store
from tests.support.waiting import settled

SHEDDABLE = Criticality.SHEDDABLE


def _director(store: Datastore, clock: list[float], **flow: Any) -> tuple[Director, FlowGate]:
    # Metrics stay fresh for a minute, so moving the clock tests TTLs, not staleness.
    spec = {"flowControl": flow, "scraping": {"stalenessMs": 60_000}}
    config = GatewayConfig.model_validate({"spec": spec})
    director = build_director(config, store, rng=random.Random(1), clock=lambda: clock[0])
    assert director.flow is not None
    return director, director.flow


async def test_a_saturated_pool_holds_sheddable_and_fresh_metrics_release_it() -> None:
    store = _store(waiting=50)
    clock = [NOW]
    director, gate = _director(store, clock)
    task = asyncio.create_task(director.route(_chat("cheap")))
    await settled(lambda: gate.waiting() == 1)
    assert not task.done()
    # Critical is never held (band mode `send`), even now.
    critical = await director.route(_chat("chat", rid="c"))
    assert critical.endpoints
    # A scrape shows room on one endpoint: the metrics write wakes the pump.
    store.update_metrics("10.0.0.3:8000", EndpointMetrics(waiting=0, updated_at=NOW))
    decision = await asyncio.wait_for(task, timeout=5)
    assert decision.endpoints[0] == "10.0.0.3:8000"  # late binding: scheduled on the fresh view
    assert gate.waiting() == 0
    assert gate.totals[(SHEDDABLE, "queued")] == 1
    assert gate.totals[(SHEDDABLE, "Dispatched")] == 1


async def test_a_queued_request_whose_pool_lost_its_endpoints_counts_rejected_other() -> None:
    """The pump lets it go (nothing to wait for), the scheduler answers 503: one outcome,
    RejectedOther, as every way out of flow control has one (it had none)."""
    store = _store(waiting=50)
    clock = [NOW]
    director, gate = _director(store, clock)
    task = asyncio.create_task(director.route(_chat("cheap")))
    await settled(lambda: gate.waiting() == 1)
    store.set_endpoints([])
    gate.pump()  # as its timer would
    with pytest.raises(NoReadyEndpoint):
        await asyncio.wait_for(task, timeout=5)
    assert gate.waiting() == 0
    assert gate.totals[(SHEDDABLE, "RejectedOther")] == 1
    assert gate.totals[(SHEDDABLE, "Dispatched")] == 0


async def test_completion_frees_exactly_one_slot() -> None:
    """Sheddable has room only where nothing waits (its queue threshold 1): one per endpoint."""
    store = _store(endpoints=[(1, "sim"), (2, "sim")], waiting=0)
    clock = [NOW]
    director, gate = _director(store, clock)
    first = await director.route(_chat("cheap", rid="a"))
    second = await director.route(_chat("cheap", rid="b"))
    assert {first.endpoints[0], second.endpoints[0]} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    waiting = [asyncio.create_task(director.route(_chat("cheap", rid=f"w{i}"))) for i in range(3)]
    await settled(lambda: gate.waiting() == 3)
    director.complete(first, status=200, usage=Usage(prompt_tokens=30, completion_tokens=5))
    await settled(lambda: waiting[0].done())
    assert gate.waiting() == 2  # FCFS, and only one slot freed
    assert not waiting[1].done()
    assert waiting[0].result().endpoints[0] == first.endpoints[0]
    for task in waiting[1:]:
        task.cancel()
    await asyncio.gather(*waiting[1:], return_exceptions=True)
    assert gate.waiting() == 0


async def test_ttl_answers_429_ttl_expired_with_the_model() -> None:
    store = _store(waiting=50)
    clock = [NOW]
    director, gate = _director(store, clock, bands={"sheddable": {"ttlMs": 1000}})
    task = asyncio.create_task(director.route(_chat("cheap")))
    await settled(lambda: gate.waiting() == 1)
    clock[0] += 0.5
    gate.pump()
    assert not task.done()
    assert gate.waiting() == 1
    clock[0] += 0.6
    gate.pump()
    with pytest.raises(QueueTimeout) as expired:
        await task
    # llm-d-router's answer while the pool has endpoints (GIE-era poolkeeper said 503).
    assert expired.value.http_status == 429
    assert expired.value.dropped_reason == "rejected-ttl-expired"
    assert expired.value.model == "cheap"
    assert gate.waiting() == 0
    assert gate.totals[(SHEDDABLE, "EvictedTTL")] == 1


async def test_a_standing_standard_queue_times_out_at_the_overload_ttl() -> None:
    """Standard's `overloadTtlMs: 300` applied whenever the queue stands (`onlyWhileGrowing`
    off): a burst may wait up to 3 s from when its model started waiting; once the queue has
    stood that long, each newcomer waits at most 300 ms, then 429."""
    store = _store(waiting=50)
    clock = [NOW]
    director, gate = _director(
        store, clock, bands={"standard": {"overloadTtlMs": 300, "onlyWhileGrowing": False}}
    )
    tasks: list[asyncio.Task[Any]] = []

    async def arrive(rid: str) -> None:
        tasks.append(asyncio.create_task(director.route(_chat("split", rid=rid))))
        await settled(lambda: gate.waiting() == sum(not t.done() for t in tasks))

    async def at(t: float, done: int) -> None:
        clock[0] = NOW + t
        gate.pump()
        await settled(lambda: sum(task.done() for task in tasks) == done)

    await arrive("burst")  # t = 0: the flow starts waiting, calm until 3.0
    clock[0] = NOW + 2.9
    await arrive("late")  # 2.9: max(3.2, 3.0)
    await at(3.05, done=1)
    clock[0] = NOW + 3.1
    await arrive("standing")  # 3.1: the queue has stood 3 s: 300 ms
    await at(3.25, done=2)
    await at(3.45, done=3)
    limits = []
    for task in tasks:
        with pytest.raises(QueueTimeout) as expired:
            await task
        assert expired.value.http_status == 429
        limits.append(str(expired.value).rsplit("its limit: ", 1)[1])
    assert limits == ["3000 ms)", "300 ms)", "300 ms)"]
    assert gate.waiting() == 0
    assert gate.totals[(Criticality.STANDARD, "EvictedTTL")] == 3


async def test_client_gone_leaves_the_queue_at_once() -> None:
    store = _store(waiting=50)
    director, gate = _director(store, [NOW])
    task = asyncio.create_task(director.route(_chat("cheap")))
    await settled(lambda: gate.waiting() == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.waiting() == 0
    assert gate.totals[(SHEDDABLE, "EvictedContextCancelled")] == 1
    assert all(requests == 0 and size == 0 for _p, _b, requests, size in gate.queue_stats())


async def test_a_decision_that_races_the_cancellation_is_completed() -> None:
    """Dispatched just as the client left: the in-flight accounting must not leak."""
    store = _store(waiting=50)
    director, gate = _director(store, [NOW])
    task = asyncio.create_task(director.route(_chat("cheap")))
    await settled(lambda: gate.waiting() == 1)
    store.update_metrics("10.0.0.1:8000", EndpointMetrics(waiting=0, updated_at=NOW))
    gate.pump()  # the decision is set on the future, the task has not resumed yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    inflight: Any = director.inflight
    assert len(inflight) == 0


async def test_full_band_and_shed_mode_answer_429() -> None:
    store = _store(waiting=50)
    director, gate = _director(
        store, [NOW], bands={"sheddable": {"maxRequests": 1}, "standard": {"mode": "shed"}}
    )
    task = asyncio.create_task(director.route(_chat("cheap", rid="a")))
    await settled(lambda: gate.waiting() == 1)
    with pytest.raises(QueueFull) as full:
        await director.route(_chat("cheap", rid="b"))
    assert full.value.http_status == 429
    with pytest.raises(RequestShed):
        await director.route(_chat("split", rid="s"))  # Standard, mode shed, no headroom
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_fairness_id_header_only_when_trusted() -> None:
    header = {"content-type": "application/json", "x-gateway-inference-fairness-id": "tenant-7"}
    for trusted, flow in (([], "cheap"), (["x-gateway-inference-fairness-id"], "tenant-7")):
        store = _store(waiting=50)
        config = GatewayConfig.model_validate(
            {"spec": {"requestHandling": {"trustedHeaders": trusted}}}
        )
        director = build_director(config, store, rng=random.Random(1), clock=lambda: NOW)
        gate = director.flow
        assert gate is not None
        task = asyncio.create_task(director.route(_chat("cheap", headers=header)))
        await settled(lambda gate=gate: gate.waiting() == 1)
        dispatcher = gate._pools["default/pool"]
        assert [i.flow for i in dispatcher.items(SHEDDABLE)] == [flow]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_disabled_flow_control_sheds_as_before() -> None:
    config = GatewayConfig.model_validate({"spec": {"flowControl": {"enabled": False}}})
    director = build_director(config, _store(waiting=50), rng=random.Random(1), clock=lambda: NOW)
    assert director.flow is None
    with pytest.raises(RequestShed):
        await director.route(_chat("cheap"))


async def test_queue_gauges_and_outcomes_are_exported_and_return_to_zero() -> None:
    from poolkeeper.telemetry.flowqueue import FlowQueue, QueueStats
    from poolkeeper.telemetry.metrics import GatewayMetrics

    gate_ref: list[FlowGate] = []

    def stats() -> list[QueueStats]:
        gate = gate_ref[0]
        return [
            QueueStats(
                pool.rpartition("/")[2],
                band,
                n,
                size,
                flows=tuple(
                    FlowQueue(*key, *value) for key, value in gate.queued_flows(pool, band).items()
                ),
            )
            for pool, band, n, size in gate.queue_stats()
        ]

    metrics = GatewayMetrics(flow_stats=stats)
    config = GatewayConfig.model_validate({"spec": {"scraping": {"stalenessMs": 60_000}}})
    director = build_director(
        config, _store(waiting=50), rng=random.Random(1), clock=lambda: NOW, flow_observer=metrics
    )
    assert director.flow is not None
    gate_ref.append(director.flow)
    task = asyncio.create_task(director.route(_chat("cheap")))
    await settled(lambda: director.flow is not None and director.flow.waiting() == 1)
    text = metrics.render().decode()
    size = (
        'inference_extension_flow_control_queue_size{fairness_id="cheap",inference_pool="pool",'
        'model_name="cheap",priority="0",target_model_name="cheap"}'
    )
    assert f"{size} 1.0" in text
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    text = metrics.render().decode()
    assert f"{size} 0.0" in text
    assert (
        "inference_extension_flow_control_request_queue_duration_seconds_count{"
        'fairness_id="cheap",inference_pool="pool",model_name="cheap",'
        'outcome="EvictedContextCancelled",priority="0",target_model_name="cheap"} 1.0'
    ) in text


@pytest.mark.parametrize(
    ("model", "dispatch", "to_holder"),
    [("split", "saturation", True), ("split", "slot", True), ("cheap", "slot", False)],
)
async def test_standard_keeps_its_prefix_server_sheddable_goes_where_the_headroom_is(
    model: str, dispatch: str, to_holder: bool
) -> None:
    # Standard with `dispatch: saturation` (`placement: scheduler`): a busy server holding
    # the prompt's prefix still gets it (narrowing to servers below the saturation limit cost
    # shared-prefix chat 19x its p90 TTFT). With `dispatch: slot` (the default since issue 35)
    # too while no other flow competes (uncontended: `FlowDispatcher.contended`); contended,
    # a request goes only where it can start (tests/bench/test_bench_fairshare.py).
    # Sheddable (`placement: headroom`): only servers below its limit.
    store = _store()
    clock = [NOW]
    director, _ = _director(store, clock, bands={"standard": {"dispatch": dispatch}})
    text = "the same long system prompt " * 40  # past the default profile's 8-block floor
    first = await director.route(_chat(model, rid="warm", text=text))
    holder = first.endpoints[0]
    director.complete(first, status=200, usage=None)
    # The holder is past both bands' limits (10 waiting: Standard saturation 2.0 > 1.2).
    store.update_metrics(holder, EndpointMetrics(waiting=10, updated_at=NOW))
    second = await director.route(_chat(model, rid="again", text=text))
    assert (second.endpoints[0] == holder) is to_holder
    director.complete(second, status=200, usage=None)


@pytest.mark.parametrize(("queued_adapters", "held"), [({"lora-x"}, False), ({"lora-a"}, True)])
async def test_a_server_running_the_target_adapter_has_room_past_deferred_requests(
    queued_adapters: set[str], held: bool
) -> None:
    """Every server has 50 waiting. sim-2 runs lora-a (the `split` model's target): if what
    waits there is another adapter's (deferred by vLLM for want of a slot), a lora-a request
    joins its batch now; if lora-a requests wait there too, the queue counts and it waits."""
    store = _store(waiting=50)
    store.update_metrics(
        "10.0.0.2:8000",
        EndpointMetrics(
            waiting=50,
            active_adapters=frozenset({"lora-a"}),
            waiting_adapters=frozenset(queued_adapters),
            updated_at=NOW,
        ),
    )
    director, gate = _director(store, [NOW])
    task = asyncio.create_task(director.route(_chat("split")))
    if held:
        await settled(lambda: gate.waiting() == 1)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return
    decision = await asyncio.wait_for(task, timeout=5)
    assert decision.target_model == "lora-a"
    assert decision.endpoints[0] == "10.0.0.2:8000"
    assert gate.totals[(Criticality.STANDARD, "queued")] == 0


async def test_a_queue_that_cannot_drain_in_time_refuses_with_429_rejected_saturated(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 35: refused before its TTL only when the queue ahead cannot drain within it at the
    measured rate: upstream's 429 `rejected-saturated`, and the log names the rule."""
    monkeypatch.setattr(DrainRate, "rate", lambda _self: 0.05)  # one request per 20 s
    store = _store(waiting=50)
    clock = [NOW]
    director, gate = _director(store, clock)
    queued = []
    for n, rid in enumerate(("a", "b"), start=1):  # 1 ahead, 20 s: within the 30 s TTL
        queued.append(asyncio.create_task(director.route(_chat("split", rid=rid))))
        await settled(lambda n=n: gate.waiting() == n)
    with (
        caplog.at_level("INFO", logger="poolkeeper.requestcontrol.flowgate"),
        pytest.raises(QueueFull) as refused,
    ):
        await asyncio.wait_for(director.route(_chat("split", rid="c")), 5)  # 2 ahead: 40 s
    assert refused.value.http_status == 429
    assert refused.value.dropped_reason == "rejected-saturated"
    assert "rule=cannot_drain" in caplog.text
    assert gate.waiting() == 2
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    assert gate.waiting() == 0


@pytest.mark.parametrize(
    ("avoid", "unless_cached", "to_holder"), [(256, None, False), (None, None, True),
                                              (256, 256, True), (256, 2000, False)],
)  # fmt: skip
async def test_critical_is_sent_away_from_a_long_prompt_just_sent(
    avoid: int | None, unless_cached: int | None, to_holder: bool
) -> None:
    # Critical (`send`, `avoidPrefillTokens: 256` by default): the server that was just sent
    # a long prompt (its prefill step likely still running) is left out while another has
    # none; without the setting the scheduler's prefix affinity takes it back there, and so
    # it does with `avoidPrefillUnlessCached` below the 480 tokens that server caches of it.
    store = _store()
    clock = [NOW]
    band = {"avoidPrefillTokens": avoid, "avoidPrefillUnlessCached": unless_cached}
    director, _ = _director(store, clock, holdNewPrefixes=None, bands={"critical": band})
    text = "the same long system prompt " * 80  # about 480 tokens
    first = await director.route(_chat("chat", rid="long", text=text))
    second = await director.route(_chat("chat", rid="again", text=text))
    assert (second.endpoints[0] == first.endpoints[0]) is to_holder
    director.complete(first, status=200, usage=None)
    director.complete(second, status=200, usage=None)
