"""The Director with the real Datastore, scheduler, admission controller and in-flight tracker:
errors and their statuses, model resolution, candidates, bookkeeping."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.pool import InferencePool
from poolkeeper.config.gateway import GatewayConfig, RequestHandling, UnknownModelPolicy
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.datastore.models import ModelResource, ModelRoute
from poolkeeper.datastore.snapshot import EndpointSpec
from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    NoReadyEndpoint,
    NoValidTargetModel,
    PayloadTooLarge,
    RequestShed,
)
from poolkeeper.flowcontrol.shedding import AdmissionController
from poolkeeper.requestcontrol.director import Director
from poolkeeper.requestcontrol.prepare import scheduler_headers
from poolkeeper.requestcontrol.sends import Ticket
from poolkeeper.requestcontrol.shedgate import ShedGate
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision, Usage
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.replicasync.events import Sent
from poolkeeper.scheduling.replicasync.peerunseen import PeerUnseen
from poolkeeper.scheduling.types import LLMRequest, SchedulingResult
from poolkeeper.server.wiring import build_director

POOL = "default/pool"
OTHER_POOL = "default/other"
SCRAPED_AT = 100.0
NOW = 100.05  # within the admission detector's 200 ms freshness window


def _pool(name: str, app: str) -> InferencePool:
    return InferencePool.model_validate(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {
                "selector": {"app": app},
                "targetPortNumber": 8000,
                "extensionRef": {"name": "epp"},
            },
        }
    )


def _model(
    name: str,
    *,
    pool: str = "pool",
    criticality: str | None = None,
    targets: list[dict[str, Any]] | None = None,
    created: str | None = None,
    object_name: str | None = None,
) -> InferenceModel:
    meta: dict[str, Any] = {"name": object_name or name}
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


DEFAULT_MODELS = (
    _model("chat", criticality="Critical"),
    _model("split", targets=[{"name": "lora-a", "weight": 1}, {"name": "lora-b", "weight": 0}]),
    _model("cheap", criticality="Sheddable"),
    _model("dead", targets=[{"name": "x", "weight": 0}, {"name": "y", "weight": 0}]),
)


def _store(
    *,
    pools: Mapping[str, str] | None = None,
    endpoints: Sequence[tuple[int, str]] | None = None,
    models: Sequence[ModelResource] = DEFAULT_MODELS,
    waiting: int = 0,
    scraped_at: float = SCRAPED_AT,
) -> Datastore:
    """pools: name -> app label; endpoints: (i, app) -> sim-i at 10.0.0.i (pool port 8000)."""
    pools = {"pool": "sim"} if pools is None else pools
    endpoints = [(i, "sim") for i in range(1, 5)] if endpoints is None else endpoints
    store = Datastore()
    store.set_resources([_pool(name, app) for name, app in pools.items()], models)
    store.set_endpoints(
        [EndpointSpec(f"sim-{i}", f"10.0.0.{i}", labels={"app": app}) for i, app in endpoints]
    )
    for i, app in endpoints:
        metrics = EndpointMetrics(waiting=waiting, updated_at=scraped_at)
        selected = store.update_metrics(f"10.0.0.{i}:8000", metrics)
        assert selected == (app in pools.values())
    return store


class Recording:
    """Wraps a scheduler and remembers what it was asked."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: list[tuple[LLMRequest, list[EndpointState]]] = []

    def schedule(
        self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
    ) -> SchedulingResult:
        self.seen.append((request, list(candidates)))
        result: SchedulingResult = self.inner.schedule(request, candidates, now=now)
        return result


@dataclass
class Rig:
    director: Director
    store: Datastore
    inflight: InflightTracker
    scheduler: Recording
    clock: list[float]


def _rig(
    store: Datastore | None = None,
    config: RequestHandling | None = None,
    scheduler: Any = None,
    responses_observed: bool = False,
) -> Rig:
    store = store if store is not None else _store()
    inflight = InflightTracker()
    rng = random.Random(1)
    recording = Recording(scheduler or build_scheduler(SchedulingConfig(), rng=rng))
    clock = [NOW]
    director = Director(
        datastore=store,
        scheduler=recording,
        inflight=inflight,
        gate=ShedGate(AdmissionController(), clock=lambda: clock[0]),
        config=config or RequestHandling(),
        rng=rng,
        clock=lambda: clock[0],
        responses_observed=responses_observed,
    )
    return Rig(director, store, inflight, recording, clock)


