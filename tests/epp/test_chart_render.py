"""Acceptance (issue 32, items 1 and 8): llm-d-router's own EPP chart, rendered by a real Helm
with poolkeeper's image, runs poolkeeper's EPP unchanged under the chart's RBAC.

The renders are committed (`tests/epp/data/chart-rendered-*.yaml`, made by
`scripts/render-upstream-chart.sh` from an llm-d-router checkout; each file's header names the
commit, the Helm version and the command): CI reaches neither GitHub nor a chart repository.
From a render this test takes the Deployment's `epp` container (arguments, env, probes), the
ConfigMap it mounts at /config, the InferencePool, and the RBAC bound to the Deployment's
ServiceAccount. The API-server double enforces exactly those rules (tests/kube/rbac.py: any
request they do not cover gets kube-apiserver's 403), and the EPP must become ready on the
probe's own service name, route requests through an Envoy that dials it as upstream's
standalone preset does (TLS, ALPN h2; ORIGINAL_DST by the destination header), and never be
refused.

What differs from a cluster, and only that: the ConfigMap's files are in a temporary
directory instead of /config (the one argument rewritten); the ports (fixed 9002/9003/9090 in
the chart) are moved to free ones by three flags appended after the chart's, and the
listeners bind 127.0.0.1; the InferencePool's target port is the simulated pod's; env
`fieldRef`s are resolved as the kubelet would (namespace `llm`, a pod name of the Deployment).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from poolkeeper.cli import epp_setup
from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.netutil import free_ports
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.telemetry.health import SERVICE_UNKNOWN, SERVING, check_health
from tests.envoy.envoy_harness import supervised_envoy
from tests.epp.test_epp_kube import loopback_kubernetes_source
from tests.epp.test_epp_original_dst import original_dst_envoy
from tests.kube.conftest import fake
from tests.kube.fakeapi import FakeApiServer
from tests.kube.rbac import Rule, allows, allows_url, granted
from tests.support.kubeconfig import write_kubeconfig
from tests.support.waiting import eventually

__all__ = ["fake"]  # the API-server double fixture

DATA = Path(__file__).parent / "data"
IMAGE = "ghcr.io/poolkeeper/poolkeeper-epp:0.1.0"
POD_NAME = "qwen-epp-6d4b9c7f5-x2x9k"  # a pod of Deployment qwen-epp
MODEL = "Qwen/Qwen3-0.6B"  # no InferenceObjective names it (the chart creates none)
READER_TOKEN = "metrics-reader-token"  # the chart's SA-token Secret (monitoring on)


@dataclass(frozen=True)
class Render:
    """One committed `helm template` output."""

    name: str
    header: list[str]
    docs: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d.get("kind") == kind]

    @property
    def deployment(self) -> dict[str, Any]:
        (deployment,) = self.of_kind("Deployment")
        return deployment

    @property
    def namespace(self) -> str:
        return str(self.deployment["metadata"]["namespace"])

    @property
    def service_account(self) -> str:
        return str(self.deployment["spec"]["template"]["spec"]["serviceAccountName"])

    @property
    def container(self) -> dict[str, Any]:
        containers = self.deployment["spec"]["template"]["spec"]["containers"]
        (epp,) = [c for c in containers if c["name"] == "epp"]
        return dict(epp)

    @property
    def rules(self) -> list[Rule]:
        return granted(self.docs, self.namespace, self.service_account)

    def env(self) -> dict[str, str]:
        """The container's env as the kubelet sets it (fieldRefs resolved for POD_NAME)."""
        fields = {"metadata.namespace": self.namespace, "metadata.name": POD_NAME}
        out = {}
        for var in self.container.get("env") or ():
            ref = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            out[var["name"]] = fields[ref] if ref else str(var.get("value", ""))
        return out

    def config_files(self) -> dict[str, str]:
        """The files of the ConfigMap the container mounts at /config."""
        spec = self.deployment["spec"]["template"]["spec"]
        (mount,) = [m for m in self.container["volumeMounts"] if m["mountPath"] == "/config"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        (config_map,) = [
            c
            for c in self.of_kind("ConfigMap")
            if c["metadata"]["name"] == volume["configMap"]["name"]
        ]
        return dict(config_map["data"])


def load_render(name: str) -> Render:
    text = (DATA / f"chart-rendered-{name}.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("# ")][:5]
    docs = [d for d in yaml.safe_load_all(text) if d]
    return Render(name, header, docs)


GATEWAY_RENDERS = ("gateway", "gateway-ha")


@pytest.mark.parametrize("name", [*GATEWAY_RENDERS, "standalone"])
def test_the_renders_are_helms_with_poolkeepers_image(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    render = load_render(name)
    for key, value in render.env().items():
        monkeypatch.setenv(key, value)
    assert render.header[1].startswith("# llm-d-router commit: ")
    assert render.header[2].startswith("# helm: v3.")
    assert render.container["image"] == IMAGE
    assert "command" not in render.container  # the image's ENTRYPOINT runs with these args
    options = parse_epp_args(render.container["args"])
    assert not options.warnings  # not one argument needed the legacy tolerances


def test_the_renders_rbac_is_read_only_without_replicas() -> None:
    rules, ns = load_render("gateway").rules, "llm"
    for group, resource in [("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                            ("llm-d.ai", "inferenceobjectives"),
                            ("llm-d.ai", "inferencemodelrewrites")]:  # fmt: skip
        assert all(allows(rules, group, resource, v, ns) for v in ("get", "list", "watch"))
        assert not allows(rules, group, resource, "patch", ns)
        assert not allows(rules, group, resource, "list", "elsewhere")
    assert not allows(rules, "coordination.k8s.io", "leases", "create", ns)
    assert not allows(rules, "authentication.k8s.io", "tokenreviews", "create", None)
    ha = load_render("gateway-ha").rules
    assert allows(ha, "coordination.k8s.io", "leases", "update", ns)
    assert allows(ha, "authentication.k8s.io", "tokenreviews", "create", None)
    assert allows_url(ha, "/metrics", "get")


def _pod(namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "vllm-0", "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


@dataclass
class RunningEpp:
    ext_proc: int
    health: int
    metrics: int
    runtime: GatewayRuntime


@asynccontextmanager
async def rendered_epp(
    render: Render,
    fake: FakeApiServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sim_port: int,
) -> AsyncIterator[RunningEpp]:
    """`poolkeeper-epp` with the render's container arguments and env, against the double
    (the API server from a kubeconfig, as in-cluster config would give it); ready on the
    readiness probe's own service name when entered."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url, token="sa-token")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    for key, value in render.env().items():
        monkeypatch.setenv(key, value)
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    for file, content in render.config_files().items():
        (config_dir / file).write_text(content)
    args = [a.replace("/config/", f"{config_dir}/") for a in render.container["args"]]
    if "--endpoint-target-ports" in args:  # standalone: the chart's 8000 is the simulator's
        args[args.index("--endpoint-target-ports") + 1] = str(sim_port)
    ext_proc, health, metrics = free_ports(3)
    argv = [*args, f"--grpc-port={ext_proc}", f"--grpc-health-port={health}",
            f"--metrics-port={metrics}"]  # fmt: skip
    options = parse_epp_args(argv)
    source = loopback_kubernetes_source(options)
    serve = dataclasses.replace(epp_setup.epp_serve_options(options, source), ready_wait_s=5)
    runtime = GatewayRuntime(serve)
    await runtime.start()
    try:
        service = render.container["readinessProbe"]["grpc"]["service"]

        async def ready() -> bool:
            return await check_health(f"127.0.0.1:{health}", service) == SERVING

        await eventually(ready, f"readiness ({service})")
        yield RunningEpp(ext_proc, health, metrics, runtime)
    finally:
        await runtime.stop(grace_s=0)


async def _scrape(port: int, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics", headers=headers) as resp,
    ):
        return resp.status, await resp.text()


@pytest.mark.integration
@pytest.mark.parametrize("name", [*GATEWAY_RENDERS, "standalone"])
async def test_the_rendered_chart_serves_under_its_rbac(
    name: str, fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    render = load_render(name)
    fake.rbac = render.rules
    user = f"system:serviceaccount:{render.namespace}:{render.service_account}"
    fake.user = user
    fake.tokens[READER_TOKEN] = {"username": user}
    if allows_url(render.rules, "/metrics", "get"):
        fake.may_get.add((user, "/metrics"))
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings(model=MODEL)))
    sim_port = (await cluster.start())[0].port
    for objective in render.of_kind("InferenceObjective"):  # router.inferenceObjectives
        fake.put(objective, "inferenceobjectives")
    for pool in render.of_kind("InferencePool"):  # none in standalone (--endpoint-selector)
        pool["spec"]["targetPorts"] = [{"number": sim_port}]  # the chart's 8000: the simulator
        fake.put(pool, "inferencepools")
    fake.put(_pod(render.namespace, {"app": "vllm"}), "pods")  # router.modelServers.matchLabels
    other = _pod(render.namespace, {"app": "other"})  # not a model server of this chart
    other["metadata"]["name"], other["status"]["podIP"] = "other-0", "127.0.0.9"
    fake.put(other, "pods")
    try:
        async with (
            rendered_epp(render, fake, tmp_path, monkeypatch, sim_port) as epp,
            original_dst_envoy(tmp_path, epp.ext_proc, tls=True) as url,
        ):
            snapshot = epp.runtime.datastore.snapshot()
            pools = {"gateway": "llm/qwen", "gateway-ha": "llm/qwen", "standalone": "llm/qwen-epp"}
            assert snapshot.pool_keys() == (pools[name],)  # standalone: named after the Deployment
            assert [e.name for e in snapshot.all_endpoints()] == ["vllm-0"]
            client = openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30
            )
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    extra_headers={"x-llm-d-inference-objective": "premium"},
                )
                assert raw.http_response.status_code == 200
                assert raw.parse().choices[0].message.content
            finally:
                await client.close()
            # The probes' service names answer as upstream's (leader-aware with replicas 2).
            liveness = render.container["livenessProbe"]["grpc"]["service"]
            assert await check_health(f"127.0.0.1:{epp.health}", liveness) == SERVING
            unknown = await check_health(f"127.0.0.1:{epp.health}", "no-such-service")
            assert unknown == (SERVICE_UNKNOWN if name == "gateway-ha" else SERVING)
            # /metrics behind TokenReview + SubjectAccessReview (the chart leaves auth on)
            assert (await _scrape(epp.metrics, None))[0] == 401
            if name == "gateway-ha":  # monitoring on: the chart's ClusterRole allows the scrape
                status, text = await _scrape(epp.metrics, READER_TOKEN)
                assert status == 200
                # the chart's InferenceObjective (llm-d.ai/v1alpha2) set the priority
                (request_total,) = [
                    line
                    for line in text.splitlines()
                    if line.startswith("llm_d_epp_request_total{")
                ]
                assert 'priority="10"' in request_total
                assert 'llm_d_epp_average_running_requests{name="qwen"}' in text
                assert 'llm_d_epp_scheduler_attempts_total{endpoint_name="vllm-0' in text
                assert "llm_d_epp_datalayer_poll_errors_total{" in text
                assert 'llm_d_epp_flow_control_pool_saturation{inference_pool="qwen"' in text
        assert fake.refused == []  # never a 403 under the chart's RBAC
        # Read-only, but for the Lease when the chart asks for leader election (replicas 2).
        leases = {w.name for w in fake.writes if w.plural == "leases"}
        assert [w for w in fake.writes if w.plural != "leases"] == []
        assert leases == ({"epp-llm-qwen.llm-d.ai"} if name == "gateway-ha" else set())
        assert sum(s.engine.counters.requests_submitted for s in cluster.servers) == 1
    finally:
        await cluster.stop()


def _moved(node: Any, ports: dict[int, int]) -> Any:
    """The chart's Envoy config with its ports moved (`ports`), every listener on 127.0.0.1
    and no IPv6 twin listeners: the only changes made to upstream's `envoy.yaml`."""
    if isinstance(node, list):
        return [_moved(item, ports) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _moved(v, ports) for k, v in node.items() if k != "additional_addresses"}
    if "port_value" in out:
        out["port_value"] = ports[out["port_value"]]
        out["address"] = "127.0.0.1"
    return out


@pytest.mark.integration
async def test_the_standalone_charts_own_envoy_routes_through_poolkeeper(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llm-d-router-standalone's Envoy sidecar, from its own rendered ConfigMap (TLS to the
    EPP with ALPN h2, gRPC health checks of the ext_proc service on the ext_proc port,
    ORIGINAL_DST by the destination header), in front of poolkeeper's EPP run with the same
    render's arguments."""
    render = load_render("standalone")
    fake.rbac = render.rules
    (config_map,) = [c for c in render.of_kind("ConfigMap") if "envoy.yaml" in c["data"]]
    envoy_config = yaml.safe_load(config_map["data"]["envoy.yaml"])
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings(model=MODEL)))
    sim_port = (await cluster.start())[0].port
    fake.put(_pod(render.namespace, {"app": "vllm"}), "pods")
    try:
        async with rendered_epp(render, fake, tmp_path, monkeypatch, sim_port) as epp:
            admin, ready, listen = free_ports(3)
            moved = _moved(envoy_config, {19000: admin, 19001: ready, 8081: listen,
                                          9002: epp.ext_proc})  # fmt: skip
            path = tmp_path / "chart-envoy.yaml"
            path.write_text(yaml.safe_dump(moved))
            async with supervised_envoy(path, admin):
                client = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{listen}/v1",
                    api_key="unused",
                    max_retries=0,
                    timeout=30,
                )
                try:
                    for _ in range(3):
                        raw = await client.chat.completions.with_raw_response.create(
                            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                        )
                        assert raw.http_response.status_code == 200
                finally:
                    await client.close()
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"http://127.0.0.1:{admin}/stats?filter=^cluster.ext_proc") as resp,
                ):
                    stats = dict(line.split(": ", 1) for line in (await resp.text()).splitlines())
        assert int(stats["cluster.ext_proc.ssl.handshake"]) >= 1  # TLS to the EPP
        assert int(stats["cluster.ext_proc.health_check.success"]) >= 1  # its gRPC health check
        assert fake.refused == []
        # Routed by poolkeeper (FailOpen would pass them through with no destination: 503).
        assert sum(s.engine.counters.requests_submitted for s in cluster.servers) == 3
    finally:
        await cluster.stop()
