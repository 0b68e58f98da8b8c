"""The Director: errors and their statuses, model resolution, candidates, bookkeeping."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.api.model import InferenceModel
from poolkeeper.config.gateway import RequestHandling, UnknownModelPolicy
from poolkeeper.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    NoReadyEndpoint,
    NoValidTargetModel,
    PayloadTooLarge,
    RequestShed,
)
from poolkeeper.requestcontrol.director import Director, Ticket
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision, Usage
from poolkeeper.scheduling.types import (
    Endpoint,
    EndpointMetrics,
    EndpointState,
    LLMRequest,
    SchedulingResult,
)

POOL = "default/pool"
OTHER_POOL = "default/other"


def _model(
    name: str,
    *,
    pool: str = "pool",
    criticality: str | None = None,
    targets: list[dict[str, Any]] | None = None,
    created: str | None = None,
    object_name: str | None = None,
) -> InferenceModel:
    meta: dict[str, Any] = {"name": object_name or name.replace("_", "-")}
    if created is not None:
        meta["creationTimestamp"] = created
    spec: dict[str, Any] = {"modelName": name, "poolRef": {"name": pool}}
    if criticality is not None:
        spec["criticality"] = criticality
    if targets is not None:
        spec["targetModels"] = targets
    return InferenceModel.model_validate(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "InferenceModel",
            "metadata": meta,
            "spec": spec,
        }
    )


def _state(i: int, *, waiting: int = 0, updated_at: float = 100.0) -> EndpointState:
    return EndpointState(
        endpoint=Endpoint(name=f"sim-{i}", address=f"10.0.0.{i}", port=8000),
        metrics=EndpointMetrics(waiting=waiting, updated_at=updated_at),
    )


@dataclass
class FakeSnapshot:
    states_by_pool: dict[str, list[EndpointState]]
    models_by_pool: dict[str, dict[str, InferenceModel]] = field(default_factory=dict)

    def pool_keys(self) -> Sequence[str]:
        return list(self.states_by_pool)

    def models(self, pool_key: str) -> Mapping[str, InferenceModel]:
        return self.models_by_pool.get(pool_key, {})

    def states(self, pool_key: str) -> Sequence[EndpointState]:
        return self.states_by_pool.get(pool_key, [])


@dataclass
class FakeStore:
    current: FakeSnapshot

    def snapshot(self) -> FakeSnapshot:
        return self.current


class FakeInflight:
    def __init__(self) -> None:
        self.open: dict[str, tuple[str, int]] = {}
        self.finished: list[str] = []

    def start(self, request_id: str, endpoint_key: str, tokens: int, now: float) -> None:
        assert request_id not in self.open
        self.open[request_id] = (endpoint_key, tokens)

    def finish(self, request_id: str) -> None:
        self.finished.append(request_id)
        self.open.pop(request_id, None)

    def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]:
        counts: dict[str, int] = {}
        for key, _ in self.open.values():
            counts[key] = counts.get(key, 0) + 1
        return [replace(s, inflight_requests=counts.get(s.key, 0)) for s in states]


class LeastLoadedScheduler:
    """Orders candidates by waiting + in-flight, then key (deterministic)."""

    def __init__(self) -> None:
        self.seen: list[tuple[LLMRequest, list[EndpointState]]] = []

    def schedule(
        self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
    ) -> SchedulingResult:
        self.seen.append((request, list(candidates)))
        ordered = sorted(candidates, key=lambda s: (s.metrics.waiting + s.inflight_requests, s.key))
        return SchedulingResult(targets=tuple(ordered))


class SaturationAdmission:
    """Sheds non-critical requests when no candidate has waiting <= 5."""

    def admit(self, request: LLMRequest, states: Sequence[EndpointState], *, now: float) -> None:
        if request.criticality is Criticality.CRITICAL:
            return
        if not any(s.metrics.waiting <= 5 for s in states):
            raise RequestShed("pool is saturated")


@dataclass
class Rig:
    director: Director
    store: FakeStore
    inflight: FakeInflight
    scheduler: LeastLoadedScheduler
    clock: list[float]


def _rig(
    snapshot: FakeSnapshot | None = None,
    config: RequestHandling | None = None,
    scheduler: Any = None,
) -> Rig:
    if snapshot is None:
        snapshot = FakeSnapshot(
            {POOL: [_state(i) for i in range(1, 5)]},
            {
                POOL: {
                    "chat": _model("chat", criticality="Critical"),
                    "split": _model(
                        "split",
                        targets=[{"name": "lora-a", "weight": 1}, {"name": "lora-b", "weight": 0}],
                    ),
                    "cheap": _model("cheap", criticality="Sheddable"),
                    "dead": _model(
                        "dead",
                        targets=[{"name": "x", "weight": 0}, {"name": "y", "weight": 0}],
                    ),
                }
            },
        )
    store = FakeStore(snapshot)
    inflight = FakeInflight()
    sched = scheduler or LeastLoadedScheduler()
    clock = [100.5]
    director = Director(
        datastore=store,
        scheduler=sched,
        inflight=inflight,
        admission=SaturationAdmission(),
        config=config or RequestHandling(),
        rng=random.Random(1),
        clock=lambda: clock[0],
    )
    return Rig(director, store, inflight, sched, clock)


def _chat(
    model: str = "chat",
    *,
    rid: str = "r1",
    stream: bool = False,
    extra: dict[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    subset: tuple[str, ...] | None = None,
) -> IncomingRequest:
    body = {"model": model, "messages": [{"role": "user", "content": "hi " * 40}], **(extra or {})}
    if stream:
        body["stream"] = True
    return IncomingRequest(
        request_id=rid,
        method="POST",
        path="/v1/chat/completions",
        headers=headers or {"content-type": "application/json"},
        body=json.dumps(body).encode(),
        subset_hint=subset,
    )


async def test_routes_a_known_model() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat())
    assert decision.endpoints == ("10.0.0.1:8000", "10.0.0.2:8000")  # primary + 1 fallback
    assert decision.pool == POOL
    assert (decision.model_name, decision.target_model) == ("chat", "chat")
    assert decision.criticality is Criticality.CRITICAL
    assert decision.body is None  # nothing to rewrite
    assert decision.prompt_tokens > 0
    assert rig.inflight.open == {"r1": ("10.0.0.1:8000", decision.prompt_tokens)}
    request, candidates = rig.scheduler.seen[-1]
    assert request.prompt.startswith("<|im_start|>user\nhi hi")
    assert request.prompt_tokens == decision.prompt_tokens
    assert len(candidates) == 4


async def test_in_flight_load_reaches_the_scheduler() -> None:
    rig = _rig()
    first = await rig.director.route(_chat(rid="a"))
    second = await rig.director.route(_chat(rid="b"))
    assert first.endpoints[0] != second.endpoints[0]  # the first request counts as load
    _, candidates = rig.scheduler.seen[-1]
    assert {s.key: s.inflight_requests for s in candidates}[first.endpoints[0]] == 1


async def test_fallback_count_follows_config() -> None:
    for fallbacks in (0, 2, 8):
        rig = _rig(config=RequestHandling(fallback_endpoints=fallbacks))
        decision = await rig.director.route(_chat())
        assert len(decision.endpoints) == min(1 + fallbacks, 4)
        assert len(set(decision.endpoints)) == len(decision.endpoints)


async def test_split_rewrites_the_model_in_the_body() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat("split", extra={"temperature": 0.5}))
    assert decision.target_model == "lora-a"  # lora-b has weight 0
    assert decision.body is not None
    body = json.loads(decision.body)
    assert body["model"] == "lora-a"
    assert body["temperature"] == 0.5
    assert rig.scheduler.seen[-1][0].target_model == "lora-a"
    assert rig.scheduler.seen[-1][0].model == "split"
    assert decision.criticality is Criticality.STANDARD  # unset means Standard


async def test_stream_usage_injected_and_recorded() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat(stream=True))
    assert decision.stream is True
    assert decision.include_usage_injected is True
    assert decision.body is not None
    assert json.loads(decision.body)["stream_options"] == {"include_usage": True}

    asked = await rig.director.route(
        _chat(rid="r2", stream=True, extra={"stream_options": {"include_usage": True}})
    )
    assert (asked.include_usage_injected, asked.body) == (False, None)

    off = _rig(config=RequestHandling(inject_stream_usage=False))
    decision = await off.director.route(_chat(stream=True))
    assert (decision.include_usage_injected, decision.body) == (False, None)


@pytest.mark.parametrize(
    ("request_", "error", "status"),
    [
        (_chat(extra={"model": None}), BadRequest, 400),
        (
            IncomingRequest("r", "POST", "/v1/completions", {}, b"{not json"),
            BadRequest,
            400,
        ),
        (_chat("nope"), ModelNotFound, 404),
        (_chat("dead"), NoValidTargetModel, 404),
    ],
)
async def test_request_errors(
    request_: IncomingRequest, error: type[GatewayError], status: int
) -> None:
    rig = _rig()
    with pytest.raises(error) as info:
        await rig.director.route(request_)
    assert info.value.http_status == status
    assert rig.inflight.open == {}


async def test_unknown_model_message_names_the_model() -> None:
    with pytest.raises(ModelNotFound, match="model 'nope' not found"):
        await _rig().director.route(_chat("nope"))


async def test_body_over_the_limit_is_413() -> None:
    rig = _rig(config=RequestHandling(max_body_bytes=1024))
    with pytest.raises(PayloadTooLarge) as info:
        await rig.director.route(_chat(extra={"pad": "x" * 2000}))
    assert info.value.http_status == 413


async def test_unknown_model_passthrough_as_sheddable() -> None:
    config = RequestHandling(unknown_model_policy=UnknownModelPolicy.PASSTHROUGH_SHEDDABLE)
    rig = _rig(config=config)
    decision = await rig.director.route(_chat("mystery"))
    assert decision.pool == POOL
    assert decision.criticality is Criticality.SHEDDABLE
    assert (decision.model_name, decision.target_model, decision.body) == (
        "mystery",
        "mystery",
        None,
    )
    assert rig.scheduler.seen[-1][0].criticality is Criticality.SHEDDABLE


async def test_saturated_pool_sheds_sheddable_but_not_critical() -> None:
    saturated = FakeSnapshot(
        {POOL: [_state(i, waiting=50) for i in range(1, 3)]},
        {POOL: {"chat": _model("chat", criticality="Critical"), "cheap": _model("cheap")}},
    )
    rig = _rig(saturated)
    with pytest.raises(RequestShed) as info:
        await rig.director.route(_chat("cheap"))
    assert info.value.http_status == 429
    assert rig.inflight.open == {}
    decision = await rig.director.route(_chat("chat", rid="r2"))
    assert decision.endpoints


async def test_no_endpoints_is_503() -> None:
    rig = _rig(FakeSnapshot({POOL: []}, {POOL: {"chat": _model("chat")}}))
    with pytest.raises(NoReadyEndpoint, match="no ready endpoint") as info:
        await rig.director.route(_chat())
    assert info.value.http_status == 503


async def test_scheduler_with_no_result_is_503() -> None:
    class Empty:
        def schedule(
            self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
        ) -> SchedulingResult:
            return SchedulingResult(targets=())

    with pytest.raises(NoReadyEndpoint):
        await _rig(scheduler=Empty()).director.route(_chat())


async def test_scheduler_bug_becomes_a_clean_500() -> None:
    class Broken:
        def schedule(
            self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
        ) -> SchedulingResult:
            raise KeyError("bug")

    with pytest.raises(GatewayError) as info:
        await _rig(scheduler=Broken()).director.route(_chat())
    assert type(info.value) is GatewayError
    assert info.value.http_status == 500
    assert "bug" not in info.value.message


async def test_subset_hint_restricts_candidates_by_ip() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat(subset=("10.0.0.3:8000", "10.0.0.4:9999")))
    assert set(decision.endpoints) == {"10.0.0.3:8000", "10.0.0.4:8000"}
    assert rig.scheduler.seen[-1][0].subset == frozenset({"10.0.0.3:8000", "10.0.0.4:9999"})
    assert {s.key for s in rig.scheduler.seen[-1][1]} == {"10.0.0.3:8000", "10.0.0.4:8000"}


@pytest.mark.parametrize("subset", [(), ("192.168.9.9:8000",)])
async def test_empty_or_foreign_subset_is_503(subset: tuple[str, ...]) -> None:
    with pytest.raises(NoReadyEndpoint, match="subset"):
        await _rig().director.route(_chat(subset=subset))


async def test_subset_hint_ignored_when_disabled() -> None:
    rig = _rig(config=RequestHandling(honor_subset_hint=False))
    decision = await rig.director.route(_chat(subset=()))
    assert decision.endpoints[0] == "10.0.0.1:8000"
    assert rig.scheduler.seen[-1][0].subset is None


async def test_client_control_headers_never_reach_the_scheduler() -> None:
    headers = {
        "x-gateway-destination-endpoint": "169.254.169.254:80",
        "x-gateway-destination-endpoint-subset": "10.0.0.4:8000",
        "x-gateway-inference-objective": "vip",
        "authorization": "Bearer t",
    }
    rig = _rig()
    decision = await rig.director.route(_chat(headers=headers))
    assert decision.endpoints[0] == "10.0.0.1:8000"
    assert dict(rig.scheduler.seen[-1][0].headers) == {"authorization": "Bearer t"}
    assert rig.scheduler.seen[-1][0].subset is None


async def test_header_only_request_goes_to_a_random_ready_endpoint() -> None:
    rig = _rig()
    seen: set[str] = set()
    for i in range(40):
        request = IncomingRequest(f"g{i}", "GET", "/v1/models", {})
        decision = await rig.director.route(request)
        assert decision.pool == POOL
        assert len(decision.endpoints) == 2
        assert len(set(decision.endpoints)) == 2
        assert decision.model_name == ""
        seen.add(decision.endpoints[0])
        rig.director.complete(decision, status=200, usage=None)
    assert seen == {f"10.0.0.{i}:8000" for i in range(1, 5)}
    assert rig.scheduler.seen == []  # no scheduling, no admission, no in-flight accounting
    assert rig.inflight.open == {}
    assert rig.inflight.finished == []


async def test_header_only_request_with_no_endpoints_is_503() -> None:
    rig = _rig(FakeSnapshot({POOL: []}))
    with pytest.raises(NoReadyEndpoint):
        await rig.director.route(IncomingRequest("g", "GET", "/v1/models", {}))
    with pytest.raises(NoReadyEndpoint, match="no InferencePool"):
        await _rig(FakeSnapshot({})).director.route(IncomingRequest("g", "GET", "/", {}))


async def test_default_pool_for_header_only_and_passthrough() -> None:
    snapshot = FakeSnapshot(
        {POOL: [_state(1)], OTHER_POOL: [_state(7)]}, {POOL: {}, OTHER_POOL: {}}
    )
    rig = _rig(snapshot)
    bodyless = await rig.director.route(IncomingRequest("g", "GET", "/", {}))
    assert bodyless.pool == OTHER_POOL  # first by key ("default/other" < "default/pool")
    config = RequestHandling(
        default_pool="pool", unknown_model_policy=UnknownModelPolicy.PASSTHROUGH_SHEDDABLE
    )
    rig = _rig(snapshot, config=config)
    assert (await rig.director.route(IncomingRequest("g", "GET", "/", {}))).pool == POOL
    assert (await rig.director.route(_chat("anything"))).endpoints == ("10.0.0.1:8000",)
    missing = _rig(snapshot, config=RequestHandling(default_pool="ns/missing"))
    with pytest.raises(NoReadyEndpoint, match="default pool ns/missing is not loaded"):
        await missing.director.route(IncomingRequest("g", "GET", "/", {}))


async def test_model_in_two_pools_goes_to_the_oldest() -> None:
    older = _model("chat", pool="other", created="2025-01-01T00:00:00Z", object_name="b")
    newer = _model("chat", pool="pool", created="2025-06-01T00:00:00Z", object_name="a")
    snapshot = FakeSnapshot(
        {POOL: [_state(1)], OTHER_POOL: [_state(2)]},
        {POOL: {"chat": newer}, OTHER_POOL: {"chat": older}},
    )
    decision = await _rig(snapshot).director.route(_chat())
    assert decision.pool == OTHER_POOL
    assert decision.endpoints == ("10.0.0.2:8000",)
    swapped = FakeSnapshot(snapshot.states_by_pool, {POOL: {"chat": older}, OTHER_POOL: {}})
    assert (await _rig(swapped).director.route(_chat())).pool == POOL


async def test_new_snapshot_is_seen_immediately() -> None:
    rig = _rig()
    assert "late" not in rig.director.model_names()
    models = dict(rig.store.current.models_by_pool[POOL])
    models["late"] = _model("late")
    rig.store.current = FakeSnapshot(rig.store.current.states_by_pool, {POOL: models})
    assert "late" in rig.director.model_names()
    assert (await rig.director.route(_chat("late"))).model_name == "late"


async def test_complete_is_idempotent_and_finishes_in_flight() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat())
    usage = Usage(prompt_tokens=30, completion_tokens=5)
    rig.director.complete(decision, status=200, usage=usage)
    rig.director.complete(decision, status=200, usage=usage)
    rig.director.complete(decision, status=None, usage=None)
    assert rig.inflight.finished == ["r1"]
    assert rig.inflight.open == {}
    assert isinstance(decision.ticket, Ticket)
    assert decision.ticket.done


async def test_served_fallback_moves_in_flight_accounting() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat())
    primary, fallback = decision.endpoints
    rig.director.served(decision, "1.2.3.4:80")  # not in the decision: ignored
    assert rig.inflight.open["r1"][0] == primary
    rig.director.served(decision, fallback)
    assert rig.inflight.open["r1"] == (fallback, decision.prompt_tokens)
    rig.director.complete(decision, status=200, usage=None, served_endpoint=fallback)
    assert rig.inflight.open == {}
    rig.director.served(decision, primary)  # after completion: nothing moves
    assert rig.inflight.open == {}


async def test_complete_with_served_fallback_and_foreign_tickets() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat())
    rig.director.complete(decision, status=502, usage=None, served_endpoint=decision.endpoints[1])
    assert rig.inflight.open == {}
    assert rig.inflight.finished == ["r1"]
    stranger = RoutingDecision(request_id="x", endpoints=("1.1.1.1:1",), pool=POOL)
    rig.director.complete(stranger, status=200, usage=None)  # no ticket: nothing to do
    assert rig.inflight.finished == ["r1"]


def test_model_names_across_pools() -> None:
    snapshot = FakeSnapshot(
        {POOL: [], OTHER_POOL: []},
        {POOL: {"b": _model("b"), "a": _model("a")}, OTHER_POOL: {"c": _model("c", pool="other")}},
    )
    assert _rig(snapshot).director.model_names() == ["a", "b", "c"]


def test_ready_needs_an_endpoint_with_fresh_metrics() -> None:
    rig = _rig(FakeSnapshot({POOL: [_state(1, updated_at=100.0)]}))
    rig.clock[0] = 101.0
    assert rig.director.ready()
    rig.clock[0] = 103.0  # older than the 2 s freshness window
    assert not rig.director.ready()
    assert not _rig(FakeSnapshot({POOL: [_state(1, updated_at=0.0)]})).director.ready()
    assert not _rig(FakeSnapshot({})).director.ready()