def _bare(scheduler: Any) -> Director:
    """A Director around `scheduler` itself (no recording wrapper), the default store, shed
    gate and handling, at NOW."""
    return Director(
        datastore=_store(),
        scheduler=scheduler,
        inflight=InflightTracker(),
        gate=ShedGate(AdmissionController(), clock=lambda: NOW),
        config=RequestHandling(),
        rng=random.Random(1),
        clock=lambda: NOW,
    )


def _chat(
    model: str = "chat",
    *,
    rid: str = "r1",
    stream: bool = False,
    extra: dict[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    subset: tuple[str, ...] | None = None,
    text: str = "hi " * 40,
) -> IncomingRequest:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **(extra or {})}
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


ALL = {f"10.0.0.{i}:8000" for i in range(1, 5)}


async def test_routes_a_known_model() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat())
    assert len(decision.endpoints) == 4  # the pick + 3 fallbacks (default), all distinct
    assert set(decision.endpoints) == ALL
    assert decision.pool == POOL
    assert (decision.model_name, decision.target_model) == ("chat", "chat")
    assert decision.criticality is Criticality.CRITICAL
    assert decision.body is None  # nothing to rewrite
    assert decision.prompt_tokens > 0
    assert len(rig.inflight) == 1
    assert rig.inflight.counts(decision.endpoints[0]) == (1, decision.prompt_tokens)
    request, candidates = rig.scheduler.seen[-1]
    assert request.prompt.startswith("<|im_start|>user\nhi hi")
    assert request.prompt_tokens == decision.prompt_tokens
    assert {s.key for s in candidates} == ALL


async def test_in_flight_load_reaches_the_scheduler() -> None:
    rig = _rig()
    first = await rig.director.route(_chat(rid="a", text="first prompt " * 30))
    second = await rig.director.route(_chat(rid="b", text="another prompt " * 30))
    loads = {s.key: (s.inflight_requests, s.unseen_requests) for s in rig.scheduler.seen[-1][1]}
    assert loads[first.endpoints[0]] == (1, 1)  # sent after the scrape: unseen by the server
    assert sum(n for n, _ in loads.values()) == 1
    assert second.endpoints[0] != first.endpoints[0]  # the first request counts as load


async def test_peers_unseen_sends_reach_the_scheduler_after_our_own() -> None:
    rig = _rig()
    peers = PeerUnseen()
    peers.fold("peer", Sent("p1", "10.0.0.1:8000", 50, True), SCRAPED_AT + 0.01)
    peers.fold("peer", Sent("p2", "10.0.0.2:8000", 50, True), SCRAPED_AT - 0.01)  # scraped
    rig.director.peers = peers
    first = await rig.director.route(_chat(rid="a", text="first prompt " * 30))
    loads = {s.key: s.unseen_requests for s in rig.scheduler.seen[-1][1]}
    assert loads == {"10.0.0.1:8000": 1, "10.0.0.2:8000": 0, "10.0.0.3:8000": 0,
                     "10.0.0.4:8000": 0}  # fmt: skip
    assert first.endpoints[0] != "10.0.0.1:8000"  # the peer's send counts as load
    second = await rig.director.route(_chat(rid="b", text="another prompt " * 30))
    loads = {s.key: s.unseen_requests for s in rig.scheduler.seen[-1][1]}
    assert loads["10.0.0.1:8000"] == 1
    assert loads[first.endpoints[0]] == 1  # our own, counted beside the peers'
    rig.director.peers = None  # sync stopped: our own only
    await rig.director.route(_chat(rid="c", text="a third prompt " * 30))
    own = [first.endpoints[0], second.endpoints[0]]
    assert {s.key: s.unseen_requests for s in rig.scheduler.seen[-1][1]} == {
        key: own.count(key) for key in ALL
    }


async def test_a_failing_peers_view_never_fails_a_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]:
            raise RuntimeError("boom")

    rig = _rig()
    rig.director.peers = Broken()
    first = await rig.director.route(_chat(rid="a", text="first prompt " * 30))
    for rid in "bc":
        await rig.director.route(_chat(rid=rid, text="another prompt " * 30))
    loads = {s.key: s.unseen_requests for s in rig.scheduler.seen[0][1]}
    assert loads == dict.fromkeys(ALL, 0)  # the tracker's answer: nothing sent yet
    assert first.endpoints
    assert rig.director.peer_errors >= 3
    logged = [r for r in caplog.records if "peers' unseen sends left out" in r.getMessage()]
    assert 1 <= len(logged) < rig.director.peer_errors  # rate-limited


@pytest.mark.parametrize(("fallbacks", "expected"), [(0, 1), (2, 3), (16, 4)])
async def test_fallback_count_follows_config(fallbacks: int, expected: int) -> None:
    rig = _rig(config=RequestHandling(fallback_endpoints=fallbacks))
    decision = await rig.director.route(_chat())
    assert len(decision.endpoints) == expected  # capped by the config and by the picker (4)
    assert len(set(decision.endpoints)) == expected


