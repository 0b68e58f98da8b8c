"""The pure core: Pods to endpoints, the per-kind cache, backoff."""

from __future__ import annotations

import random

import pytest

from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.controller.kubernetes.backoff import Backoff
from poolkeeper.controller.kubernetes.objects import POD, ObjectCache, parse_pool, pod_endpoint
from tests.kube.conftest import pod_obj, pool_obj

ENGINE = ScrapingConfig().engine_for


def test_pod_is_an_endpoint_only_when_ready_with_an_ip_and_not_deleting() -> None:
    spec = pod_endpoint(pod_obj("p", "10.1.2.3"), ENGINE)
    assert spec is not None
    assert (spec.name, spec.address, spec.port, spec.namespace) == (
        "p",
        "10.1.2.3",
        None,
        "default",
    )
    assert spec.labels == {"app": "vllm"}
    assert pod_endpoint(pod_obj("p", None), ENGINE) is None
    assert pod_endpoint(pod_obj("p", "10.1.2.3", ready=False), ENGINE) is None
    deleting = pod_obj("p", "10.1.2.3")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_endpoint(deleting, ENGINE) is None
    no_conditions = pod_obj("p", "10.1.2.3")
    no_conditions["status"]["conditions"] = None
    assert pod_endpoint(no_conditions, ENGINE) is None


def test_pod_engine_from_its_label_and_unknown_engines_left_out() -> None:
    sglang = pod_obj("p", "10.1.2.3")
    sglang["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] = "sglang"
    spec = pod_endpoint(sglang, ENGINE)
    assert spec is not None
    assert spec.engine == "sglang"
    odd = pod_obj("p", "10.1.2.3")
    odd["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] = "nonsense"
    assert pod_endpoint(odd, ENGINE) is None


def test_pod_gets_each_target_port_of_the_pool() -> None:
    pool, problems = parse_pool(pool_obj(port=8000))
    assert problems == []
    assert pool is not None
    spec = pod_endpoint(pod_obj("p", "10.1.2.3"), ENGINE)
    assert spec is not None
    assert [e.hostport for e in spec.for_pool(pool)] == ["10.1.2.3:8000"]


def _obj(name: str, rv: str) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "default", "resourceVersion": rv}}


def test_cache_events_and_replace_prunes() -> None:
    cache = ObjectCache(POD)
    assert cache.apply_event("ADDED", _obj("a", "1"))
    assert not cache.apply_event("MODIFIED", _obj("a", "1"))  # same version: no change
    assert cache.apply_event("MODIFIED", _obj("a", "2"))
    assert cache.apply_event("ADDED", _obj("b", "3"))
    assert not cache.apply_event("BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert cache.version == "9"
    assert cache.apply_event("DELETED", _obj("a", "10"))
    assert not cache.apply_event("DELETED", _obj("zz", "11"))
    assert cache.replace([_obj("c", "12")], "12") == ["default/b"]
    assert sorted(cache.objects) == ["default/c"]
    assert cache.synced
    with pytest.raises(ValueError, match="unknown watch event type"):
        cache.apply_event("WEIRD", _obj("c", "13"))


def test_backoff_doubles_to_the_cap_with_jitter_and_resets() -> None:
    backoff = Backoff(0.5, 8.0, rng=random.Random(1))
    delays = [backoff.next() for _ in range(8)]
    ceilings = [0.5, 1, 2, 4, 8, 8, 8, 8]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    backoff.reset()
    assert backoff.next() <= 0.5
