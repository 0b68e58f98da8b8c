"""`serve --kubernetes` end to end without a cluster: the runtime with the Kubernetes source
against the fake API server, a simulator as the one Ready pod, and the probes.

Readiness (gRPC `readiness` and HTTP /readyz) is upstream's: SERVING once the first sync is
done, and through an API outage (the staleness metric says for how long the state is old).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.cli import serve as serve_cli, serve_setup
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.kubernetes import (
    KubernetesResourceSource,
    KubeSettings,
    kubernetes_source,
    load_config,
)
from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import ConfigError
from poolkeeper.extproc.tls_certs import self_signed_pair
from poolkeeper.netutil import free_ports
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.telemetry.health import SERVING, check_health
from tests.extproc.test_extproc_tls import served_certificate
from tests.kube.conftest import NS, model_obj, pod_obj, pool_obj
from tests.kube.fakeapi import FakeApiServer
from tests.support.kubeconfig import write_kubeconfig
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


async def _stale_s(metrics_port: int) -> float:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp,
    ):
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("poolkeeper_resource_source_stale_seconds "):
            return float(line.split()[1])
    raise AssertionError("no poolkeeper_resource_source_stale_seconds in /metrics")


async def test_serve_kubernetes_stays_ready_through_an_api_outage(fake: FakeApiServer) -> None:
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings()))
    listening = await cluster.start()
    sim_port = listening[0].port
    fake.put(pool_obj(port=sim_port), "inferencepools")
    fake.put(model_obj("m", "m"), "inferencemodels")
    fake.put(pod_obj("sim-0", "127.0.0.1"), "pods")
    ext_proc, metrics, health = free_ports(3)
    gateway = GatewayConfig.model_validate(
        {"spec": {"listeners": {"extProc": ext_proc, "metrics": metrics, "health": health}}}
    )
    settings = KubeSettings(
        namespace=NS, identity="epp-0", backoff_initial_s=0.05, backoff_max_s=0.2
    )
    source = kubernetes_source(settings, gateway, load_config(server=fake.url))
    runtime = GatewayRuntime(
        ServeOptions(source=source, run_envoy=False, ready_wait_s=5, ready_once_synced=True)
    )
    health_addr = f"127.0.0.1:{health}"

    async def ready() -> bool:
        return await check_health(health_addr, "readiness") == SERVING

    await runtime.start()
    try:
        await eventually(ready, "readiness after the first sync and scrape")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{metrics}/readyz") as resp:
                assert resp.status == 200
            await fake.stop()  # the API server goes away: the watches drop

            async def stale() -> bool:
                return await _stale_s(metrics) > 0

            await eventually(stale, "the staleness metric to rise")
            assert await ready()  # still SERVING: the last known state is routed
            async with session.get(f"http://127.0.0.1:{metrics}/readyz") as resp:
                assert resp.status == 200
            await fake.start()

            async def in_step() -> bool:
                return await _stale_s(metrics) == 0

            await eventually(in_step, "back in step after the re-list")
            assert await ready()
            # The pool scaled to zero: still ready (the EPP answers its own 503).
            fake.delete("v1", "pods", NS, "sim-0")
            await eventually(
                lambda: asyncio.sleep(0, not runtime.datastore.snapshot().all_endpoints()),
                "the pod to leave",
            )
            assert await ready()
        # Only the leader writes status: this single replica took the Lease and wrote it.
        model = ("inference.networking.x-k8s.io/v1alpha2", "inferencemodels", NS, "m")

        async def written() -> bool:
            return "status" in fake.get(*model)

        await eventually(written, "the model's status")
    finally:
        await runtime.stop(grace_s=0)
        await cluster.stop()


@pytest.mark.parametrize(
    ("argv", "secure"),
    [
        (("--kubernetes",), True),
        (("--kubernetes", "--no-secure-serving"), False),
        (("-f", "x.yaml"), False),  # one machine: loopback plaintext to the managed Envoy
        (("-f", "x.yaml", "--no-envoy", "--secure-serving"), True),
        (("-f", "x.yaml", "--secure-serving"), True),  # the managed Envoy dials it over TLS
    ],
)
def test_tls_is_on_by_default_in_kubernetes_mode_only(argv: tuple[str, ...], secure: bool) -> None:
    assert serve_setup.tls_settings(_parse(*argv)).secure_serving is secure


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--kubernetes", "--enable-cert-reload"), "--enable-cert-reload needs --cert-path"),
        (("--kubernetes", "--tls-min-version", "VersionTLS13"), "grpcio cannot refuse TLS 1.2"),
        (("--kubernetes", "--tls-cipher-suites", "A,B"), "grpcio offers no cipher setting"),
    ],
)
def test_tls_flags_that_cannot_be_served_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        serve_setup.tls_settings(_parse(*argv))


def test_client_ca_file_is_for_an_epp_behind_another_envoy(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_bytes(self_signed_pair()[0])
    settings = serve_setup.tls_settings(_parse("--kubernetes", "--client-ca-file", str(ca)))
    assert settings.client_ca_file == ca
    no_envoy = ("-f", "x.yaml", "--no-envoy", "--secure-serving", "--client-ca-file", str(ca))
    assert serve_setup.tls_settings(_parse(*no_envoy)).client_ca_file == ca
    # The Envoy serve runs has no client certificate to present: refused, not 503s.
    with pytest.raises(ConfigError, match="the Envoy serve runs presents no client cert"):
        serve_setup.tls_settings(
            _parse("-f", "x.yaml", "--secure-serving", "--client-ca-file", str(ca))
        )
    with pytest.raises(ConfigError, match="--client-ca-file needs --secure-serving"):
        serve_setup.tls_settings(
            _parse("--kubernetes", "--no-secure-serving", "--client-ca-file", str(ca))
        )
    with pytest.raises(ConfigError, match=r"--client-ca-file .*nope\.crt: cannot read it"):
        serve_setup.tls_settings(
            _parse("--kubernetes", "--client-ca-file", str(tmp_path / "nope.crt"))
        )


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "no files given: pass -f PATH, or --kubernetes"),
        (("-f", "x.yaml", "--pool", "p"), "--pool needs --kubernetes"),
        (("-f", "x.yaml", "--namespace", "n"), "--namespace needs --kubernetes"),
        (("--kubernetes", "--kubeconfig", "/nonexistent/kubeconfig"), "no such file"),
    ],
)
def test_serve_flags_are_checked(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse(*argv)
    assert args.handler(args) == 2
    assert message in capsys.readouterr().err


async def test_serve_flags_build_the_source_from_a_kubeconfig(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    fake.put(pool_obj(), "inferencepools")
    fake.put(pool_obj("other", app="other"), "inferencepools")
    fake.put(pod_obj("p0", "10.0.0.1"), "pods")
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig", fake.url, token="not-checked", namespace=NS
    )
    gw = tmp_path / "gw.yaml"
    gw.write_text(
        "apiVersion: poolkeeper.dev/v1alpha1\nkind: GatewayConfig\nmetadata: {name: gw}\n"
        "spec: {listeners: {address: 0.0.0.0}}\n"
    )
    args = _parse(
        "--kubernetes", "--kubeconfig", str(kubeconfig), "--pool", "pool", "-f", str(gw),
        "--identity", "epp-test", "--no-status",
    )  # fmt: skip
    factory = serve_setup.resource_source(args)
    store = Datastore()
    source = factory(store)
    assert isinstance(source, KubernetesResourceSource)
    assert source.settings.namespace == NS  # from the kubeconfig context
    assert source.settings.identity == "epp-test"
    assert not source.settings.write_status
    config = await source.start()
    try:
        assert config.spec.listeners.address == "0.0.0.0"
        assert store.snapshot().pool_keys() == ("default/pool",)
        assert [e.hostport for e in store.snapshot().endpoints("default/pool")] == ["10.0.0.1:8000"]
        assert any("Authorization" in h for h in fake.headers_seen)
    finally:
        await source.api.close()


async def test_readme_steps_never_wait_on_a_later_one(fake: FakeApiServer, tmp_path: Path) -> None:
    """README's Kubernetes steps against the double: step 3's `rollout status` needs the EPP
    Ready with nothing else in the namespace (no pool, model or model server: step 4 makes
    them); step 4's objects are then routed to. The options are the CLI's own."""
    ext_proc, metrics, health = free_ports(3)
    gw = tmp_path / "gw.yaml"
    gw.write_text(
        "apiVersion: poolkeeper.dev/v1alpha1\nkind: GatewayConfig\nmetadata: {name: gw}\n"
        f"spec: {{listeners: {{extProc: {ext_proc}, metrics: {metrics}, health: {health}}}}}\n"
    )
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url)
    args = _parse("--kubernetes", "--kubeconfig", str(kubeconfig), "-f", str(gw))
    options = serve_setup.serve_options(args, serve_setup.resource_source(args))
    assert (options.run_envoy, options.ready_once_synced, options.drain_timeout_s) == (
        False, True, 30.0,
    )  # fmt: skip
    assert options.tls.secure_serving  # upstream's --secure-serving default in a cluster
    assert not options.own_bootstrap  # behind the cluster's Gateway: no header limits of ours
    options.ready_wait_s = 0
    runtime = GatewayRuntime(options)
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings(model="m")))
    await runtime.start()
    try:
        # Step 3: `kubectl rollout status` waits for readiness, with an empty namespace.
        assert await check_health(f"127.0.0.1:{health}", "readiness") == SERVING
        # ext_proc speaks TLS with ALPN h2 (a self-signed cert), the health port plaintext.
        _, alpn = await asyncio.to_thread(served_certificate, ext_proc)
        assert alpn == "h2"
        # Step 4: the pool, its model and a model server appear; they are routed to.
        sim_port = (await cluster.start())[0].port
        fake.put(pool_obj(port=sim_port), "inferencepools")
        fake.put(model_obj("m", "m"), "inferencemodels")
        fake.put(pod_obj("sim-0", "127.0.0.1"), "pods")

        async def routable() -> bool:
            return runtime.director is not None and runtime.director.ready()

        await eventually(routable, "the model server to be routable")
        assert await check_health(f"127.0.0.1:{health}", "readiness") == SERVING
    finally:
        await runtime.stop(grace_s=0)
        await cluster.stop()