async def test_split_rewrites_the_model_in_the_body() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat("split", extra={"temperature": 0.5}))
    assert decision.target_model == "lora-a"  # lora-b has weight 0
    assert decision.body is not None
    body = json.loads(decision.body)
    assert body["model"] == "lora-a"
    assert body["temperature"] == 0.5
    assert body["messages"] == [{"role": "user", "content": "hi " * 40}]
    request = rig.scheduler.seen[-1][0]
    assert (request.model, request.target_model) == ("split", "lora-a")
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


async def test_with_observed_responses_usage_is_injected_only_where_the_epp_rewrites() -> None:
    """The response observer: a response the EPP does not rewrite never passes it, so nothing
    could strip an injected usage chunk; a split's response still passes (its model name)."""
    rig = _rig(responses_observed=True)
    same = await rig.director.route(_chat(stream=True))
    assert (same.include_usage_injected, same.body) == (False, None)
    split = await rig.director.route(_chat("split", rid="r2", stream=True))
    assert split.target_model != "split"
    assert split.include_usage_injected is True
    assert split.body is not None
    assert json.loads(split.body)["stream_options"] == {"include_usage": True}


async def test_a_server_that_names_responses_itself_gets_them_renamed() -> None:
    """llama.cpp answers under its own name whatever the request said: its responses always
    pass the EPP (with the response observer) to get the client's name back, and only its."""
    store = Datastore()
    store.set_resources([_pool("pool", "sim")], DEFAULT_MODELS)
    store.set_endpoints(
        [EndpointSpec("llama-1", "10.0.0.1", labels={"app": "sim"}, engine="llamacpp")]
    )
    store.update_metrics("10.0.0.1:8000", EndpointMetrics(updated_at=SCRAPED_AT))
    rig = _rig(store, responses_observed=True)
    decision = await rig.director.route(_chat(stream=True))
    assert decision.target_model == decision.model_name == "chat"
    assert decision.server_names_model is True
    assert decision.renames_response_model is True
    assert decision.include_usage_injected is True  # it passes the EPP, which strips it again

    vllm = await _rig(responses_observed=True).director.route(_chat(rid="r2", stream=True))
    assert (vllm.server_names_model, vllm.renames_response_model) == (False, False)


@pytest.mark.parametrize(
    ("request_", "error", "status", "code"),
    [
        (_chat(extra={"model": None}), BadRequest, 400, "BadRequest"),
        (
            IncomingRequest("r", "POST", "/v1/completions", {}, b"{not json"),
            BadRequest,
            400,
            "BadRequest",
        ),
        (_chat("nope"), ModelNotFound, 404, "model_not_found"),
        # The datastore does not resolve a model whose weights are all 0 (its status is
        # NoValidTargetModel), so its name is unknown here: 404 as well.
        (_chat("dead"), ModelNotFound, 404, "model_not_found"),
    ],
)
async def test_request_errors(
    request_: IncomingRequest, error: type[GatewayError], status: int, code: str
) -> None:
    rig = _rig()
    with pytest.raises(error) as info:
        await rig.director.route(request_)
    assert info.value.http_status == status
    assert info.value.openai_body()["error"]["code"] == code
    assert len(rig.inflight) == 0
    assert rig.scheduler.seen == []


async def test_all_zero_weights_from_a_snapshot_is_no_valid_target_model() -> None:
    """A snapshot source that does hand out such a model still gets the precise 404."""
    real = _store()

    class Unfiltered:
        def pool_keys(self) -> Sequence[str]:
            return [POOL]

        def resolve(self, model_name: str) -> ModelRoute | None:
            return ModelRoute(POOL, DEFAULT_MODELS[3]) if model_name == "dead" else None

        def model_names(self) -> Sequence[str]:
            return ["dead"]

        def rewrite_rule(self, pool_key: str, model_name: str) -> None:
            return None

        def objective(self, pool_key: str, name: str) -> None:
            return None

        def states(self, pool_key: str) -> Sequence[EndpointState]:
            return real.snapshot().states(POOL)

        def pool(self, pool_key: str) -> None:
            return None

    class Source:
        def snapshot(self) -> Unfiltered:
            return Unfiltered()

    director = Director(
        datastore=Source(),
        scheduler=build_scheduler(SchedulingConfig(), rng=random.Random(0)),
        inflight=InflightTracker(),
        gate=ShedGate(AdmissionController(), clock=lambda: NOW),
        config=RequestHandling(),
        rng=random.Random(0),
        clock=lambda: NOW,
    )
    with pytest.raises(NoValidTargetModel) as info:
        await director.route(_chat("dead"))
    assert info.value.http_status == 404


