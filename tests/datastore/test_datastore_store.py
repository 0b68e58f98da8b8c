"""Datastore: snapshot semantics, selector matching, model resolution, metrics bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest

from poolkeeper.api.model import InferenceModel
from poolkeeper.api.pool import AnyInferencePool, InferencePool, InferencePoolV1
from poolkeeper.datastore import ChangeKind, Datastore, DatastoreSnapshot, EndpointSpec
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics


def pool(name: str, selector: dict[str, str], port: int = 8000, ns: str = "default") -> Any:
    return InferencePool.model_validate(
        {
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "selector": selector,
                "targetPortNumber": port,
                "extensionRef": {"name": "epp"},
            },
        }
    )


def pool_v1(name: str, selector: dict[str, str], ports: list[int]) -> Any:
    return InferencePoolV1.model_validate(
        {
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": selector},
                "targetPorts": [{"number": p} for p in ports],
                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
            },
        }
    )


def model(
    name: str, model_name: str, pool_name: str, created: str | None = None, ns: str = "default"
) -> InferenceModel:
    meta: dict[str, Any] = {"name": name, "namespace": ns}
    if created is not None:
        meta["creationTimestamp"] = created
    return InferenceModel.model_validate(
        {"metadata": meta, "spec": {"modelName": model_name, "poolRef": {"name": pool_name}}}
    )


def spec(name: str, ip: str, port: int | None = None, **labels: str) -> EndpointSpec:
    return EndpointSpec(name, ip, port, labels=labels)


def test_empty_store() -> None:
    snap = Datastore().snapshot()
    assert snap.version == 0
    assert snap.pool_keys() == ()
    assert snap.states("default/none") == ()
    assert snap.all_endpoints() == ()
    assert snap.models("default/none") == {}


def test_selector_matching_and_default_port() -> None:
    store = Datastore()
    pools: list[AnyInferencePool] = [pool("a", {"app": "a"}, 8000), pool("b", {"app": "b"}, 9000)]
    store.set_resources(pools, [])
    store.set_endpoints(
        [
            spec("a-0", "10.0.0.1", app="a"),
            spec("a-1", "10.0.0.2", 8123, app="a", extra="x"),
            spec("b-0", "10.0.0.3", app="b"),
            spec("none", "10.0.0.4", app="c"),
        ]
    )
    snap = store.snapshot()
    assert [e.hostport for e in snap.endpoints("default/a")] == ["10.0.0.1:8000", "10.0.0.2:8123"]
    assert [e.hostport for e in snap.endpoints("default/b")] == ["10.0.0.3:9000"]
    assert [e.hostport for e in snap.all_endpoints()] == [
        "10.0.0.1:8000",
        "10.0.0.2:8123",
        "10.0.0.3:9000",
    ]
    endpoint = snap.endpoints("default/a")[1]
    assert endpoint.labels == {"app": "a", "extra": "x"}
    assert endpoint.namespace == "default"


def test_namespaced_endpoints_only_join_pools_of_their_namespace() -> None:
    store = Datastore()
    store.set_resources([pool("p", {"app": "x"}, ns="prod"), pool("p", {"app": "x"})], [])
    store.set_endpoints(
        [
            EndpointSpec("pod-prod", "10.0.0.1", namespace="prod", labels={"app": "x"}),
            EndpointSpec("standalone", "10.0.0.2", labels={"app": "x"}),
        ]
    )
    snap = store.snapshot()
    assert [e.name for e in snap.endpoints("prod/p")] == ["pod-prod", "standalone"]
    assert [e.name for e in snap.endpoints("default/p")] == ["standalone"]
    assert snap.endpoints("prod/p")[1].namespace == "prod"


def test_v1_pool_with_several_target_ports_gives_one_endpoint_per_rank() -> None:
    store = Datastore()
    store.set_resources([pool_v1("dp", {"app": "x"}, [8000, 8001])], [])
    store.set_endpoints([spec("pod", "10.0.0.1", app="x")])
    endpoints = store.snapshot().endpoints("default/dp")
    assert [(e.name, e.port) for e in endpoints] == [("pod", 8000), ("pod-rank-1", 8001)]


def test_models_resolve_oldest_wins_per_pool() -> None:
    store = Datastore()
    store.set_resources(
        [pool("a", {"app": "a"}), pool("b", {"app": "b"})],
        [
            model("new", "llama", "a", "2025-02-01T00:00:00Z"),
            model("old", "llama", "a", "2025-01-01T00:00:00Z"),
            model("in-b", "llama", "b", "2025-03-01T00:00:00Z"),
            model("orphan", "mistral", "missing"),
        ],
    )
    snap = store.snapshot()
    assert snap.models("default/a")["llama"].metadata.name == "old"
    assert snap.models("default/b")["llama"].metadata.name == "in-b"
    resolved = snap.resolve("llama")  # in two pools: the oldest model's pool
    assert resolved is not None
    assert resolved.model is not None
    assert (resolved.pool_key, resolved.model.metadata.name) == ("default/a", "old")
    assert snap.resolve("mistral") is None  # its pool does not exist
    assert snap.model_names() == ("llama",)
    assert snap.model_index.verdicts["default/new"].reason == "ModelNameInUse"


def test_metrics_and_endpoint_writes_keep_the_model_index() -> None:
    """The index is built once per resource write; the request path reads it as is."""
    store = Datastore()
    store.set_resources([pool("a", {"app": "a"})], [model("m", "llama", "a")])
    index = store.snapshot().model_index
    store.set_endpoints([spec("a-0", "10.0.0.1", app="a")])
    store.update_metrics("10.0.0.1:8000", EndpointMetrics(waiting=3, updated_at=1.0))
    assert store.snapshot().model_index is index
    store.set_resources([pool("a", {"app": "a"})], [model("m", "mistral", "a")])
    assert store.snapshot().model_index is not index
    assert store.snapshot().model_names() == ("mistral",)


def test_snapshots_are_immutable_and_old_ones_unchanged_by_writes() -> None:
    store = Datastore()
    store.set_resources([pool("a", {"app": "a"})], [])
    store.set_endpoints([spec("a-0", "10.0.0.1", app="a")])
    before = store.snapshot()
    assert store.update_metrics("10.0.0.1:8000", EndpointMetrics(waiting=4, updated_at=1.0))
    after = store.snapshot()
    assert before.metrics_for("10.0.0.1:8000") == EndpointMetrics()
    assert after.metrics_for("10.0.0.1:8000").waiting == 4
    assert after.version == before.version + 1
    with pytest.raises(TypeError):
        after.metrics["10.0.0.1:8000"] = EndpointMetrics()  # type: ignore[index]
    with pytest.raises(AttributeError):
        after.version = 0  # type: ignore[misc]


def test_states_carry_latest_metrics_and_age() -> None:
    store = Datastore()
    store.set_resources([pool("a", {"app": "a"})], [])
    store.set_endpoints([spec("a-0", "10.0.0.1", app="a"), spec("a-1", "10.0.0.2", app="a")])
    store.update_metrics("10.0.0.1:8000", EndpointMetrics(running=2, updated_at=10.0))
    states = store.snapshot().states("default/a")
    assert [s.key for s in states] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert states[0].metrics.running == 2
    assert states[0].age(12.5) == 2.5
    assert states[1].age(12.5) == float("inf")
    snap = store.snapshot()
    assert not snap.is_stale("10.0.0.1:8000", 11.0, 2.0)
    assert snap.is_stale("10.0.0.1:8000", 12.5, 2.0)
    assert snap.is_stale("10.0.0.2:8000", 11.0, 2.0)
    assert snap.stale_keys(11.0, 2.0) == ("10.0.0.2:8000",)
    assert snap.stale_keys(12.5, 2.0) == ("10.0.0.1:8000", "10.0.0.2:8000")


def test_metrics_for_unknown_endpoint_are_ignored() -> None:
    store = Datastore()
    store.set_resources([pool("a", {"app": "a"})], [])
    version = store.snapshot().version
    assert not store.update_metrics("10.9.9.9:8000", EndpointMetrics(waiting=1))
    assert store.snapshot().version == version


def test_metrics_dropped_when_endpoint_leaves_or_changes_identity() -> None:
    store = Datastore()
    store.set_resources([pool("a", {"app": "a"})], [])
    store.set_endpoints([spec("a-0", "10.0.0.1", app="a"), spec("a-1", "10.0.0.2", app="a")])
    for key in ("10.0.0.1:8000", "10.0.0.2:8000"):
        store.update_metrics(key, EndpointMetrics(waiting=7, updated_at=1.0))
    # a-0 keeps its address (labels changed: same identity); a-1 is replaced by another pod
    # reusing its IP, so its old metrics must not be attributed to the newcomer.
    store.set_endpoints(
        [spec("a-0", "10.0.0.1", app="a", v="2"), spec("other", "10.0.0.2", app="a")]
    )
    snap = store.snapshot()
    assert snap.metrics_for("10.0.0.1:8000").waiting == 7
    assert snap.metrics_for("10.0.0.2:8000") == EndpointMetrics()
    store.set_endpoints([spec("a-0", "10.0.0.1", app="a")])
    assert set(store.snapshot().metrics) == {"10.0.0.1:8000"}
    # a pool selector change that drops the endpoint drops its metrics too
    store.set_resources([pool("a", {"app": "zzz"})], [])
    assert store.snapshot().metrics == {}


def test_listeners_get_changes_and_metrics_only_when_asked() -> None:
    store = Datastore()
    seen: list[tuple[int, ChangeKind]] = []
    seen_metrics: list[ChangeKind] = []

    def listener(snap: DatastoreSnapshot, kind: ChangeKind) -> None:
        seen.append((snap.version, kind))

    unsubscribe = store.subscribe(listener)
    store.subscribe(lambda _s, kind: seen_metrics.append(kind), metrics=True)
    store.set_resources([pool("a", {"app": "a"})], [])
    store.set_endpoints([spec("a-0", "10.0.0.1", app="a")])
    store.update_metrics("10.0.0.1:8000", EndpointMetrics(updated_at=1.0))
    assert seen == [(1, ChangeKind.RESOURCES), (2, ChangeKind.ENDPOINTS)]
    assert seen_metrics == [ChangeKind.RESOURCES, ChangeKind.ENDPOINTS, ChangeKind.METRICS]
    unsubscribe()
    store.clear()
    assert seen == [(1, ChangeKind.RESOURCES), (2, ChangeKind.ENDPOINTS)]
    assert seen_metrics[-1] is ChangeKind.CLEARED


def test_failing_listener_does_not_break_writers(caplog: pytest.LogCaptureFixture) -> None:
    store = Datastore()

    def broken(_snap: DatastoreSnapshot, _kind: ChangeKind) -> None:
        raise RuntimeError("boom")

    calls: list[ChangeKind] = []
    store.subscribe(broken)
    store.subscribe(lambda _s, kind: calls.append(kind))
    store.set_resources([pool("a", {"app": "a"})], [])
    assert calls == [ChangeKind.RESOURCES]
    assert store.snapshot().pool_keys() == ("default/a",)
    assert "boom" in caplog.text


def test_sources_are_merged_and_cleared_independently() -> None:
    store = Datastore()
    store.set_resources([pool("a", {"app": "a"})], [], source="files")
    store.set_endpoints([spec("static", "10.0.0.1", app="a")], source="files")
    store.set_endpoints(
        [Endpoint("pod", "10.0.0.2", 8000, labels={"app": "a"})], source="kubernetes"
    )
    assert [e.name for e in store.snapshot().endpoints("default/a")] == ["pod", "static"]
    store.clear(source="kubernetes")
    assert [e.name for e in store.snapshot().endpoints("default/a")] == ["static"]
    store.clear()
    assert store.snapshot().pool_keys() == ()


def test_set_all_swaps_everything_in_one_snapshot() -> None:
    store = Datastore()
    kinds: list[ChangeKind] = []
    store.subscribe(lambda _s, kind: kinds.append(kind))
    snap = store.set_all(
        [pool("a", {"app": "a"})],
        [model("m", "llama", "a")],
        [spec("a-0", "10.0.0.1", app="a")],
    )
    assert snap is store.snapshot()
    assert snap.version == 1
    assert kinds == [ChangeKind.RESOURCES]
    assert [e.name for e in snap.endpoints("default/a")] == ["a-0"]
    assert set(snap.models("default/a")) == {"llama"}
