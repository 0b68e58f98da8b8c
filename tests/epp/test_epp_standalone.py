"""`--endpoint-selector` (upstream's standalone mode, controller/kubernetes/standalone.py): no
InferencePool, the Ready Pods a label selector matches (set-based terms too), the pool named
after the EPP's Deployment. The rendered standalone chart runs in tests/epp/test_chart_render.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from poolkeeper.cli import epp as epp_cli, epp_setup
from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.config.endpointpicker.values import parse_label_selector
from poolkeeper.controller.kubernetes.objects import POD
from poolkeeper.controller.kubernetes.standalone import MARKER, EndpointSelector
from poolkeeper.controller.kubernetes.state import ClusterState
from poolkeeper.datastore.store import Datastore
from tests.kube.conftest import pod_obj
from tests.support.kubeconfig import write_kubeconfig


def _selector(text: str) -> EndpointSelector:
    return EndpointSelector("tiny-epp", "default", tuple(parse_label_selector(text)), (8000, 8001))


@pytest.mark.parametrize(
    ("selector", "labels", "selected"),
    [
        ("app=vllm", {"app": "vllm"}, True),
        ("app=vllm", {"app": "sglang"}, False),
        ("app in (vllm,sglang),tier!=canary", {"app": "sglang"}, True),
        ("app in (vllm,sglang),tier!=canary", {"app": "sglang", "tier": "canary"}, False),
        ("app notin (x)", {}, True),  # as Kubernetes: a missing label is "not in"
        ("gpu", {"gpu": ""}, True),
        ("!gpu", {"gpu": "a100"}, False),
    ],
)
def test_set_based_selectors_select_as_kubernetes_does(
    selector: str, labels: dict[str, str], selected: bool
) -> None:
    assert _selector(selector).matches(labels) is selected


def test_only_pods_are_read_and_the_pool_is_made_in_memory() -> None:
    state = ClusterState(("tiny-epp",), lambda labels: "vllm", standalone=_selector("app=vllm"))
    assert [c.kind for c in state.caches()] == [POD]  # the standalone chart grants pods only
    state.pods_cache.objects = {
        "default/a": pod_obj("a", "10.0.0.1"),
        "default/b": pod_obj("b", "10.0.0.2", app="other"),
        "default/c": pod_obj("c", "10.0.0.3", ready=False),
    }
    (pool,) = state.pools()
    assert (pool.namespace, pool.name, pool.target_ports()) == ("default", "tiny-epp", (8000, 8001))
    (spec,) = state.endpoints()
    assert spec.name == "a"
    assert spec.labels[MARKER] == "tiny-epp"
    endpoints = spec.for_pool(pool)
    assert [(e.name, e.hostport) for e in endpoints] == [
        ("a", "10.0.0.1:8000"),
        ("a-rank-1", "10.0.0.1:8001"),
    ]


async def test_the_flags_give_the_standalone_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("POD_NAME", "tiny-epp-7c9d8b6f4d-abcde")
    monkeypatch.setenv("NAMESPACE", "llm")
    options = parse_epp_args(
        ["--endpoint-selector", "app in (vllm)", "--endpoint-target-ports", "8000,8000,8001"]
    )
    seen = []

    def fake_run(serve: object, loop: str, *, json_logs: bool) -> int:
        seen.append(serve)
        return 0

    assert epp_cli._run(options, fake_run) == 0  # no longer refused
    assert seen
    config, _ = epp_setup.epp_gateway_config(options)
    source = epp_setup.epp_kubernetes_source(options, config)(Datastore())
    try:
        settings = source.settings
        assert settings.pool_names == ("tiny-epp",)  # the Deployment, from POD_NAME
        assert settings.lease_name == "epp-llm-tiny-epp.llm-d.ai"
        assert settings.standalone == EndpointSelector(
            "tiny-epp", "llm", (("app", "in", ("vllm",)),), (8000, 8001)
        )
    finally:
        await source.api.close()