async def test_unknown_model_message_names_the_model() -> None:
    with pytest.raises(ModelNotFound, match="model 'nope' not found"):
        await _rig().director.route(_chat("nope"))


async def test_body_over_the_limit_is_413() -> None:
    rig = _rig(config=RequestHandling(max_body_bytes=1024))
    with pytest.raises(PayloadTooLarge) as info:
        await rig.director.route(_chat(extra={"pad": "x" * 2000}))
    assert info.value.http_status == 413
    assert (await rig.director.route(_chat())).endpoints  # a small body still passes


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
    # ...and a saturated pool sheds it like any Sheddable request.
    saturated = _rig(_store(waiting=50), config=config)
    with pytest.raises(RequestShed):
        await saturated.director.route(_chat("mystery"))


async def test_saturated_pool_sheds_by_criticality() -> None:
    rig = _rig(_store(waiting=50))  # saturation 10: past both shedding levels
    for model in ("cheap", "split"):  # Sheddable, Standard
        with pytest.raises(RequestShed) as info:
            await rig.director.route(_chat(model))
        assert info.value.http_status == 429
    assert len(rig.inflight) == 0
    decision = await rig.director.route(_chat("chat", rid="r2"))  # Critical is never shed
    assert decision.endpoints
    busy = _rig(_store(waiting=7))  # saturation 1.4: Sheddable shed, Standard admitted
    with pytest.raises(RequestShed) as shed:
        await busy.director.route(_chat("cheap"))
    # upstream labels the error with the resolved target (metrics target_model_name)
    assert shed.value.target_model == "cheap"
    assert (await busy.director.route(_chat("split"))).target_model == "lora-a"


async def test_no_endpoints_is_503() -> None:
    rig = _rig(_store(endpoints=[]))
    with pytest.raises(NoReadyEndpoint, match="no ready endpoint") as info:
        await rig.director.route(_chat())
    assert info.value.http_status == 503


async def test_scheduler_with_no_result_is_503() -> None:
    class Empty:
        def schedule(
            self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
        ) -> SchedulingResult:
            return SchedulingResult(targets=())

    rig = _rig(scheduler=Empty())
    with pytest.raises(NoReadyEndpoint):
        await rig.director.route(_chat())
    assert len(rig.inflight) == 0


async def test_scheduler_bug_becomes_a_clean_500() -> None:
    class Broken:
        def schedule(
            self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
        ) -> SchedulingResult:
            raise KeyError("secret detail")

    with pytest.raises(GatewayError) as info:
        await _rig(scheduler=Broken()).director.route(_chat())
    assert type(info.value) is GatewayError
    assert info.value.http_status == 500
    assert "secret detail" not in info.value.message


async def test_subset_hint_restricts_candidates_by_ip() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat(subset=("10.0.0.3:8000", "10.0.0.4:9999")))
    assert set(decision.endpoints) == {"10.0.0.3:8000", "10.0.0.4:8000"}
    request, candidates = rig.scheduler.seen[-1]
    assert request.subset == frozenset({"10.0.0.3:8000", "10.0.0.4:9999"})
    assert {s.key for s in candidates} == {"10.0.0.3:8000", "10.0.0.4:8000"}
    bare_ip = await rig.director.route(_chat(rid="r2", subset=("10.0.0.2",)))
    assert bare_ip.endpoints == ("10.0.0.2:8000",)


@pytest.mark.parametrize("subset", [(), ("192.168.9.9:8000",)])
async def test_empty_or_foreign_subset_is_503(subset: tuple[str, ...]) -> None:
    rig = _rig()
    with pytest.raises(NoReadyEndpoint, match="subset"):
        await rig.director.route(_chat(subset=subset))
    with pytest.raises(NoReadyEndpoint, match="subset"):
        await rig.director.route(IncomingRequest("g", "GET", "/", {}, subset_hint=subset))


async def test_subset_hint_ignored_when_disabled() -> None:
    rig = _rig(config=RequestHandling(honor_subset_hint=False))
    decision = await rig.director.route(_chat(subset=()))
    assert set(decision.endpoints) == ALL
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
    assert set(decision.endpoints) == ALL
    request = rig.scheduler.seen[-1][0]
    assert dict(request.headers) == {"authorization": "Bearer t"}
    assert request.subset is None


@pytest.mark.parametrize(
    ("names", "kept"),
    [
        (["authorization", "content-type"], None),  # nothing to drop: the request's own map
        (["x-gateway-model-name-rewrite", "accept"], ["accept"]),
        (["accept", "x-gateway-inference-fairness-id"], ["accept"]),
        (["a\nx-gateway-b", "accept"], ["a\nx-gateway-b", "accept"]),  # only looks like one
        (["x-gatewayz", "X-Gateway-Upper"], None),  # lower-cased by the transport before this
    ],
)
def test_scheduler_headers_drop_exactly_the_control_prefix(
    names: list[str], kept: list[str] | None
) -> None:
    headers = {name: "v" for name in names}
    out = scheduler_headers(headers)
    if kept is None:
        assert out is headers
    else:
        assert list(out) == kept


async def test_header_only_request_goes_to_a_random_ready_endpoint() -> None:
    rig = _rig()
    primaries: set[str] = set()
    for i in range(40):
        decision = await rig.director.route(IncomingRequest(f"g{i}", "GET", "/v1/models", {}))
        assert decision.pool == POOL
        assert len(decision.endpoints) == 4
        assert set(decision.endpoints) == ALL
        assert decision.model_name == ""
        primaries.add(decision.endpoints[0])
        rig.director.complete(decision, status=200, usage=None)
    assert primaries == ALL
    assert rig.scheduler.seen == []  # no scheduling, no admission, no in-flight accounting
    assert len(rig.inflight) == 0


async def test_header_only_request_ignores_saturation() -> None:
    rig = _rig(_store(waiting=50))
    decision = await rig.director.route(IncomingRequest("g", "GET", "/v1/models", {}))
    assert decision.endpoints[0] in ALL


async def test_header_only_request_with_no_endpoints_is_503() -> None:
    with pytest.raises(NoReadyEndpoint, match="no ready endpoint"):
        await _rig(_store(endpoints=[])).director.route(IncomingRequest("g", "GET", "/", {}))
    with pytest.raises(NoReadyEndpoint, match="no InferencePool"):
        await _rig(_store(pools={})).director.route(IncomingRequest("g", "GET", "/", {}))


async def test_default_pool_for_header_only_and_passthrough() -> None:
    store = _store(pools={"pool": "sim", "other": "alt"}, endpoints=[(1, "sim"), (7, "alt")])
    rig = _rig(store)
    bodyless = await rig.director.route(IncomingRequest("g", "GET", "/", {}))
    assert bodyless.pool == OTHER_POOL  # first by key ("default/other" < "default/pool")
    assert bodyless.endpoints == ("10.0.0.7:8000",)
    config = RequestHandling(
        default_pool="pool", unknown_model_policy=UnknownModelPolicy.PASSTHROUGH_SHEDDABLE
    )
    rig = _rig(store, config=config)
    assert (await rig.director.route(IncomingRequest("g", "GET", "/", {}))).pool == POOL
    assert (await rig.director.route(_chat("anything"))).endpoints == ("10.0.0.1:8000",)
    missing = _rig(store, config=RequestHandling(default_pool="ns/missing"))
    with pytest.raises(NoReadyEndpoint, match="default pool ns/missing is not loaded"):
        await missing.director.route(IncomingRequest("g", "GET", "/", {}))


async def test_model_in_two_pools_goes_to_the_oldest() -> None:
    older = _model("chat", pool="other", created="2025-01-01T00:00:00Z", object_name="b")
    newer = _model("chat", pool="pool", created="2025-06-01T00:00:00Z", object_name="a")
    pools = {"pool": "sim", "other": "alt"}
    endpoints = [(1, "sim"), (2, "alt")]
    rig = _rig(_store(pools=pools, endpoints=endpoints, models=[newer, older]))
    decision = await rig.director.route(_chat())
    assert decision.pool == OTHER_POOL
    assert decision.endpoints == ("10.0.0.2:8000",)
    swapped = [
        _model("chat", pool="pool", created="2025-01-01T00:00:00Z", object_name="b"),
        _model("chat", pool="other", created="2025-06-01T00:00:00Z", object_name="a"),
    ]
    rig = _rig(_store(pools=pools, endpoints=endpoints, models=swapped))
    assert (await rig.director.route(_chat())).pool == POOL


async def test_resource_changes_are_seen_immediately() -> None:
    store = _store()
    rig = _rig(store)
    assert "late" not in rig.director.model_names()
    store.set_resources([_pool("pool", "sim")], [*DEFAULT_MODELS, _model("late")])
    assert "late" in rig.director.model_names()
    assert (await rig.director.route(_chat("late"))).model_name == "late"
    store.set_resources([_pool("pool", "sim")], [])
    with pytest.raises(ModelNotFound):
        await rig.director.route(_chat("late", rid="r2"))


async def test_complete_is_idempotent_and_finishes_in_flight() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat())
    usage = Usage(prompt_tokens=30, completion_tokens=5)
    rig.director.complete(decision, status=200, usage=usage)
    assert len(rig.inflight) == 0
    assert rig.inflight.counts(decision.endpoints[0]) == (0, 0)
    other = await rig.director.route(_chat(rid="r2"))
    rig.director.complete(decision, status=200, usage=usage)  # again: must not touch r2
    rig.director.complete(decision, status=None, usage=None)
    assert len(rig.inflight) == 1
    assert rig.inflight.counts(other.endpoints[0])[0] == 1
    assert isinstance(decision.ticket, Ticket)
    assert decision.ticket.done
    rig.director.complete(other, status=None, usage=None)  # cancelled stream
    assert len(rig.inflight) == 0


async def test_served_fallback_moves_in_flight_accounting() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat())
    primary, fallback = decision.endpoints[:2]
    rig.director.served(decision, "1.2.3.4:80")  # not in the decision: ignored
    assert rig.inflight.counts(primary)[0] == 1
    rig.director.served(decision, fallback)
    assert rig.inflight.counts(primary) == (0, 0)
    assert rig.inflight.counts(fallback) == (1, decision.prompt_tokens)
    rig.director.complete(decision, status=200, usage=None, served_endpoint=fallback)
    assert len(rig.inflight) == 0
    rig.director.served(decision, primary)  # after completion: nothing moves
    assert len(rig.inflight) == 0


async def test_in_flight_is_counted_by_target_model_and_moves_with_a_fallback() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat("split"))
    primary, fallback = decision.endpoints[:2]
    assert rig.inflight.models(primary) == {"lora-a": 1}  # the target, not the split's name
    rig.director.served(decision, fallback)
    assert (rig.inflight.models(primary), rig.inflight.models(fallback)) == ({}, {"lora-a": 1})
    rig.director.complete(decision, status=200, usage=None, served_endpoint=fallback)
    assert rig.inflight.models(fallback) == {}


async def test_complete_with_served_fallback_and_foreign_tickets() -> None:
    rig = _rig()
    decision = await rig.director.route(_chat())
    rig.director.complete(decision, status=502, usage=None, served_endpoint=decision.endpoints[1])
    assert len(rig.inflight) == 0
    await rig.director.route(_chat(rid="r2"))
    stranger = RoutingDecision(request_id="r2", endpoints=("1.1.1.1:1",), pool=POOL)
    rig.director.complete(stranger, status=200, usage=None)  # no ticket of ours: no effect
    assert len(rig.inflight) == 1


def test_model_names_across_pools() -> None:
    store = _store(
        pools={"pool": "sim", "other": "alt"},
        models=[_model("b"), _model("a"), _model("c", pool="other")],
    )
    assert _rig(store).director.model_names() == ["a", "b", "c"]


def test_ready_follows_whether_the_last_scrape_succeeded() -> None:
    rig = _rig()
    rig.clock[0] = SCRAPED_AT + 60.0  # a late scrape does not flip readiness
    assert rig.director.ready()
    for i in range(1, 5):  # every endpoint's last scrape failed (values kept, error set)
        failed = EndpointMetrics(updated_at=SCRAPED_AT, error="connection refused")
        rig.store.update_metrics(f"10.0.0.{i}:8000", failed)
        assert rig.director.ready() is (i < 4)
    assert not _rig(_store(scraped_at=0.0)).director.ready()  # never scraped
    assert not _rig(_store(endpoints=[])).director.ready()
    assert not _rig(_store(pools={})).director.ready()


async def test_build_director_from_a_gateway_config() -> None:
    config = GatewayConfig.model_validate(
        {
            "spec": {
                "requestHandling": {"fallbackEndpoints": 0},
                "scraping": {"stalenessMs": 500},
                "admission": {"queueDepthThreshold": 100, "allStalePolicy": "shed"},
                # Admission's own path: with flow control the stale pool would queue instead.
                "flowControl": {"enabled": False},
            }
        }
    )
    clock = [NOW]
    store = _store(waiting=50)
    director = build_director(config, store, rng=random.Random(3), clock=lambda: clock[0])
    decision = await director.route(_chat("cheap"))  # saturation 0.5 with a threshold of 100
    assert len(decision.endpoints) == 1
    assert director.config.fallback_endpoints == 0
    director.complete(decision, status=200, usage=None)
    # The one freshness setting reaches admission: fresh at 0.4 s, all stale (shed) at 0.6 s.
    clock[0] = SCRAPED_AT + 0.4
    director.complete(await director.route(_chat("cheap", rid="fresh")), status=200, usage=None)
    clock[0] = SCRAPED_AT + 0.6
    with pytest.raises(RequestShed, match="older than 500 ms"):
        await director.route(_chat("cheap", rid="stale"))


async def test_a_rejection_carries_the_model_it_parsed() -> None:
    """Front ends label error metrics with the request's model without parsing the body again."""
    with pytest.raises(ModelNotFound) as unknown:
        await _rig().director.route(_chat("nope"))
    assert (unknown.value.model, unknown.value.target_model) == ("nope", "")
    rig = _rig(_store(endpoints=[]))
    with pytest.raises(NoReadyEndpoint) as empty:
        await rig.director.route(_chat("cheap"))
    assert empty.value.model == "cheap"
    assert empty.value.target_model == "cheap"


async def test_repeated_client_request_ids_keep_separate_accounting() -> None:
    """`x-request-id` comes from clients and may repeat; live requests must stay separate."""
    rig = _rig()
    first = await rig.director.route(_chat(rid="same", text="one " * 50))
    second = await rig.director.route(_chat(rid="same", text="two " * 50))
    assert len(rig.inflight) == 2
    rig.director.complete(first, status=200, usage=None)
    assert len(rig.inflight) == 1
    assert rig.inflight.counts(second.endpoints[0])[0] == 1
    rig.director.complete(second, status=200, usage=None)
    assert len(rig.inflight) == 0


async def test_scheduler_targets_outside_the_candidates_are_never_destinations() -> None:
    """A buggy or custom plugin cannot send traffic outside the pool (reliability F4)."""
    foreign = EndpointState(
        endpoint=Endpoint(name="evil", address="169.254.169.254", port=80),
        metrics=EndpointMetrics(),
    )

    class Rogue:
        def __init__(self, include_real: bool) -> None:
            self.include_real = include_real

        def schedule(
            self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
        ) -> SchedulingResult:
            real = (candidates[1], candidates[1], candidates[0]) if self.include_real else ()
            return SchedulingResult(targets=(foreign, *real))

    rig = _rig(scheduler=Rogue(include_real=True))
    decision = await rig.director.route(_chat())
    assert decision.endpoints == ("10.0.0.2:8000", "10.0.0.1:8000")  # foreign and repeat dropped
    assert rig.inflight.counts("169.254.169.254:80") == (0, 0)
    rig = _rig(scheduler=Rogue(include_real=False))
    with pytest.raises(NoReadyEndpoint):
        await rig.director.route(_chat())
    assert len(rig.inflight) == 0


async def test_a_send_no_destination_takes_is_ended_for_the_learners() -> None:
    """PostCycle counted the send (a learner's backlog): with every target outside the pool no
    ticket exists to end it, so the Director ends it before refusing (else it stays counted
    until it ages out)."""
    foreign = EndpointState(
        endpoint=Endpoint(name="evil", address="169.254.169.254", port=80),
        metrics=EndpointMetrics(),
    )

    class RogueLearner:
        observes_first_tokens = True

        def __init__(self) -> None:
            self.sent: list[str] = []
            self.ended: list[str] = []

        def schedule(
            self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
        ) -> SchedulingResult:
            self.sent.append(request.key)
            return SchedulingResult(targets=(foreign,))

        def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
            raise AssertionError("no first byte without a destination")

        def request_ended(self, request_id: str) -> None:
            self.ended.append(request_id)

    learner = RogueLearner()
    director = _bare(learner)  # unwrapped: `_rig`'s recording wrapper learns nothing
    with pytest.raises(NoReadyEndpoint):
        await director.route(_chat(rid="gone"))
    assert len(learner.sent) == 1
    assert learner.sent[0].startswith("gone#")
    assert learner.ended == learner.sent


@pytest.mark.parametrize(
    ("status", "usage", "want"),
    [
        (200, Usage(prompt_tokens=10, completion_tokens=50), 0.04),  # 2 s / 50 tokens
        (200, None, None),  # no usage: nothing to divide by
        (502, Usage(prompt_tokens=10, completion_tokens=50), None),  # failures say nothing
        (None, None, None),  # cancelled
    ],
    ids=["success", "no-usage", "error", "cancelled"],
)
async def test_complete_feeds_observed_speed_on_success(
    status: int | None, usage: Usage | None, want: float | None
) -> None:
    rig = _rig()
    decision = await rig.director.route(_chat(rid="s"))
    rig.clock[0] += 2.0
    rig.director.complete(decision, status=status, usage=usage)
    assert rig.inflight.seconds_per_token(decision.endpoints[0]) == (
        None if want is None else pytest.approx(want)
    )
    await rig.director.route(_chat(rid="next"))
    seen = {s.key: s.seconds_per_output_token for s in rig.scheduler.seen[-1][1]}
    assert seen[decision.endpoints[0]] == (None if want is None else pytest.approx(want))


async def test_a_learning_scheduler_gets_the_first_byte_of_streamed_requests_only() -> None:
    from poolkeeper.config.gateway import GatewayConfig
    from poolkeeper.scheduling.plugins.ttft_scorer import PredictedTtftScorer
    from poolkeeper.scheduling.scheduler import Scheduler

    clock = [NOW]
    config = GatewayConfig.model_validate(
        {"spec": {"scheduling": {"preset": "predicted-ttft"}, "flowControl": {"enabled": False}}}
    )
    director = build_director(config, _store(), rng=random.Random(1), clock=lambda: clock[0])
    scheduler = director.scheduler
    assert isinstance(scheduler, Scheduler)
    scorer = scheduler.plugins["predicted-ttft-scorer"]
    assert isinstance(scorer, PredictedTtftScorer)
    streamed = await director.route(_chat("split", rid="s", stream=True))
    plain = await director.route(_chat("split", rid="p"))
    assert scorer.model.pending == 2
    clock[0] += 0.25
    director.first_byte(streamed)
    director.first_byte(plain)  # the whole answer at once: not a time to first token
    assert scorer.model.samples == 1
    director.complete(streamed, status=200, usage=None)
    director.complete(plain, status=200, usage=None)
    assert scorer.model.pending == 0  # the plain request's decision is forgotten at its end
    director.first_byte(streamed)  # late or repeated reports change nothing
    assert scorer.model.samples == 1


async def test_a_streamed_first_byte_takes_the_request_out_of_the_unseen_queue() -> None:
    # The default profile learns nothing from first bytes; the in-flight tracker still does:
    # a request that answered runs, and must not count as waiting until the next scrape.
    from poolkeeper.config.gateway import GatewayConfig
    from poolkeeper.datastore.inflight import InflightTracker

    clock = [NOW]
    config = GatewayConfig.model_validate({"spec": {"flowControl": {"enabled": False}}})
    store = _store()
    director = build_director(config, store, rng=random.Random(1), clock=lambda: clock[0])
    tracker = director.inflight
    assert isinstance(tracker, InflightTracker)
    streamed = await director.route(_chat("split", rid="s", stream=True))
    plain = await director.route(_chat("split", rid="p"))
    clock[0] += 0.01

    def answered() -> int:
        snapshot = store.snapshot()
        states = [s for key in snapshot.pool_keys() for s in snapshot.states(key)]
        return sum(s.unseen_answered for s in tracker.apply(states))

    assert answered() == 0
    director.first_byte(plain)  # a JSON answer's first byte is its end: not counted
    assert answered() == 0
    director.first_byte(streamed)
    assert answered() == 1
    director.complete(streamed, status=200, usage=None)
    assert answered() == 0


@pytest.mark.parametrize(
    ("status", "usage", "told"),
    [
        (200, Usage(prompt_tokens=10, completion_tokens=50), [50]),
        (200, None, []),  # no usage: no count to anchor on
        (502, Usage(prompt_tokens=10, completion_tokens=50), []),
        (None, None, []),  # cancelled
    ],
    ids=["success", "no-usage", "error", "cancelled"],
)
async def test_a_successful_end_tells_the_step_counting_learner_its_usage(
    status: int | None, usage: Usage | None, told: list[int]
) -> None:
    """The step-phase scorer anchors its step counts on a request's output tokens: the
    Director passes a successful end's usage and time, then ends it for every learner."""

    class StepCounting:
        observes_first_tokens = True

        def __init__(self) -> None:
            self.done: list[tuple[str, float, int]] = []
            self.ended: list[str] = []
            self.inner = build_scheduler(SchedulingConfig(), rng=random.Random(1))

        def schedule(
            self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
        ) -> SchedulingResult:
            return self.inner.schedule(request, candidates, now=now)

        def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
            pass

        def request_done(self, request_id: str, now: float, output_tokens: int) -> None:
            self.done.append((request_id, now, output_tokens))

        def request_ended(self, request_id: str) -> None:
            self.ended.append(request_id)

    learner = StepCounting()
    director = _bare(learner)
    decision = await director.route(_chat(rid="d", stream=True))
    director.complete(decision, status=status, usage=usage)
    director.complete(decision, status=status, usage=usage)  # idempotent
    assert [d[2] for d in learner.done] == told
    assert all(d[1] == NOW for d in learner.done)
    assert len(learner.ended) == 1
